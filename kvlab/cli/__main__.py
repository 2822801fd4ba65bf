"""``python -m kvlab.cli ...``: the ``kvlab`` command (the launchers of data-parallel runs use it)."""

from kvlab.cli.main import main

main()

"""The ``kvlab`` command, the top layer: one module per command.

- :mod:`kvlab.cli.main`: the command table and the console script's entry point;
- :mod:`kvlab.cli.predict`: ``kvlab predict`` (LightningCLI, run directory, fingerprint, resume);
- :mod:`kvlab.cli.sweep`: comma lists and ``sweep:`` blocks expanded into one run per point;
- :mod:`kvlab.cli.listing`: ``kvlab list``.

Nothing below this package imports it.
"""

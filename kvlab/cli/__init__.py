"""The ``kvlab`` command, the top layer: one module per command.

- :mod:`kvlab.cli.main`: the command table and the console script's entry point;
- :mod:`kvlab.cli.predict`: ``kvlab predict`` (the run plan run: run directory, fingerprint, resume);
- :mod:`kvlab.cli.sweep`: comma lists and ``sweep:`` blocks expanded into one run per point;
- :mod:`kvlab.cli.listing`: ``kvlab list``;
- :mod:`kvlab.cli.compare`: ``kvlab compare``;
- :mod:`kvlab.cli.bench`: ``kvlab bench``;
- :mod:`kvlab.cli.check_model`: ``kvlab check-model``;
- :mod:`kvlab.cli.reference_table`: ``kvlab reference-table``;
- :mod:`kvlab.cli.calibrate`: ``kvlab calibrate``.

Nothing below this package imports it.
"""

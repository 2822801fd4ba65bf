"""Configuration, the ground layer: every other package may import it, and it imports none of them.

- :mod:`kvlab.config.errors`: :class:`~kvlab.config.errors.ConfigError`, one-paragraph messages;
- :mod:`kvlab.config.registry`: :class:`~kvlab.config.registry.Registry` (a name to a dataclass,
  built from YAML and validated) and :data:`~kvlab.config.registry.REGISTRIES`, every registry;
- :mod:`kvlab.config.capabilities`: :class:`~kvlab.config.capabilities.Capabilities` and
  :class:`~kvlab.config.capabilities.Component`, the base of every component kind;
- :mod:`kvlab.config.papers`: the papers components follow;
- :mod:`kvlab.config.loader`: preset lookup, ``preset:`` inheritance, merged overrides;
- :mod:`kvlab.config.yaml_text`: strict YAML (no duplicate keys, alias bombs, deep nesting);
- :mod:`kvlab.config.names`: run names as single path components inside ``run.dir``;
- :mod:`kvlab.config.values`: finite numbers within what the engine can index;
- :mod:`kvlab.config.plugins`: user components (``imports:`` in YAML, entry points);
- :mod:`kvlab.config.artefacts`: calibration artefact files (format, lookup, checks);
- :mod:`kvlab.config.compression`: :func:`~kvlab.config.compression.compression_config`, the
  ``model.compression`` node of a preset, a file or a dict.

The ``kvlab`` command, sweeps included, is :mod:`kvlab.cli`, the top layer.
"""

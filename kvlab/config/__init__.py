"""Configuration: config files and presets, the component registries, sweeps, errors and the CLI."""

"""``kvlab bench <name> [options]``: runs one bench of :data:`kvlab.bench.BENCHES`."""

from __future__ import annotations

import importlib
import sys

from kvlab import bench
from kvlab.config.errors import ConfigError, did_you_mean


def usage() -> str:
    lines = ["usage: kvlab bench {" + ",".join(bench.BENCHES) + "} [options]", ""]
    lines += [f"  kvlab bench {name:<10} {doc}" for name, (_, doc) in bench.BENCHES.items()]
    return "\n".join(lines)


def main(args: list[str]) -> None:
    """Entry point of ``kvlab bench``: the bench's module is imported by name when it runs (each
    pulls in what it measures; ``kvlab bench --help`` imports none of them)."""
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout)
        return
    name, rest = args[0], args[1:]
    names = list(bench.BENCHES)
    if name not in names:
        raise ConfigError(f"unknown bench '{name}'.{did_you_mean(name, names)} Benches: {', '.join(names)}.")
    try:
        module = importlib.import_module(bench.BENCHES[name][0])
    except ModuleNotFoundError as missing:  # a bench's own dependency (e.g. triton for `kernels`)
        if missing.name is None or missing.name.split(".")[0] == "kvlab":
            raise
        raise ConfigError(
            f"kvlab bench {name} needs the package '{missing.name}', which is not installed: "
            f"`pip install {missing.name.split('.')[0]}` (the `dev` extra has it)."
        ) from None
    module.run(rest)

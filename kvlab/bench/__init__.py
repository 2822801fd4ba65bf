"""``kvlab bench <name> [options]``: benchmarks that print tables (not tests: nothing is asserted).

Benchmarks live in this package, one module per bench, each exposing ``run(args: list[str])``
(its own argparse options; ``kvlab bench <name> --help`` lists them). :data:`BENCHES` maps a
bench name to its module and a one-line help; modules are imported only when their bench
runs. To add a bench, write ``kvlab/bench/<module>.py`` with ``run`` and add one entry to
:data:`BENCHES` (or call :func:`register_bench` from code that is imported before the CLI runs).
"""

from __future__ import annotations

import importlib
import sys

from kvlab.config.errors import ConfigError, did_you_mean

# name -> (module with a ``run(args)`` function, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "decode": ("kvlab.bench.decode", "ragged decode attention: Triton, torch reference, SDPA full/padded"),
    "window": ("kvlab.bench.window", "window-attention scoring: Triton two-pass kernel vs naive reference"),
    "memory": ("kvlab.bench.memory", "KV bytes and decode time: ragged head budgets vs full vs masking"),
    "scoring": ("kvlab.bench.scoring", "compression time of MixKV scoring vs its host (SnapKV)"),
    "retrieval": ("kvlab.bench.retrieval", "device KV, fetched bytes, decode time: retrieval vs full/snapkv"),
    "kernels": ("kvlab.bench.kernels", "every Triton kernel: GB/s vs peak and copy, speedup (CUDA only)"),
}


def register_bench(name: str, module: str, help: str) -> None:
    """Make ``kvlab bench <name>`` run ``module.run(args)``."""
    BENCHES[name] = (module, help)


def usage() -> str:
    lines = ["usage: kvlab bench {" + ",".join(BENCHES) + "} [options]", ""]
    lines += [f"  kvlab bench {name:<10} {doc}" for name, (_, doc) in BENCHES.items()]
    return "\n".join(lines)


def main(args: list[str]) -> None:
    """Entry point of ``kvlab bench``."""
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout)
        return
    name, rest = args[0], args[1:]
    if name not in BENCHES:
        raise ConfigError(
            f"unknown bench '{name}'.{did_you_mean(name, list(BENCHES))} Benches: {', '.join(BENCHES)}."
        )
    importlib.import_module(BENCHES[name][0]).run(rest)

"""Benchmarks that print tables (not tests: nothing is asserted), run by ``kvlab bench <name> [options]``.

Benchmarks live in this package, one module per bench, each exposing ``run(args: list[str])``
(its own argparse options; ``kvlab bench <name> --help`` lists them). :data:`BENCHES` maps a
bench name to its module and a one-line help; :mod:`kvlab.cli.bench` imports a module only when
its bench runs. To add a bench, write ``kvlab/bench/<module>.py`` with ``run`` and add one entry
to :data:`BENCHES` (or call :func:`register_bench` from code that is imported before the CLI runs).
"""

from __future__ import annotations

# name -> (module with a ``run(args)`` function, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "decode": ("kvlab.bench.decode", "ragged decode attention: Triton, torch reference, SDPA full/padded"),
    "window": ("kvlab.bench.window", "window-attention scoring: Triton two-pass kernel vs naive reference"),
    "memory": ("kvlab.bench.memory", "KV bytes and decode time: ragged head budgets vs full vs masking"),
    "scoring": ("kvlab.bench.scoring", "compression time of MixKV scoring vs its host (SnapKV)"),
    "retrieval": ("kvlab.bench.retrieval", "device KV, fetched bytes, decode time: retrieval vs full/snapkv"),
    "kernels": ("kvlab.bench.kernels", "every Triton kernel: GB/s vs peak and copy, speedup (CUDA only)"),
    "e2e": (
        "kvlab.bench.e2e",
        "8B-class model end to end: TTFT, decode tok/s, peak memory, KV kept vs transformers",
    ),
}


def register_bench(name: str, module: str, help: str) -> None:
    """Make ``kvlab bench <name>`` run ``module.run(args)``."""
    BENCHES[name] = (module, help)

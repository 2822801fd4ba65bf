"""The ``kvlab`` console script: the command table and its dispatch.

``kvlab <command> [arguments]`` looks the command up in :data:`COMMANDS` and runs its handler
under :func:`kvlab.runner.guards.guarded` (disk full and permission errors become a
one-paragraph message, Ctrl-C exits 130). A bad command or configuration exits with status 2 and
a one-paragraph message on stderr. Each command's code lives in its own module and is imported
only when that command runs, so ``kvlab --help`` and ``kvlab list`` start fast.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.plugins import load_entry_points
from kvlab.runner.guards import guarded


def lazy_main(module: str) -> Callable[[list[str]], None]:
    """A command handler that imports ``module`` only when the command runs, then calls its ``main(args)``.

    The import is by name at run time so that ``kvlab list`` and ``kvlab --help`` do not pay for
    every command's imports (``kvlab predict`` alone pulls in Lightning, the engine and metrics).
    """

    def handler(args: list[str]) -> None:
        importlib.import_module(module).main(args)

    return handler


# name -> (handler taking the remaining arguments, one-line help)
COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "predict": (lazy_main("kvlab.cli.predict"), "run a method on a dataset (kvlab predict --help)"),
    "list": (lazy_main("kvlab.cli.listing"), "components, parameters, defaults, presets"),
    "compare": (
        lazy_main("kvlab.cli.compare"),
        "table and plots of an experiment's runs (kvlab compare DIR)",
    ),
    "calibrate": (
        lazy_main("kvlab.cli.calibrate"),
        "measure per-model statistics into a calibration artefact (kvlab calibrate --help)",
    ),
    "check-model": (
        lazy_main("kvlab.cli.check_model"),
        "kvlab's engine vs transformers' own forward on a model (kvlab check-model MODEL --lengths 256,2048)",
    ),
    "bench": (lazy_main("kvlab.cli.bench"), "benchmarks printing tables: kernels, memory, scoring"),
    "reference-table": (
        lazy_main("kvlab.cli.reference_table"),
        "methods x budgets on the synthetic tasks with smollm2-135m (docs/evaluation.md); "
        "--suite ruler: the RULER-style suite under query_aware/query_agnostic",
    ),
}


def usage() -> str:
    lines = [f"usage: kvlab {{{','.join(COMMANDS)}}} ...", ""]
    lines += [f"  kvlab {name:<16} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kvlab`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    command, args = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            raise ConfigError(
                f"unknown command '{command}'.{did_you_mean(command, list(COMMANDS))} "
                f"Commands: {', '.join(COMMANDS)}."
            )
        load_entry_points()
        guarded(COMMANDS[command][0], args)  # disk full, permissions -> ConfigError; Ctrl-C -> 130
    except ConfigError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

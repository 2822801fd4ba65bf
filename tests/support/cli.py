"""``kvlab predict`` as the tests run it: a tiny model's arguments, JSONL input files, a run into
``<tmp_path>/runs/exp/<config stem>``, and metrics compared without their timings."""

import json
from pathlib import Path

from kvlab.cli.main import main

#: the tiny model, for datasets whose samples carry their own answer limit (an explicit
#: ``--model.max_new_tokens`` that would not apply to them is refused)
TINY_MODEL = ["--model.model", "tiny-llama", "--trainer.enable_progress_bar", "false"]
TINY = [*TINY_MODEL, "--model.max_new_tokens", "4"]


def write_jsonl(path, rows):
    """One JSON object per line; a str row is written as it is (for malformed-file tests)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def predict(tmp_path, *args):
    """``kvlab predict`` into ``<tmp_path>/runs/exp/<config stem>`` (``--run.method`` set, so command-line
    overrides do not name the run; ``tests/runner/test_resume.py`` tests that naming)."""
    stem = Path(args[args.index("--config") + 1]).stem if "--config" in args else "method"
    main(
        [
            "predict",
            *args,
            "--run.dir",
            str(tmp_path / "runs"),
            "--run.experiment",
            "exp",
            "--run.method",
            stem,
        ]
    )


#: metrics whose names contain these differ between two runs of the same command
TIMING = ("_seconds", "per_second", "peak_memory", "compression_over_prefill")


def without_timings(metrics: dict) -> dict:
    """``metrics`` without the fields that time the run (they differ between equal runs)."""
    return {k: v for k, v in metrics.items() if not any(t in k for t in TIMING)}

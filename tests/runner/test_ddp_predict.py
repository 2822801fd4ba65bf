"""Data-parallel predict on CPU (Lightning DDP, gloo, 2 processes): per-rank shards merged by rank 0
into dataset order equal a one-process run; a run whose rank died mid-shard completes only the
missing samples."""

import json
import os
import subprocess
import sys

import pytest
from support.cli import without_timings, write_jsonl

from kvlab.cli.main import main
from kvlab.runner.writer import shard_name


def command(data, root, method):
    return ["predict", "--config", "snapkv", "--model.compression.budget", "{tokens: 12, window: 4}",
            "--model.model", "tiny-llama", "--model.max_new_tokens", "2", "--model.fidelity", "false",
            "--trainer.enable_progress_bar", "false", "--data.dataset", f"{{name: jsonl, path: {data}}}",
            "--data.batch_size", "1", "--run.dir", str(root), "--run.experiment", "e",
            "--run.method", method]  # fmt: skip


def same_metrics(got, expected):
    """Non-timing metrics equal (means of floats up to summation order)."""
    got, expected = without_timings(got), without_timings(expected)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == (pytest.approx(value, rel=1e-9) if isinstance(value, float) else value), key


def lines(run):
    return [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    rows = [{"id": f"s{i}", "prompt": "word " * (15 + 4 * i), "answers": ["word"]} for i in range(5)]
    data = write_jsonl(tmp / "d.jsonl", rows)
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "kvlab.cli", *command(data, tmp, "ddp"), *ddp],
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    main(command(data, tmp, "one"))
    return tmp / "e", data


def test_two_ranks_merge_into_the_one_process_run(runs):
    exp, _ = runs
    one, ddp = lines(exp / "one"), lines(exp / "ddp")
    assert [r["id"] for r in ddp] == [r["id"] for r in one] == [f"s{i}" for i in range(5)]
    for a, b in zip(one, ddp, strict=True):
        assert without_timings(a) == without_timings(b)
    assert not list((exp / "ddp").glob("predictions.rank*.jsonl"))  # merged, then removed
    got, expected = (json.loads((exp / m / "metrics.json").read_text()) for m in ("ddp", "one"))
    same_metrics(got, expected)
    assert got["samples"] == 5


def test_a_rank_that_died_mid_shard_is_completed_and_nothing_else_is_redone(runs, tmp_path):
    exp, data = runs
    records = lines(exp / "ddp")
    run = tmp_path / "e" / "m"
    run.mkdir(parents=True)
    (run / "run.json").write_bytes((exp / "ddp" / "run.json").read_bytes())
    for r in records:
        r["written_before"] = True
    # rank 0 finished s0, s2, s4; rank 1 wrote s1 and died half-way through s3's line
    (run / shard_name(0)).write_text("".join(json.dumps(records[i]) + "\n" for i in (0, 2, 4)))
    (run / shard_name(1)).write_text(json.dumps(records[1]) + "\n" + json.dumps(records[3])[:40])
    main(command(data, tmp_path, "m"))
    merged = lines(run)
    assert [r["id"] for r in merged] == [f"s{i}" for i in range(5)]
    assert [r.get("written_before", False) for r in merged] == [True, True, True, False, True]
    unmarked = {k: v for k, v in records[3].items() if k != "written_before"}
    assert without_timings(merged[3]) == without_timings(unmarked)
    assert not list(run.glob("predictions.rank*.jsonl"))
    got, expected = (json.loads((r / "metrics.json").read_text()) for r in (run, exp / "one"))
    same_metrics(got, expected)

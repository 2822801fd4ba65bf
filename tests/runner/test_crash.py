"""A run killed with SIGKILL (mid-line, between batches, after the last batch but before
metrics.json) and started again with the same command finishes with every sample exactly once
and the metrics of an uninterrupted run."""

import json
import os
import subprocess
import sys

from support.cli import without_timings, write_jsonl

from kvlab.cli.main import main

# the kill hook lives in the test: the run kills itself right after writing batch KILL_AFTER
# (first adding half a line when KILL_PARTIAL is set), as SIGKILL at that moment would
SCRIPT = """
import os, signal, sys
from kvlab.runner import writer
from kvlab.cli.main import main
after, partial = int(os.environ.get("KILL_AFTER", "0")), os.environ.get("KILL_PARTIAL")
write, count = writer.PredictionWriter.write_on_batch_end, [0]
def killing(self, *args, **kwargs):
    write(self, *args, **kwargs)
    count[0] += 1
    if count[0] == after:
        if partial:
            with self.path.open("a") as f:
                f.write('{"id": "half a rec')
        os.kill(os.getpid(), signal.SIGKILL)
writer.PredictionWriter.write_on_batch_end = killing
main(sys.argv[1:])
"""


def command(data, root):
    return ["predict", "--config", "snapkv", "--model.compression.budget", "{tokens: 12, window: 4}",
            "--model.model", "tiny-llama", "--model.max_new_tokens", "3", "--model.fidelity", "false",
            "--trainer.enable_progress_bar", "false", "--data.dataset", f"{{name: jsonl, path: {data}}}",
            "--data.batch_size", "1",
            "--run.dir", str(root), "--run.experiment", "e", "--run.method", "m"]  # fmt: skip


def run_killed(args, after, partial=False):
    env = {**os.environ, "KILL_AFTER": str(after), "OMP_NUM_THREADS": "1"}
    if partial:
        env["KILL_PARTIAL"] = "1"
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True)


def test_killed_runs_resume_to_every_sample_once_and_the_same_metrics(tmp_path):
    rows = [{"id": f"s{i}", "prompt": "word " * (15 + 4 * i), "answers": ["word"]} for i in range(5)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    args = command(data, tmp_path / "killed")
    run = tmp_path / "killed" / "e" / "m"
    for after, partial, lines in ((1, True, 1), (2, False, 3), (2, False, 5)):  # batches per process
        result = run_killed(args, after, partial)
        assert result.returncode == -9, result.stderr[-2000:]
        text = (run / "predictions.jsonl").read_text()
        assert len(text.splitlines()) == lines + partial, text
        assert not (run / "metrics.json").exists()  # killed before the end of the run
        assert not list(run.glob(".*.tmp"))
    main(args)  # the same command, uninterrupted: nothing left to predict, writes the metrics
    main(command(data, tmp_path / "whole"))
    whole = tmp_path / "whole" / "e" / "m"
    ids = [json.loads(line)["id"] for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert ids == [f"s{i}" for i in range(5)]
    outputs = lambda r: [json.loads(x)["output"] for x in (r / "predictions.jsonl").read_text().splitlines()]  # noqa: E731
    assert outputs(run) == outputs(whole)
    got, expected = (json.loads((r / "metrics.json").read_text()) for r in (run, whole))
    assert without_timings(got) == without_timings(expected) and got["samples"] == 5

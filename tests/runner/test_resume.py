"""A run directory holds one run: the same command resumes it, a different one refuses (naming the
differing fields and the ways out), ``--run.overwrite true`` starts afresh, and command-line
overrides name their own directory unless ``--run.method`` is given."""

import json

import pytest
from support.cli import write_jsonl

import kvlab.models
from kvlab.cli.main import main
from kvlab.runner.fingerprint import RUN_JSON
from kvlab.runner.run_names import override_suffix

TINY = ["--model.model", "tiny-llama", "--trainer.enable_progress_bar", "false",
        "--model.max_new_tokens", "2", "--model.fidelity", "false"]  # fmt: skip
SNAP = ["--config", "snapkv", "--model.compression.budget.window", "4"]


@pytest.fixture
def data(tmp_path):
    rows = [{"id": f"s{i}", "prompt": "word " * (20 + 5 * i), "answers": ["word"]} for i in range(3)]
    return write_jsonl(tmp_path / "d.jsonl", rows)


def predict(tmp_path, data, *args):
    dataset = ["--data.dataset", f"{{name: jsonl, path: {data}}}"]
    main(
        [
            "predict",
            *SNAP,
            *args,
            *TINY,
            *dataset,
            "--run.dir",
            str(tmp_path / "runs"),
            "--run.experiment",
            "e",
        ]
    )


def snapshot(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_the_same_command_resumes_and_records_its_fingerprint(tmp_path, data, capsys):
    args = ["--model.compression.budget.tokens", "12", "--run.method", "m"]
    predict(tmp_path, data, *args)
    run = tmp_path / "runs" / "e" / "m"
    lines = (run / "predictions.jsonl").read_text().splitlines()
    (run / "predictions.jsonl").write_text("\n".join(lines[:2]) + "\n")  # as if killed after 2 samples
    capsys.readouterr()
    predict(tmp_path, data, *args)
    assert "2 samples already written are skipped" in capsys.readouterr().out
    assert [json.loads(line)["id"] for line in (run / "predictions.jsonl").read_text().splitlines()] == [
        "s0", "s1", "s2"
    ]  # fmt: skip
    record = json.loads((run / RUN_JSON).read_text())
    assert len(record["fingerprint"]) == 16
    assert record["fields"]["model"]["compression"]["budget"]["tokens"] == 12
    assert record["fields"]["model"]["model"] == "tiny-llama"
    assert "batch_size" not in record["fields"]["data"] and "kernels" not in record["fields"]["model"]


def test_a_different_budget_refuses_naming_the_field_and_the_ways_out(tmp_path, data, capsys, monkeypatch):
    predict(tmp_path, data, "--model.compression.budget.tokens", "12", "--run.method", "m")
    run = tmp_path / "runs" / "e" / "m"
    before = snapshot(run)

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the fingerprint was checked")

    monkeypatch.setattr(kvlab.models, "load_model", forbidden)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        predict(tmp_path, data, "--model.compression.budget.tokens", "8", "--run.method", "m")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.compression.budget.tokens: 12 -> 8" in err
    assert "--run.method" in err and "--run.overwrite true" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert snapshot(run) == before  # nothing in the directory changed


def test_overwrite_starts_afresh_with_the_new_fingerprint(tmp_path, data):
    predict(tmp_path, data, "--model.compression.budget.tokens", "12", "--run.method", "m")
    predict(
        tmp_path,
        data,
        "--model.compression.budget.tokens",
        "8",
        "--run.method",
        "m",
        "--run.overwrite",
        "true",
    )
    run = tmp_path / "runs" / "e" / "m"
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["s0", "s1", "s2"]
    assert {c for r in records for row in r["kept_per_layer_head"] for c in row} == {8}
    assert json.loads((run / RUN_JSON).read_text())["fields"]["model"]["compression"]["budget"]["tokens"] == 8
    assert json.loads((run / "metrics.json").read_text())["samples"] == 3


def test_overrides_name_their_own_directory_and_an_explicit_method_wins(tmp_path, data):
    predict(tmp_path, data, "--model.compression.budget.tokens", "12")
    predict(tmp_path, data, "--model.compression.budget.tokens", "8", "--run.method", "mine")
    names = sorted(p.name for p in (tmp_path / "runs" / "e").iterdir() if (p / "metrics.json").exists())
    assert names == [
        "mine",
        "snapkv@budget.window=4,budget.tokens=12,name=jsonl,path=d.jsonl,model=tiny-llama,max_new_tokens=2,"
        "fidelity=False",
    ]


def test_override_suffix_names_leaves_paths_and_cuts_long_names():
    assert override_suffix([("model.compression.budget.ratio", "0.1")]) == "budget.ratio=0.1"
    assert (
        override_suffix([("data.dataset", "{name: jsonl, path: /a/b/qa.jsonl}")])
        == "name=jsonl,path=qa.jsonl"
    )
    assert (
        override_suffix([("model.max_new_tokens", "4"), ("model.max_new_tokens", "8")]) == "max_new_tokens=8"
    )
    long = override_suffix([(f"model.compression.k{i}", "x" * 10) for i in range(20)])
    assert len(long) == 120 and long[-9] == "~"


@pytest.mark.parametrize(
    "change",
    [
        ("--data.limit", "2"),  # another selection of samples
        ("--data.long_prompts", "truncate_left"),  # how long prompts are built
        ("--data.chat_template", "none"),  # how every prompt is formatted
    ],
    ids=["limit", "long_prompts", "chat_template"],
)
def test_a_resume_with_another_sample_selection_is_refused_and_leaves_the_run_intact(
    tmp_path, data, capsys, change
):
    """Everything that changes which samples run or how they are built is in the fingerprint: the
    same directory refuses it (exit 2, naming the field) and the run's files stay byte-identical."""
    predict(tmp_path, data, "--run.method", "m")
    run = tmp_path / "runs" / "e" / "m"
    before = snapshot(run)
    with pytest.raises(SystemExit) as exit_info:
        predict(tmp_path, data, "--run.method", "m", *change)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"data.{change[0].split('.')[1]}" in err and "holds a different run" in err
    assert snapshot(run) == before


def test_a_resume_reports_lines_it_cannot_count_and_never_counts_them(tmp_path, data, capsys):
    """A line that is valid JSON but not an object, and a line of a sample that is not in the run,
    are reported with their line numbers; the resumed metrics count only the run's samples."""
    predict(tmp_path, data, "--run.method", "m")
    run = tmp_path / "runs" / "e" / "m"
    lines = (run / "predictions.jsonl").read_text().splitlines()
    stranger = {**json.loads(lines[0]), "id": "not-in-the-dataset"}
    edited = [lines[0], '["a", "list"]', json.dumps(stranger)]  # s1 and s2 are to be redone
    (run / "predictions.jsonl").write_text("\n".join(edited) + "\n")
    capsys.readouterr()
    predict(tmp_path, data, "--run.method", "m")
    out = capsys.readouterr().out
    assert "predictions.jsonl line 2 is not a JSON object with an 'id'" in out
    assert "predictions.jsonl line 3 has id 'not-in-the-dataset'" in out
    assert "1 samples already written are skipped" in out
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["samples"] == 3  # s0 (resumed), s1 and s2: never the stranger


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_files_are_created_with_the_users_umask(tmp_path, umask):
    """``config.yaml``, ``metrics.json`` and ``run.json`` are written atomically through a temporary
    file (``mkstemp`` makes it 0600); the result gets the mode any new file gets."""
    import os

    from kvlab.runner.files import atomic_write_text

    old = os.umask(umask)
    try:
        path = atomic_write_text(tmp_path / "metrics.json", "{}\n")
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask == plain.stat().st_mode & 0o777


def test_a_resumed_runs_end_of_run_figures_cover_every_sample(tmp_path, data, monkeypatch):
    """The run-level heatmap of a resumed run is the mean over every sample of predictions.jsonl
    (read back from the file), not over the samples the resuming process predicted."""
    import torch

    import kvlab.runner.views.summary as summary

    drawn = []
    real = summary.heatmap_figure
    monkeypatch.setattr(
        summary, "heatmap_figure", lambda share, title: drawn.append(share) or real(share, title)
    )
    args = ["--model.compression.budget.tokens", "12", "--model.compression.allocate.head", "{name: adakv}"]
    predict(tmp_path, data, *args, "--run.method", "ada")  # ragged per-head budgets: a heatmap to draw
    run = tmp_path / "runs" / "e" / "ada"
    lines = (run / "predictions.jsonl").read_text().splitlines()
    (run / "predictions.jsonl").write_text(lines[0] + "\n")  # as if killed after the first sample
    drawn.clear()
    predict(tmp_path, data, *args, "--run.method", "ada")
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 3 and len(drawn) == 1
    every = torch.stack(
        [torch.tensor(r["kept_per_layer_head"], dtype=torch.float32) / r["prompt_tokens"] for r in records]
    ).mean(0)
    assert torch.allclose(drawn[0], every)

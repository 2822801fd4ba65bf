"""The catalogue of bad inputs: each stops ``kvlab predict`` with a one-paragraph message naming the
field or sample and the fix, exit status 2 (130 for Ctrl-C), and leaves an earlier run untouched.

:data:`CASES` is the table (id, what to change, message fragments, whether the model may load);
docs/troubleshooting.md lists the same errors for users. Failures of the machine (disk full, Ctrl-C)
and the long-prompt option have their own tests below the table.
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

import kvlab.data.long_prompts as long_prompts
import kvlab.models
import kvlab.runner.datamodule as datamodule
import kvlab.runner.guards as guards
from kvlab.cli.main import main
from kvlab.config.artefacts import Artefact
from kvlab.config.errors import ConfigError
from kvlab.data import Sample
from kvlab.engine.protocols import QueryAware
from kvlab.runner.datamodule import KVLabDataModule

BASE = [
    "--config", "snapkv",
    "--model.model", "tiny-llama",
    "--model.max_new_tokens", "2",
    "--model.fidelity", "false",
    "--model.inspect_samples", "0",
    "--trainer.enable_progress_bar", "false",
    "--data.batch_size", "1",
    "--model.compression.budget", "{tokens: 16, window: 4}",
]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    """One JSON object per line; a str row is written as it is (malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def dataset_arg(path: Path) -> list[str]:
    return ["--data.dataset", f"{{name: jsonl, path: {path}}}"]


def run_kvlab(tmp_path: Path, *args: str) -> None:
    """``kvlab predict`` of the base command plus ``args`` (later arguments win), runs under tmp_path."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"id": f"s{i}", "prompt": "word " * 20} for i in range(2)])
    main(["predict", *BASE, *dataset_arg(good), "--run.dir", str(tmp_path / "runs"),
          "--run.experiment", "exp", *args])  # fmt: skip


def run_dir(root: Path) -> Path:
    """The one run directory under ``root/runs/exp`` (its name carries the command's overrides)."""
    (found,) = [p for p in (root / "runs" / "exp").iterdir() if p.is_dir() and p.name != "reference"]
    return found


def ids(run: Path) -> list[str]:
    """The sample ids of a run's predictions file, in file order."""
    return [json.loads(line)["id"] for line in (run / "predictions.jsonl").read_text().splitlines()]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes)."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of the base command (2 samples): the directory each case must leave untouched."""
    root = tmp_path_factory.mktemp("earlier")
    run_kvlab(root)
    assert ids(run_dir(root)) == ["s0", "s1"]
    return root / "runs"


@pytest.fixture
def restore_sigint():
    """Lightning leaves SIGINT ignored after a KeyboardInterrupt; put the handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


# ---------------------------------------------------------------------------------------------
# the table: each builder gets tmp_path and returns the extra arguments of the bad command


def yaml_file(text: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        (tmp / "bad.yaml").write_text(text)
        return ["--config", str(tmp / "bad.yaml")]

    return build


def jsonl_rows(rows: list[dict | str]) -> Callable[[Path], list[str]]:
    return lambda tmp: dataset_arg(write_jsonl(tmp / "bad.jsonl", rows))


def image_rows(image: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        Image.new("RGB", (8, 8)).save(tmp / "ok.png")
        (tmp / "broken.png").write_bytes(b"not a png at all")
        rows = [
            {"id": "good", "prompt": "a", "images": ["ok.png"]},
            {"id": "img-7", "prompt": "b", "images": [image]},
        ]
        return ["--model.model", "tiny-qwen2-vl", *dataset_arg(write_jsonl(tmp / "img.jsonl", rows))]

    return build


def artefact(model: str, num_layers: int) -> Callable[[Path], list[str]]:
    """A SparseMM run on tiny-qwen2-vl given a visual-heads artefact of ``model`` with ``num_layers``."""

    def build(tmp: Path) -> list[str]:
        info = kvlab.models.model_info(kvlab.models.MODELS.get("tiny-qwen2-vl")().config(), "tiny-qwen2-vl")
        scores = {"scores": torch.rand(num_layers, info.num_heads)}
        path = Artefact("visual_heads", model, num_layers, info.num_heads, info.num_kv_heads, scores).save(
            tmp / "heads.safetensors"
        )
        return ["--config", "sparsemm", "--model.model", "tiny-qwen2-vl",
                "--model.compression.allocate.head.artefact", str(path),
                "--model.compression.budget", "{tokens: 16, window: 4}"]  # fmt: skip

    return build


def blocked_run_dir(tmp: Path) -> list[str]:
    (tmp / "blocker").write_text("a file where the run directory must go")
    return ["--run.dir", str(tmp / "blocker" / "runs")]


@dataclass(frozen=True)
class Case:
    """One bad input: the arguments that make it, fragments of its message, whether the model may
    load before it is found, and whether the run directory is already created (and its config
    recorded) when it is found: the data module checks samples against the model in ``setup``."""

    id: str
    args: Callable[[Path], list[str]]
    fragments: tuple[str, ...]
    in_setup: bool = False
    model_may_load: bool = False


def args(*values: str) -> Callable[[Path], list[str]]:
    return lambda tmp: list(values)


CASES = [
    Case("unknown-component", args("--model.compression.importance.attention", "{name: window_atention}"),
         ("model.compression.importance.attention", "Did you mean 'window_attention'")),
    Case("unknown-parameter", args("--model.compression.importance.attention", "{kernal: 3}"),
         ("'kernal'", "Did you mean 'kernel'")),
    Case("unknown-field", yaml_file("model: {max_new_tokenz: 4}\n"),
         ("unknown field model.max_new_tokenz", "Did you mean 'max_new_tokens'")),
    Case("mistyped-parameter", args("--model.compression.importance.attention", "{kernel: big}"),
         ("'kernel' must be int",)),
    Case("mistyped-field", yaml_file("model: {max_new_tokens: many}\n"),
         ("model.max_new_tokens must be int",)),
    Case("bad-long-prompts-value", yaml_file("data: {long_prompts: cut}\n"),
         ("data.long_prompts must be", "truncate_left")),
    Case("budget-below-window", args("--model.compression.budget", "{tokens: 16, window: 32}"),
         ("model.compression.budget.tokens = 16", "below the protected tokens")),
    Case("budget-below-sinks", args("--config", "streamingllm", "--model.compression.budget", "{tokens: 3}"),
         ("model.compression.budget.tokens = 3", "below the protected tokens")),
    Case("ratio-outside-0-1", args("--model.compression.budget", "{ratio: 2.0, window: 4}"),
         ("ratio must be in [0, 1]",)),
    Case("max-new-tokens-0", args("--model.max_new_tokens", "0"), ("model.max_new_tokens must be >= 1",)),
    Case("batch-size-0", args("--data.batch_size", "0"), ("data.batch_size must be an integer >= 1",)),
    Case("unknown-model", args("--model.model", "tiny-lama"), ("model.model", "Did you mean 'tiny-llama'")),
    Case("missing-dataset-file", args("--data.dataset", "{name: jsonl, path: /nonexistent/d.jsonl}"),
         ("data.dataset.path", "/nonexistent/d.jsonl", "does not exist")),
    Case("empty-dataset-file", jsonl_rows([]), ("data.dataset.path", "contains no samples")),
    Case("malformed-jsonl-line", jsonl_rows([{"id": "a", "prompt": "x"}, '{"id": "b", "prompt": ']),
         ("bad.jsonl:2: malformed JSON", "fix or remove this line")),
    Case("duplicate-ids", jsonl_rows([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]),
         ("bad.jsonl:2: duplicate id 'a'", "first used on line 1", "rename one")),
    Case("empty-prompt", jsonl_rows([{"id": "a", "prompt": "x"}, {"id": "blank", "prompt": "  "}]),
         ("bad.jsonl:2: sample 'blank' has an empty 'prompt'",)),
    Case("unknown-task-metric", args("--data.dataset", "{metrics: [rouge]}"),
         ("unknown task metric 'rouge'",)),
    Case("missing-image", image_rows("missing.png"), ("image 'missing.png' of sample 'img-7' not found",)),
    Case("undecodable-image", image_rows("broken.png"),
         ("broken.png of sample 'img-7' cannot be opened as an image", "Replace the file")),
    Case("images-for-text-only-model",
         lambda tmp: [*image_rows("ok.png")(tmp), "--model.model", "tiny-llama"],
         ("sample 'good'", "model.model 'tiny-llama' is text-only"), in_setup=True),
    Case("prompt-longer-than-context",
         jsonl_rows([{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 400}]),
         ("sample 'long'", "longer than the context of model.model 'tiny-llama' (64 tokens",
          "data.long_prompts: truncate_left"), in_setup=True),
    Case("model-fact-the-model-lacks",
         args("--config", "expected_attention", "--model.model", "tiny-qwen2-vl"),
         ("model.compression.importance.expected (expected_attention)", "'queries_before_rotation'",
          "tiny-qwen2-vl cannot provide", "3-D (M-RoPE", "--config snapkv")),
    Case("artefact-of-another-model", artefact("tiny-qwen2", 2),
         ("calibrated on model 'tiny-qwen2'", "this run uses 'tiny-qwen2-vl'")),
    Case("artefact-of-another-shape", artefact("tiny-qwen2-vl", 7), ("num_layers = 7", "Recalibrate")),
    Case("yaml-python-tag", yaml_file('run: !!python/object/apply:os.system ["touch pwned"]\n'),
         ("YAML tag", "python/object/apply:os.system", "is refused")),
    Case("interpolation-in-config", yaml_file("run: {experiment: '${oc.env:HOME}'}\n"),
         ("run.experiment = '${oc.env:HOME}'", "does not evaluate")),
    Case("interpolation-in-override", args("--model.compression.budget.tokens", "${oc.env:BUDGET}"),
         ("model.compression.budget.tokens", "does not evaluate")),
    Case("interpolation-on-command-line", args("--run.method", "${run.experiment}"),
         ("run.method = '${run.experiment}'",)),
    Case("unknown-hub-id-offline", args("--model.model", "nobody-kvlab/no-such-model"),
         ("model.model 'nobody-kvlab/no-such-model'", "HF_HUB_OFFLINE", "huggingface-cli download"),
         in_setup=True),
    Case("file-where-run-dir-must-go", blocked_run_dir, ("blocker is a file", "--run.dir")),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_paragraph_and_leaves_the_earlier_run_intact(
    case: Case, tmp_path: Path, earlier_run: Path, capsys, monkeypatch
) -> None:
    """Exit 2, one paragraph with the fragments, no traceback; every file of the earlier run is
    unchanged and no predictions or metrics were written anywhere."""
    if not case.model_may_load:
        monkeypatch.setattr(kvlab.models, "load_model", _forbidden)
    monkeypatch.setattr(datamodule, "context_length", lambda name: 64)  # tiny-llama's is 8192
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    shutil.copytree(earlier_run, runs)
    before = snapshot(runs)
    extra = case.args(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_kvlab(tmp_path, *extra)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    message = err.split("kvlab: error: ", 1)[1].strip()
    assert "\n" not in message and "Traceback" not in err  # one paragraph, no stack trace
    for fragment in case.fragments:
        assert fragment in message
    after = snapshot(runs)
    assert {name: after.get(name) for name in before} == before
    new = set(after) - set(before)
    assert not [n for n in new if Path(n).name.startswith(("predictions", "metrics"))]
    assert bool(new) <= case.in_setup  # only errors found in setup come after the run dir is made
    assert not (tmp_path / "pwned").exists()


def _forbidden(*args, **kwargs):
    raise AssertionError("the model was loaded before the error was reported")


def test_unknown_command_names_the_closest(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["predic"])
    assert exit_info.value.code == 2 and "Did you mean 'predict'" in capsys.readouterr().err


def test_run_dir_not_writable(tmp_path: Path, capsys, monkeypatch) -> None:
    """A parent the user cannot write (simulated: tests run as root, where chmod does not bind)."""
    monkeypatch.setattr(kvlab.models, "load_model", _forbidden)
    monkeypatch.setattr(guards, "writable", lambda directory: directory != tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        run_kvlab(tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "runs is not writable" in err and "chmod u+w" in err
    assert not list((tmp_path / "runs").iterdir())


@pytest.mark.parametrize(
    "error, fragments",
    [
        (OSError(errno.ENOSPC, "No space left on device"), ("the disk is full", "Free space", "resume")),
        (PermissionError(errno.EACCES, "Permission denied", "/ro/x"), ("cannot write /ro/x", "writable")),
        (OSError(errno.EROFS, "Read-only file system"), ("cannot write", "--run.dir")),
    ],
)
def test_os_errors_become_config_errors(error: OSError, fragments: tuple[str, ...], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info, guards.translate_os_errors(tmp_path):
        raise error
    assert all(f in str(info.value) for f in fragments)
    with pytest.raises(FileNotFoundError), guards.translate_os_errors(tmp_path):  # others pass through
        raise FileNotFoundError(errno.ENOENT, "No such file", "x")


def test_disk_full_while_writing_keeps_finished_samples_and_resumes(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """ENOSPC on the second sample's write: exit 2 naming the disk, the first line intact, the same
    command then finishes the run with each sample once."""
    calls = {"n": 0}
    real_fsync = guards.os.fsync

    def fsync(fd: int) -> None:
        if Path(f"/proc/self/fd/{fd}").resolve().name.startswith("predictions"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(guards.os, "fsync", fsync)
    with pytest.raises(SystemExit) as exit_info:
        run_kvlab(tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "the disk is full" in err and "Traceback" not in err
    assert calls["n"] == 2
    run = run_dir(tmp_path)
    assert ids(run)[:1] == ["s0"]  # whole lines only, the finished sample first
    monkeypatch.setattr(guards.os, "fsync", real_fsync)
    run_kvlab(tmp_path)
    assert sorted(ids(run)) == ["s0", "s1"]


def test_ctrl_c_stops_with_130_keeps_predictions_and_resumes(
    tmp_path: Path, capsys, monkeypatch, restore_sigint
) -> None:
    real_run = QueryAware.run
    calls = {"n": 0}

    def run(*args, **kwargs):  # the second batch is interrupted
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)

    monkeypatch.setattr(QueryAware, "run", run)
    with pytest.raises(SystemExit) as exit_info:
        run_kvlab(tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 130, err
    assert "interrupted (Ctrl-C). 1 finished samples are saved" in err and "run the same command again" in err
    run = run_dir(tmp_path)
    assert ids(run) == ["s0"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    run_kvlab(tmp_path)
    assert "resuming" in capsys.readouterr().out
    assert ids(run) == ["s0", "s1"]


def test_truncate_left_drops_the_first_words_and_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setattr(datamodule, "context_length", lambda name: 48)
    module = KVLabDataModule({"name": "synthetic_retrieval", "num_samples": 2}, "tiny-llama",
                             long_prompts="truncate_left")  # fmt: skip
    original = {s.id: s.prompt for s in module.samples}
    module.setup("predict")
    assert "data.long_prompts = truncate_left: 2 prompts" in capsys.readouterr().err
    for sample in module.samples:
        assert long_prompts.prompt_length(module.processor, sample) <= 48
        dropped = sample.meta["truncated_words"]
        assert dropped > 0 and original[sample.id].split(" ")[dropped:] == sample.prompt.split(" ")
        assert sample.prompt.endswith("Answer with the 5-digit number only.")  # the question is kept
    longer = long_prompts.truncate_left(module.processor, Sample("x", "word " * 100), 60)[0]
    assert long_prompts.prompt_length(module.processor, longer) <= 60


def test_truncate_left_refuses_when_the_template_alone_is_too_long(monkeypatch) -> None:
    monkeypatch.setattr(datamodule, "context_length", lambda name: 4)
    module = KVLabDataModule({"name": "synthetic_retrieval", "num_samples": 1}, "tiny-llama",
                             long_prompts="truncate_left")  # fmt: skip
    with pytest.raises(ConfigError, match="cannot make it fit"):
        module.setup("predict")


def test_context_length_comes_from_the_models_config() -> None:
    assert kvlab.models.context_length("tiny-llama") == 8192
    assert kvlab.models.context_length("not-a-model") is None

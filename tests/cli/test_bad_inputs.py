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
from kvlab.engine.context_protocols import QueryAware
from kvlab.runner.datamodule import KVLabDataModule

BASE = [
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
    """``kvlab predict`` of the base command plus ``args`` (later arguments win), runs under tmp_path;
    the method is ``--config snapkv`` unless ``args`` name a config."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"id": f"s{i}", "prompt": "word " * 20} for i in range(2)])
    method = [] if "--config" in args else ["--config", "snapkv"]
    main(["predict", *method, *BASE, *dataset_arg(good), "--run.dir", str(tmp_path / "runs"),
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


def second_config(text: str) -> Callable[[Path], list[str]]:
    """``--config snapkv --config <a file holding text>``: the file as a later (evaluation) config."""

    def build(tmp: Path) -> list[str]:
        (tmp / "later.yaml").write_text(text)
        return ["--config", "snapkv", "--config", str(tmp / "later.yaml")]

    return build


def file_bytes(name: str, data: bytes, option: str = "--config") -> Callable[[Path], list[str]]:
    """A file of raw bytes (bad encodings) given to ``option``."""

    def build(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(data)
        if option == "--data.dataset":
            return dataset_arg(tmp / name)
        return [option, str(tmp / name)]

    return build


def group_file(group: str, text: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        (tmp / f"{group}.yaml").write_text(text)
        return ["--config", "snapkv", f"--{group}", str(tmp / f"{group}.yaml")]

    return build


def into_earlier_run(method_prefix: str) -> Callable[[Path], list[str]]:
    """Run names that walk from another experiment into the earlier run's directory."""

    def build(tmp: Path) -> list[str]:
        victim = run_dir(tmp)
        return ["--run.experiment", "other", "--run.method", f"{method_prefix}{victim.name}"]

    return build


def symlinked_experiment(tmp: Path) -> list[str]:
    """An experiment folder that is a symbolic link out of run.dir."""
    (tmp / "elsewhere").mkdir()
    (tmp / "linked").mkdir()
    (tmp / "linked" / "exp").symlink_to(tmp / "elsewhere")
    return ["--run.dir", str(tmp / "linked")]


def nested(depth: int) -> str:
    return "preset: snapkv\nx: " + "{a: " * depth + "1" + "}" * depth + "\n"


ALIAS_BOMB = "preset: snapkv\na: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
)


@dataclass(frozen=True)
class Case:
    """One bad input: the arguments that make it, fragments of its message, whether the model may
    load before it is found, and whether the run directory is already created (and its config
    recorded) when it is found: the data module checks samples against the model in ``setup``."""

    id: str
    args: Callable[[Path], list[str]]
    fragments: tuple[str, ...]
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
    Case("mistyped-field", yaml_file("model: {record_scores: maybe}\n"),
         ("model.record_scores must be bool",)),
    Case("bad-long-prompts-value", yaml_file("data: {long_prompts: cut}\n"),
         ("data.long_prompts must be", "truncate_left")),
    Case("budget-below-window", args("--model.compression.budget", "{tokens: 16, window: 32}"),
         ("model.compression.budget.tokens = 16", "below the protected tokens")),
    Case("budget-below-sinks", args("--config", "streamingllm", "--model.compression.budget", "{tokens: 3}"),
         ("model.compression.budget.tokens = 3", "below the protected tokens")),
    Case("ratio-outside-0-1", args("--model.compression.budget", "{ratio: 2.0, window: 4}"),
         ("ratio must be in [0, 1]",)),
    Case("token-setting-from-ratio-budget",
         args("--config", "simlayerkv", "--model.compression.budget", "{ratio: 0.5}"),
         ("model.compression.route.rule.metric needs model.compression.budget.tokens as a token count",)),
    Case("head-allocator-without-its-route", args("--model.compression.allocate.head", "hybridkv"),
         ("model.compression.allocate.head 'hybridkv' reads the decisions of the route rule 'text_sparsity'",
          "has no route")),
    Case("layer-allocator-signal-not-a-role",
         args("--config", "prefixkv_online", "--model.compression.allocate.layer.signal", "atention"),
         ("model.compression.allocate.layer.signal = 'atention' is not a scorer's role",
          "Did you mean 'attention'")),
    Case("unmarked-question-query-agnostic",
         lambda tmp: [*jsonl_rows([{"id": "q1", "prompt": "Some text. What is it?"}])(tmp),
                      "--model.protocol", "query_agnostic"],
         ("model.protocol = query_agnostic compresses each context apart from its question",
          "samples 'q1' do not mark their question")),
    Case("unmarked-question-finch",
         lambda tmp: [*jsonl_rows([{"id": "q1", "prompt": "Some text. What is it?"}])(tmp),
                      "--config", "finch"],
         ("model.compression.prefill = progressive with question: true compresses each context",)),
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
         ("sample 'good'", "model.model 'tiny-llama' is text-only")),
    Case("prompt-longer-than-context",
         jsonl_rows([{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 400}]),
         ("sample 'long'", "longer than the context of model.model 'tiny-llama' (100 tokens",
          "data.long_prompts: truncate_left")),
    Case("model-fact-the-model-lacks",
         args("--config", "expected_attention", "--model.model", "tiny-qwen2-vl"),
         ("model.compression.importance.expected (expected_attention)", "'queries_before_rotation'",
          "tiny-qwen2-vl cannot provide", "3-D (M-RoPE", "--config snapkv")),
    Case("per-layer-ratios-of-another-depth",
         args("--model.compression.allocate.layer", "{name: per_layer, ratios: [0.5, 0.4, 0.3]}"),
         ("model.compression.allocate.layer.ratios holds 3 ratios", "tiny-llama has 2 decoder layers",
          "one kept fraction per layer (2 values)")),
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
         ("model.model 'nobody-kvlab/no-such-model'", "HF_HUB_OFFLINE", "huggingface-cli download")),
    Case("file-where-run-dir-must-go", blocked_run_dir, ("blocker is a file", "--run.dir")),
    # names are names: one path component each, inside run.dir
    Case("method-walks-into-another-run", into_earlier_run("../exp/"), ("run.method", "path separator")),
    Case("experiment-walks-up", args("--run.experiment", "../outside"), ("run.experiment", "path separator")),
    Case("experiment-absolute", args("--run.experiment", "/tmp/kvlab-abs"),
         ("run.experiment", "path separator")),
    Case("method-absolute", args("--run.method", "/tmp/kvlab-abs"), ("run.method", "path separator")),
    Case("method-nested", args("--run.method", "a/b/c"), ("run.method = 'a/b/c'", "path separator")),
    Case("method-backslash", args("--run.method", "a\\b"), ("run.method", "path separator")),
    Case("method-dotdot", args("--run.method", ".."), ("run.method = '..'",)),
    Case("method-dot", args("--run.method", "."), ("run.method = '.'",)),
    Case("experiment-dot", args("--run.experiment", "."), ("run.experiment = '.'",)),
    Case("method-empty", args("--run.method", ""), ("run.method = ''", "is empty")),
    Case("experiment-empty", args("--run.experiment", ""), ("run.experiment = ''", "is empty")),
    Case("method-blank", args("--run.method", "   "), ("run.method", "is empty")),
    Case("method-control-character", args("--run.method", "a\nb"), ("run.method", "control character")),
    Case("method-surrounding-space", args("--run.method", " snapkv"), ("run.method", "white space")),
    Case("method-too-long", args("--run.method", "m" * 300), ("run.method", "300 bytes long")),
    Case("experiment-too-long", args("--run.experiment", "é" * 200), ("run.experiment", "400 bytes long")),
    Case("sweep-names-too-long",
         args("--run.method", "m" * 240, "--model.compression.budget.tokens", "16,32"),
         ("run.method", "bytes long")),
    Case("method-path-in-yaml", yaml_file("preset: snapkv\nrun: {method: ../victim}\n"),
         ("run.method = '../victim@",)),
    Case("experiment-nested", args("--run.experiment", "a/b/c"), ("run.experiment = 'a/b/c'",)),
    Case("experiment-symlinked-out", symlinked_experiment, ("outside run.dir", "symbolic link")),
    Case("run-dir-empty", args("--run.dir", ""), ("run.dir must be a directory path",)),
    Case("unknown-run-field", yaml_file("preset: snapkv\nrun: {methd: x}\n"),
         ("unknown field run.methd", "Did you mean 'method'")),
    Case("overwrite-not-a-boolean", args("--run.overwrite", "maybe"),
         ("run.overwrite must be true or false",)),
    Case("method-comma-list", args("--run.method", "a,b"), ("--run.method", "cannot be swept")),
    Case("run-dir-comma-list", args("--run.dir", "a,b"), ("--run.dir", "cannot be swept")),
    # a config means one thing
    Case("duplicate-top-level-key",
         yaml_file("preset: snapkv\nmodel: {max_new_tokens: 2}\nmodel: {max_new_tokens: 3}\n"),
         ("key 'model' appears twice", "lines 2 and 3")),
    Case("duplicate-nested-key",
         yaml_file("preset: snapkv\nmodel:\n  compression:\n    budget: {tokens: 16, tokens: 32}\n"),
         ("key 'tokens' appears twice",)),
    Case("duplicate-key-in-override", args("--model.compression.budget", "{tokens: 16, tokens: 20}"),
         ("--model.compression.budget", "key 'tokens' appears twice")),
    Case("duplicate-key-in-later-config", second_config("data: {limit: 1}\ndata: {limit: 2}\n"),
         ("key 'data' appears twice",)),
    Case("second-config-is-a-method", args("--config", "snapkv", "--config", "h2o"),
         ("--config h2o sets model.compression", "only the first --config may set the method")),
    Case("second-config-names-the-run", second_config("run: {method: other}\n"),
         ("sets run.method", "only the first --config")),
    Case("second-config-imports-code", second_config("imports: [os]\n"),
         ("sets `imports`", "only the first --config")),
    Case("abbreviated-run-option", args("--run.exp", "zzz"),
         ("unknown field run.exp", "Did you mean 'experiment'")),
    Case("abbreviated-model-option", args("--model.max_new", "3"), ("unknown field model.max_new",)),
    Case("abbreviated-data-option", args("--data.batch", "2"), ("unknown field data.batch",)),
    Case("abbreviated-trainer-option", args("--trainer.max_epoch", "1"),
         ("unknown field trainer.max_epoch",)),
    Case("abbreviated-flag", args("--print_conf"),
         ("unknown option --print_conf", "Did you mean '--print_config'")),
    Case("unknown-option", args("--frobnicate", "1"), ("unknown option --frobnicate",)),
    Case("bare-word", args("snapkv"), ("unexpected argument 'snapkv'", "--config snapkv")),
    Case("unknown-top-level-field", yaml_file("preset: snapkv\nmodle: {max_new_tokens: 2}\n"),
         ("unknown top-level field `modle`", "Did you mean 'model'")),
    Case("checkpoint-path", args("--ckpt_path", "model.ckpt"),
         ("--ckpt_path is not accepted", "model.model")),
    # sweeps: every point and every part checked before the first point runs
    Case("sweep-broken-part", args("--model.compression.budget.tokens", "16,{tokens:"),
         ("value 2 of the sweep", "not valid YAML")),
    Case("sweep-empty-part", args("--model.compression.budget.tokens", "16,,32"),
         ("a value between every pair of commas",)),
    Case("sweep-second-point-invalid", args("--model.compression.budget.tokens", "16,2"),
         ("model.compression.budget.tokens = 2", "below the protected tokens")),
    Case("sweep-second-model-unknown", args("--model.model", "tiny-llama,tiny-lama"),
         ("model.model", "Did you mean 'tiny-llama'")),
    Case("sweep-block-not-a-mapping", yaml_file("preset: snapkv\nsweep: [1, 2]\n"), ("`sweep:` must map",)),
    Case("sweep-block-value-not-a-list", yaml_file("preset: snapkv\nsweep: {model.max_new_tokens: 3}\n"),
         ("sweep.model.max_new_tokens must be a non-empty list",)),
    Case("sweep-block-invalid-point", yaml_file("preset: snapkv\nsweep: {model.max_new_tokens: [2, 0]}\n"),
         ("model.max_new_tokens must be >= 1",)),
    # values are what they claim
    Case("nan-window", args("--model.compression.budget", "{tokens: 16, window: .nan}"),
         ("model.compression.budget.window = nan", "not a finite number")),
    Case("infinite-ratio", args("--model.compression.budget", "{ratio: .inf, window: 4}"),
         ("model.compression.budget.ratio = inf",)),
    Case("nan-in-yaml",
         yaml_file("preset: snapkv\nmodel: {compression: {importance: {attention: {kernel: .nan}}}}\n"),
         ("model.compression.importance.attention.kernel = nan",)),
    Case("budget-beyond-indexing", args("--model.compression.budget.tokens", str(10**30)),
         ("model.compression.budget.tokens", "outside")),
    Case("max-new-tokens-beyond-indexing", args("--model.max_new_tokens", str(10**12)),
         ("model.max_new_tokens", "outside")),
    Case("limit-beyond-indexing", args("--data.limit", str(-(10**40))), ("data.limit", "outside")),
    Case("seed-beyond-range", args("--seed_everything", str(2**40)), ("seed_everything", "outside [0,")),
    Case("seed-negative", args("--seed_everything", "-1"), ("seed_everything = -1",)),
    Case("limit-zero", args("--data.limit", "0"), ("data.limit must be",)),
    Case("limit-boolean", args("--data.limit", "true"), ("data.limit must be",)),
    Case("num-workers-negative", args("--data.num_workers", "-1"), ("data.num_workers must be",)),
    Case("chat-template-file-missing", args("--data.chat_template", "/nonexistent/template.jinja"),
         ("data.chat_template",)),
    Case("unknown-dataset", args("--data.dataset", "{name: jsnol}"),
         ("data.dataset", "Did you mean 'jsonl'")),
    Case("answer-instead-of-answers", jsonl_rows([{"id": "a", "prompt": "x", "answer": "y"}]),
         ("sample 'a' has a field 'answer' but no 'answers'", "data.dataset.answers_field")),
    Case("prompt-misspelt", jsonl_rows([{"id": "a", "promt": "x"}]), ("field 'promt' but no 'prompt'",)),
    Case("image-instead-of-images", jsonl_rows([{"id": "a", "prompt": "x", "image": "a.png"}]),
         ("field 'image' but no 'images'",)),
    Case("row-is-an-array", jsonl_rows([{"id": "a", "prompt": "x"}, '["b", "y"]']),
         ("bad.jsonl:2: expected a JSON object",)),
    Case("id-not-a-scalar", jsonl_rows([{"id": [1], "prompt": "x"}]),
         ("field 'id' must be a string or a number",)),
    Case("answers-not-strings", jsonl_rows([{"id": "a", "prompt": "x", "answers": {"a": 1}}]),
         ("field 'answers' must be",)),
    Case("data-not-utf8", file_bytes("latin.jsonl", b'{"id": "a", "prompt": "caf\xe9"}\n', "--data.dataset"),
         ("latin.jsonl:1: not UTF-8",)),
    Case("prompt-not-encodable", jsonl_rows(['{"id": "bad", "prompt": "\\ud800 hello"}']),
         ("sample 'bad'", "lone UTF-16 surrogate")),
    # parse errors are one paragraph
    Case("yaml-nested-too-deep", yaml_file(nested(100)), ("more than 64 levels",)),
    Case("yaml-nested-beyond-recursion", yaml_file(nested(5000)), ("levels",)),
    Case("yaml-alias-bomb", yaml_file(ALIAS_BOMB), ("expands to more than 100000 values",)),
    Case("config-not-utf8", file_bytes("latin.yaml", b"preset: snapkv\nrun: {method: caf\xe9}\n"),
         ("latin.yaml is not UTF-8 text", "byte 32")),
    Case("yaml-syntax-error", yaml_file("preset: snapkv\nmodel: {max_new_tokens: 2\n"),
         ("is not valid YAML",)),
    Case("yaml-not-a-mapping", yaml_file("- snapkv\n"), ("must contain a YAML mapping",)),
    Case("override-not-yaml", args("--model.compression.budget", "{tokens: 16"),
         ("--model.compression.budget is not valid YAML",)),
    Case("override-nested-too-deep", args("--model.compression.budget", "[" * 100 + "]" * 100),
         ("--model.compression.budget nests",)),
    Case("preset-not-found", yaml_file("preset: snapkvv\n"), ("Config 'snapkvv' not found", "Did you mean")),
    Case("preset-not-a-name", yaml_file("preset: [snapkv]\n"), ("`preset` must be a preset name or a path",)),
    Case("config-not-found", args("--config", "no_such_method"), ("Config 'no_such_method' not found",)),
    Case("config-without-value", args("--config"), ("--config needs a value",)),
    Case("option-without-value", args("--model.max_new_tokens"), ("--model.max_new_tokens needs a value",)),
    Case("group-file-missing", args("--config", "snapkv", "--trainer", "/nonexistent/trainer.yaml"),
         ("--trainer '/nonexistent/trainer.yaml'", "is not a file")),
    Case("group-file-not-a-mapping", group_file("trainer", "- 1\n"),
         ("must hold a mapping of `trainer` fields",)),
    Case("group-file-duplicate-key", group_file("trainer", "max_epochs: 1\nmax_epochs: 2\n"),
         ("key 'max_epochs' appears twice",)),
    # the code surface: nothing runs or writes that the config does not declare
    Case("interpolation-in-trainer-file", group_file("trainer", "max_epochs: ${oc.env:HOME}\n"),
         ("trainer.yaml", "does not evaluate")),
    Case("interpolation-in-trainer-option", args("--trainer.max_epochs", "${oc.env:HOME}"),
         ("trainer.max_epochs", "does not evaluate")),
    Case("interpolation-in-later-config", second_config("run: {experiment: '${oc.env:HOME}'}\n"),
         ("run.experiment = '${oc.env:HOME}'",)),
    Case("interpolation-in-sweep-value", args("--model.compression.budget.tokens", "16,${oc.env:X}"),
         ("--model.compression.budget.tokens", "does not evaluate")),
    Case("yaml-tag-in-override",
         args("--model.compression.budget", '!!python/object/apply:os.system ["touch pwned"]'),
         ("--model.compression.budget", "is refused")),
    Case("yaml-tag-in-sweep-value", args("--model.compression.budget.tokens", '16,!!python/name:os.system'),
         ("value 2 of the sweep", "is refused")),
    Case("trainer-class-path-outside-lightning",
         args("--trainer.strategy", "{class_path: os.system, init_args: {command: touch pwned}}"),
         ("class_path 'os.system' is refused",)),
    Case("trainer-logger", args("--trainer.logger", "{class_path: lightning.pytorch.loggers.CSVLogger}"),
         ("trainer.logger is not accepted",)),
    Case("trainer-callbacks",
         args("--trainer.callbacks", "[{class_path: lightning.pytorch.callbacks.Timer}]"),
         ("trainer.callbacks is not accepted",)),
    Case("trainer-default-root-dir", lambda tmp: ["--trainer.default_root_dir", str(tmp / "elsewhere")],
         ("trainer.default_root_dir is not accepted", "--run.dir")),
    Case("trainer-profiler", args("--trainer.profiler", "simple"), ("trainer.profiler is not accepted",)),
    Case("trainer-plugins", args("--trainer.plugins", "[x]"), ("trainer.plugins is not accepted",)),
    Case("trainer-value-lightning-refuses", args("--trainer.accelerator", "abacus"),
         ("trainer.accelerator = 'abacus'", "refused by Lightning", "Fix the trainer fields")),
    Case("trainer-class-path-unknown", args("--trainer.strategy", "{class_path: lightning.pytorch.Nope}"),
         ("class_path 'lightning.pytorch.Nope' names no class",)),
    Case("wired-module-argument", args("--model.files", "{run_dir: /tmp}"),
         ("unknown field model.files",)),
    Case("wired-data-argument", args("--data.skip_ids", "[s0]"), ("unknown field data.skip_ids",)),
    Case("data-model-apart", args("--data.model", "tiny-qwen2"), ("data.model", "set model.model")),
    Case("random-seed", args("--seed_everything", "true"),
         ("seed_everything must be an integer seed", "write e.g. 0")),
    Case("imports-missing-module", yaml_file("preset: snapkv\nimports: [no_such_kvlab_plugin]\n"),
         ("no_such_kvlab_plugin", "cannot be found")),
    Case("imports-not-a-list", yaml_file("preset: snapkv\nimports: {a: 1}\n"), ("`imports` must be a list",)),
    Case("imports-missing-file", yaml_file("preset: snapkv\nimports: [plugins/none.py]\n"),
         ("none.py", "does not exist")),
    Case("quantize-unknown", args("--model.compression.quantize", "{name: kivy}"),
         ("model.compression.quantize", "Did you mean 'kivi'")),
    Case("quantize-bits", args("--model.compression.quantize", "{name: kivi, bits: 3}"),
         ("bits must be one of 1, 2, 4, 8",)),
    Case("quantize-decode-policy",
         args("--config", "prefixkv", "--model.compression.quantize", "{name: kivi}"),
         ("model.compression.quantize (kivi)", "model.compression.decode = fixed_index_evict")),
    Case("quantize-retrieval",
         args("--config", "retrieval", "--model.compression.quantize", "{name: kivi}"),
         ("model.compression.quantize (kivi)", "model.compression.select = retrieve", "outside the cache")),
    Case("quantize-decode-time", args("--model.compression.quantize", "{name: kivi}", "--model.protocol",
                                      "{name: decode_time, target_size: 16}"),
         ("model.compression.quantize (kivi)", "decode-time compression")),
    Case("channels-unknown", args("--model.compression.channels", "{name: thin}"),
         ("model.compression.channels", "Did you mean 'think'")),
    Case("channels-keep", args("--model.compression.channels", "{name: think, keep: 0}"),
         ("keep is the share of key channels kept, in (0, 1]",)),
    Case("channels-quantize", args("--config", "think", "--model.compression.quantize", "{name: kivi}"),
         ("model.compression.channels (think)", "model.compression.quantize", "do not compose yet")),
    Case("channels-decode-policy", args("--config", "tova", "--model.compression.channels", "{name: think}"),
         ("model.compression.channels (think)", "model.compression.decode = tova")),
    Case("channels-decode-time", args("--config", "think", "--model.protocol",
                                      "{name: decode_time, target_size: 16}"),
         ("model.compression.channels (think)", "decode-time compression")),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_paragraph_and_leaves_the_earlier_run_intact(
    case: Case, tmp_path: Path, earlier_run: Path, capsys, monkeypatch
) -> None:
    """Exit 2, one paragraph with the fragments, no traceback; every file of the earlier run is
    unchanged and no predictions or metrics were written anywhere."""
    if not case.model_may_load:
        monkeypatch.setattr(kvlab.models, "load_model", _forbidden)
    monkeypatch.setattr(datamodule, "context_length", lambda name: 100)  # tiny-llama's is 8192
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    shutil.copytree(earlier_run, runs)
    before = snapshot(runs)
    extra = case.args(tmp_path)
    inputs = set(snapshot(tmp_path))
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
    assert not new  # every check comes before the run directory is touched
    assert set(snapshot(tmp_path)) - {"good.jsonl"} == inputs  # nothing written anywhere else either
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
    original = {s.id: s for s in module.samples}
    module.setup("predict")
    assert "data.long_prompts = truncate_left: 2 prompts" in capsys.readouterr().err
    for sample in module.samples:
        assert long_prompts.prompt_length(module.processor, sample) <= 48
        dropped, before = sample.meta["truncated_words"], original[sample.id]
        assert before.question and sample.question == before.question  # the question is kept whole
        assert (
            dropped > 0 and sample.prompt == " ".join(before.context.split(" ")[dropped:]) + before.question
        )
        assert sample.prompt.endswith("Answer with the 5-digit number only.")
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

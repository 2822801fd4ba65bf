"""`kvlab` end to end: predict on a tiny model, resume, errors before the model loads, list, packaging."""

import json
import subprocess
import sys
import tempfile
import zipfile

import pytest
from PIL import Image
from support.cli import TINY, predict, write_jsonl
from support.paths import REPO

import kvlab.models
from kvlab.cli.listing import plural
from kvlab.cli.main import main


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load model weights."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration error was reported")

    monkeypatch.setattr(kvlab.models, "load_model", forbidden)


def test_predict_writes_predictions_metrics_config_and_tensorboard(tmp_path):
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": f"s{i}", "prompt": "word " * (30 + 10 * i), "answers": ["x"]} for i in range(3)],
    )
    predict(
        tmp_path,
        "--config",
        "snapkv.yaml",
        *TINY,
        "--data.dataset",
        f"{{name: jsonl, path: {data}}}",
        "--model.compression.budget.tokens",
        "40",
        "--model.compression.budget.window",  # SnapKV's scorer observes the budget's window
        "8",
    )
    run = tmp_path / "runs" / "exp" / "snapkv"
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["s0", "s1", "s2"]
    for r in records:
        assert r["kv_bytes_kept"] < r["kv_bytes_full"]
        assert len(r["kept_per_layer_head"]) == 2 and all(
            c == 40 for row in r["kept_per_layer_head"] for c in row
        )
        assert {"output", "prefill_seconds", "compression_seconds", "decode_seconds", "exact_match"} <= set(r)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["samples"] == 3 and 0 < metrics["kv_ratio"] < 1
    config = (run / "config.yaml").read_text()
    assert "window_attention" in config and "tokens: 40" in config
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_rerun_skips_written_samples_and_keeps_them(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"s{i}", "prompt": "word " * 40} for i in range(3)])
    run = tmp_path / "runs" / "exp" / "full"
    run.mkdir(parents=True)
    kept_line = json.dumps(
        {
            "id": "s1",
            "output": "from an earlier run",
            "kv_ratio": 1.0,
            "prompt_tokens": 1,
            "output_tokens": 1,
            "prefill_seconds": 1.0,
            "compression_seconds": 0.0,
            "decode_seconds": 1.0,
            "kv_bytes_full": 1,
            "kv_bytes_kept": 1,
        }
    )
    planted = kept_line + "\n" + '{"id": "s2", "outp'  # crash mid-line
    (run / "predictions.jsonl").write_text(planted)
    args = ("--config", "full", *TINY, "--data.dataset", f"{{name: jsonl, path: {data}}}")
    with pytest.raises(SystemExit) as refused:  # results without run.json: no telling whose they are
        predict(tmp_path, *args)
    assert refused.value.code == 2 and (run / "predictions.jsonl").read_text() == planted
    (run / "predictions.jsonl").unlink()
    predict(tmp_path, *args)  # records this run's fingerprint
    (run / "predictions.jsonl").write_text(planted)  # then a crash left one sample and a cut line
    (run / "metrics.json").unlink()
    predict(tmp_path, *args)
    lines = (run / "predictions.jsonl").read_text().splitlines()
    assert lines[0] == kept_line
    ids = [json.loads(line)["id"] for line in lines]
    assert sorted(ids) == ["s0", "s1", "s2"]
    assert json.loads((run / "metrics.json").read_text())["samples"] == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model.compression.importance.attention", "{name: window_atention}"],
            "Did you mean 'window_attention'",
        ),
        (["--model.compression.importance.attention", "{kernal: 3}"], "'kernal'"),
        (["--model.compression.importance.attention", "{kernel: big}"], "'kernel' must be int"),
        (["--model.compression.budget", "{tokens: 16, window: 32}"], "below the protected tokens"),
        (["--model.compression.budget", "{ratio: 2.0, window: 32}"], "ratio must be in [0, 1]"),
        (["--data.dataset", "{name: jsonl, path: /nonexistent/data.jsonl}"], "/nonexistent/data.jsonl"),
        (["--model.model", "tiny-lama"], "tiny-llama"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message_before_the_model_loads(
    tmp_path, capsys, no_model_load, args, message
):
    with pytest.raises(SystemExit) as exit_info:
        predict(tmp_path, "--config", "snapkv", *args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "kvlab: error:" in err and message in err
    assert "Traceback" not in err


def test_unopenable_image_names_the_sample(tmp_path, capsys, no_model_load):
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": "good", "prompt": "a", "images": ["ok.png"]},
            {"id": "sample-7", "prompt": "b", "images": ["broken.png"]},
        ],
    )
    with pytest.raises(SystemExit):
        predict(
            tmp_path,
            "--config",
            "snapkv",
            "--model.model",
            "tiny-qwen2-vl",
            "--data.dataset",
            f"{{name: jsonl, path: {data}}}",
        )
    err = capsys.readouterr().err
    assert "sample-7" in err and "broken.png" in err


def test_print_config_shows_the_resolved_preset(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["predict", "--config", "pyramidkv", "--model.compression.budget.tokens", "77", "--print_config"]
        )
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "pyramid" in out and "tokens: 77" in out and "window_attention" in out


def test_list_prints_every_component_with_parameters(capsys):
    main(["list"])
    out = capsys.readouterr().out
    for name in (
        "window_attention",
        "cumulative_attention",
        "key_norm",
        "recency",
        "random",
        "keydiff",
        "weighted_sum",
        "pyramid",
        "topk",
        "synthetic_retrieval",
        "jsonl",
        "tiny-llama",
        "smollm2-135m",
    ):
        assert name in out
    assert "kernel: int = 5" in out
    assert "snapkv" in out.split("presets")[-1]


def test_list_markdown_is_the_component_reference(capsys):
    """`kvlab list --format markdown`: every pipeline component and protocol with its parameters,
    defaults, capabilities, paper and the presets that use it."""
    from kvlab.cli.listing import ORDER
    from kvlab.config.registry import REGISTRIES

    main(["list", "--format", "markdown"])
    out = capsys.readouterr().out
    sections = out.split("\n### ")
    for registry in REGISTRIES:
        if registry.field in ORDER[:11]:  # the pipeline's slots and the protocols
            assert f"YAML field: `{registry.field}`" in out
            for name in registry.names():
                assert any(s.startswith(f"`{name}`") for s in sections), name
    snap = next(s for s in sections if s.startswith("`window_attention`"))
    assert "| `kernel` | `int` | `5` |" in snap
    assert '**paper**: Li et al. 2024, "SnapKV' in snap and "**capabilities**: chunked_prefill" in snap
    assert "`snapkv`" in snap.split("**presets**")[1].splitlines()[0]
    adakv = next(s for s in sections if s.startswith("`adakv`"))
    assert "`adakv`" in adakv.split("**presets**")[1] and "Feng et al. 2025" in adakv


# One fresh interpreter: what `import kvlab.compression` registers against what every compression
# module registers; then `kvlab list` with only the imports the command makes; then every Registry
# defined anywhere in kvlab (all modules imported), each with whether it is enrolled.
ENROLMENT_SCRIPT = """
import importlib, json, pkgutil
import kvlab.compression
from kvlab.config.registry import REGISTRIES, Registry
names = lambda: {r.field: r.names() for r in REGISTRIES}
first = names()
for info in pkgutil.walk_packages(kvlab.compression.__path__, "kvlab.compression."):
    importlib.import_module(info.name)
print(json.dumps([first, names()]))
from kvlab.cli.main import main
main(["list"])
import kvlab.kernels
found = {}
for package in (kvlab, kvlab.kernels):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        for value in vars(importlib.import_module(info.name)).values():
            if isinstance(value, Registry):
                enrolled = any(value is r for r in REGISTRIES)
                found[id(value)] = [value.kind, value.field, value.names(), enrolled]
print(json.dumps(list(found.values())))
"""


def test_every_registry_is_enrolled_and_listed_with_its_kind_and_field():
    out = subprocess.run(
        [sys.executable, "-c", ENROLMENT_SCRIPT], check=True, capture_output=True, text=True, cwd=REPO
    ).stdout
    first_line, listing = out.split("\n", 1)
    listing, last_line = listing.rstrip("\n").rsplit("\n", 1)
    on_import, everything = json.loads(first_line)
    assert on_import == everything  # importing kvlab.compression registers every component module
    assert everything["model.compression.select"] == [
        "chunkkv",
        "entropy_gated_chunkkv",
        "merge",
        "retrieve",
        "threshold",
        "topk",
        "two_stage",
    ]
    registries = json.loads(last_line)
    assert len(registries) >= 13
    for kind, field, names, enrolled in registries:
        assert enrolled, kind
        assert f"{plural(kind)}  (YAML field: {field})" in listing
        assert all(f"  {name}: " in listing for name in names)


def test_print_config_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_dir))
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", "snapkv", "--print_config"])
    assert exit_info.value.code == 0 and "window_attention" in capsys.readouterr().out
    assert not list(temp_dir.iterdir())


def test_wheel_ships_configs_and_kernels(tmp_path):
    """Non-editable install: build a wheel, install it into a directory, find a preset by bare name."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("kvlab-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvlab/configs/snapkv.yaml" in names and "kvlab/configs/_base.yaml" in names
    assert "kvlab/kernels/decode_attention.py" in names
    assert "kvlab/cli/main.py" in names and "kvlab/data/benchmarks/ruler.py" in names  # every package
    assert "kvlab/calibration/configs/visual_heads.yaml" in names  # kvlab calibrate runs offline
    assert "kvlab/calibration/artefacts/smollm2-qwen2-vl.visual_heads.safetensors" in names
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = "import kvlab.config.loader as c; print(c.find_config('snapkv')); import kvlab.kernels.dispatch"
    code += "; import kvlab.data  # its subpackage benchmarks/ too"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": ""},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert str(target) in out


def test_predict_prints_a_one_screen_summary_and_uses_the_datasets_task_metrics(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "word " * 30, "answers": ["word"]}])
    dataset = f"{{name: jsonl, path: {data}, metrics: [token_f1, rouge_l]}}"
    predict(tmp_path, "--config", "snapkv", *TINY, "--data.dataset", dataset,
            "--model.compression.budget", "{tokens: 16, window: 4}")  # fmt: skip
    out = capsys.readouterr().out
    summary = out[out.index("kvlab: 1 samples") :]
    assert len(summary.splitlines()) < 40
    for line in (
        "fidelity to the full cache",
        "fidelity_top1",
        "token_f1",
        "kv_ratio",
        "compression_over_prefill",
    ):
        assert line in summary
    record = json.loads((tmp_path / "runs" / "exp" / "snapkv" / "predictions.jsonl").read_text())
    assert {"token_f1", "rouge_l"} <= set(record) and "contains_answer" not in record


def test_unknown_task_metric_exits_2_before_the_model_loads(tmp_path, capsys, no_model_load):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    with pytest.raises(SystemExit) as exit_info:
        predict(
            tmp_path,
            "--config",
            "snapkv",
            "--data.dataset",
            f"{{name: jsonl, path: {data}, metrics: [rouge]}}",
        )
    assert exit_info.value.code == 2
    assert "unknown task metric 'rouge'" in capsys.readouterr().err

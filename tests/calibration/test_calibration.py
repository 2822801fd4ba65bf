"""Calibration artefacts and ``kvlab calibrate``: format, model checks, statistics vs naive loops, CLI."""

import json

import pytest
import torch
from naive.attention import dot, softmax
from naive.context import make_ctx

import kvlab.models
from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch, region_targets
from kvlab.cli.main import main
from kvlab.compression.mixers import head_redundancy
from kvlab.config.artefacts import Artefact
from kvlab.config.errors import ConfigError


def test_artefact_round_trip_and_header(tmp_path):
    tensors = {"scores": torch.rand(3, 4)}
    settings = {"data": {"dataset": {"name": "x"}}, "samples": 5}
    path = Artefact("visual_heads", "m", 3, 4, 2, tensors, settings).save(tmp_path / "a" / "vh.safetensors")
    loaded = Artefact.load(path)
    assert (loaded.kind, loaded.model, loaded.num_layers, loaded.num_heads, loaded.num_kv_heads) == (
        "visual_heads",
        "m",
        3,
        4,
        2,
    )
    assert torch.equal(loaded.tensors["scores"], tensors["scores"]) and loaded.settings == settings
    assert not list(path.parent.glob("*.tmp"))  # written atomically


def test_artefact_checks_name_the_problem(tmp_path):
    artefact = Artefact("redundancy", "model-a", 2, 4, 2, {"redundancy": torch.rand(2, 2)})
    path = artefact.save(tmp_path / "r.st")
    loaded = Artefact.load(path)
    with pytest.raises(ConfigError, match="holds 'redundancy' statistics.*needs 'visual_heads'"):
        loaded.check("visual_heads", "x")
    with pytest.raises(ConfigError, match="calibrated on model 'model-a'.*uses 'model-b'"):
        loaded.check("redundancy", "x", model="model-b")
    with pytest.raises(ConfigError, match="num_kv_heads = 2.*has 4"):
        loaded.check("redundancy", "x", num_kv_heads=4)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a kvlab calibration artefact"):
        Artefact.load(junk)


def naive_visual_hits(ctx, n_answer: int, targets: list[bool]) -> list[list[float]]:
    """Per (layer-less) query head: sum over answer queries of 1/|R| when the top key is in R."""
    H, G = ctx.num_heads, ctx.group_size
    T = ctx.seq_len
    q = ctx.queries[0].double().tolist()
    k = ctx.keys[0].double().tolist()
    size = sum(targets)
    out = []
    for h in range(H):
        total = 0.0
        for i in range(T - n_answer, T):
            probs = softmax([dot(q[h][i], k[h // G][j]) * ctx.scaling for j in range(i + 1)])
            top = max(range(len(probs)), key=lambda j: (probs[j], -j))
            total += 1.0 / size if targets[top] else 0.0
        out.append(total)
    return out


def test_visual_head_scores_match_naive():
    stat = CALIBRATIONS.build({"name": "visual_heads"})
    stat.start(num_layers=2, num_heads=4, num_kv_heads=2)
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for seed in range(3):
        for layer in range(2):
            ctx = make_ctx([20], seed=seed * 10 + layer, layer_idx=layer, num_layers=2, scale=3.0)
            targets = torch.zeros(1, 20, dtype=torch.bool)
            targets[0, 2:9] = True
            stat.observe(ctx, CalibrationBatch(answer_tokens=torch.tensor([3]), targets=targets))
            expected[layer] += torch.tensor(naive_visual_hits(ctx, 3, targets[0].tolist()))
    torch.testing.assert_close(stat.result()["scores"].double(), expected / 3)
    assert float(expected.sum()) > 0  # the test exercises hits


def test_redundancy_statistic_is_the_sample_mean_of_head_redundancy():
    stat = CALIBRATIONS.build({"name": "redundancy"})
    stat.start(num_layers=1, num_heads=4, num_kv_heads=2)
    contexts = [make_ctx([12, 9], seed=s) for s in range(2)]
    for ctx in contexts:
        stat.observe(ctx, CalibrationBatch(answer_tokens=torch.zeros(2, dtype=torch.long)))
    want = torch.cat([head_redundancy(ctx) for ctx in contexts]).mean(0)
    torch.testing.assert_close(stat.result()["redundancy"][0], want)


def test_region_targets_pick_one_quadrant_of_the_asked_image():
    modality = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0])  # two images of 2x2 tokens
    got = region_targets(modality, {"image_index": 1, "region": "bottom left"}, 4)
    assert torch.nonzero(got).flatten().tolist() == [8]
    modality = torch.tensor([0] + [1] * 16 + [0])  # one image, 4x4 grid
    got = region_targets(modality, {"image_index": 0, "region": "top right"}, 16)
    assert torch.nonzero(got).flatten().tolist() == [3, 4, 7, 8]


def test_calibrate_cli_writes_a_versioned_artefact_that_sparsemm_loads(tmp_path, capsys):
    out = tmp_path / "vh.safetensors"
    main(["calibrate", "--config", "visual_heads", "--model", "tiny-qwen2-vl", "--num_samples", "8",
          "--output", str(out)])  # fmt: skip
    assert "wrote visual_heads artefact for tiny-qwen2-vl" in capsys.readouterr().out
    artefact = Artefact.load(out)
    assert artefact.kind == "visual_heads" and artefact.model == "tiny-qwen2-vl"
    assert artefact.tensors["scores"].shape == (artefact.num_layers, artefact.num_heads)
    assert artefact.settings["samples"] == 8 and artefact.settings["calibration"] == {"name": "visual_heads"}
    assert float(artefact.tensors["scores"].sum()) > 0
    # MixKV on SparseMM's budgets runs end to end through the CLI with it: ragged heads recorded
    main(["predict", "--config", "mixkv_sparsemm", "--model.model", "tiny-qwen2-vl",
          "--run.dir", str(tmp_path), "--run.method", "mixkv_sparsemm",
          "--model.compression.allocate.head.artefact", str(out),
          "--model.max_new_tokens", "2",
          "--model.compression.budget", "{ratio: 0.5, window: 4}", "--data.dataset.num_samples", "2",
          "--trainer.enable_progress_bar", "false"])  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "default/mixkv_sparsemm/predictions.jsonl").open()]
    assert len(records) == 2
    assert all(len({n for layer in r["kept_per_layer_head"] for n in layer}) > 1 for r in records)
    # a SparseMM run on another model refuses the artefact before that model loads
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", "sparsemm", "--model.model", "tiny-llava", "--run.dir", str(tmp_path),
              "--model.compression.allocate.head.artefact", str(out)])  # fmt: skip
    assert exit_info.value.code == 2
    assert "calibrated on model 'tiny-qwen2-vl'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "visual_heads", "--model", "tiny-lama"], "tiny-llama"),
        (["--config", "visual_head"], "Did you mean 'visual_heads'"),
    ],
)
def test_calibrate_bad_input_exits_2_before_the_model_loads(monkeypatch, capsys, args, message):
    monkeypatch.setattr(kvlab.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_calibrate_unknown_statistic_and_field(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kvlab.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-qwen2-vl\ncalibration: {name: visual_hedas}\ndata: {dataset: {name: x}}\n")
    with pytest.raises(SystemExit):
        main(["calibrate", "--config", str(bad)])
    assert "Did you mean 'visual_heads'" in capsys.readouterr().err
    bad.write_text("model: tiny-qwen2-vl\ncalibration: {name: redundancy}\noutptu: x\n")
    with pytest.raises(SystemExit):
        main(["calibrate", "--config", str(bad)])
    assert "no field 'outptu'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model, kind, shape",
    [("smollm2-qwen2-vl", "visual_heads", (30, 9)), ("smollm2-llava", "visual_heads", (30, 9)),
     ("smollm2-135m", "redundancy", (30, 3))],
)  # fmt: skip
def test_shipped_artefacts_are_found_by_auto_and_fit_their_model(tmp_path, monkeypatch, model, kind, shape):
    from kvlab.config.artefacts import PACKAGED, resolve_path

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))  # nothing calibrated locally
    path = resolve_path("auto", model, kind, "artefact")
    assert path.parent == PACKAGED
    artefact = Artefact.load(path).check(kind, "artefact", model=model)
    tensor = next(iter(artefact.tensors.values()))
    assert tuple(tensor.shape) == shape and float(tensor.sum()) > 0
    with pytest.raises(ConfigError, match="no 'visual_heads' artefact for model 'tiny-llama'"):
        resolve_path("auto", "tiny-llama", "visual_heads", "artefact")


@pytest.mark.parametrize(
    "preset, calibration",
    [
        ("qfilters", "qfilters"),
        ("duo_attention", "duo_attention_heads"),
        ("headkv", "retrieval_reasoning_heads"),
    ],
)
def test_a_calibrated_preset_is_refused_on_a_model_without_its_artefact_naming_the_command(
    preset, calibration, tmp_path, monkeypatch
):
    from kvlab.config.loader import resolve
    from kvlab.pipeline import Pipeline

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))  # nothing calibrated locally
    pipeline = Pipeline.from_config(resolve([preset], [])["model"]["compression"])
    command = f"kvlab calibrate --config {calibration} --model tiny-qwen2-vl"
    with pytest.raises(ConfigError, match=command):
        pipeline.bind_model("tiny-qwen2-vl")
    pipeline.bind_model("tiny-qwen2")  # a shipped artefact

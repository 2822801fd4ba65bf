"""TensorBoard views: the event files of a VLM run hold every tag with sane values; helpers vs naive loops."""

import json

import pytest
import torch
from PIL import Image
from support.cli import predict, write_jsonl
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kvlab.cache.selection import Selection
from kvlab.runner.views import image_grids, modality_counts, patch_figure, render


def events(directory):
    acc = EventAccumulator(str(directory), size_guidance={"images": 0, "histograms": 0, "scalars": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect")
    for i, color in enumerate(("red", "blue")):
        Image.new("RGB", (40, 40), color).save(tmp / f"img{i}.png")
    rows = [{"id": f"v{i}", "prompt": f"what colour is it? {'word ' * 10 * i}", "images": [f"img{i}.png"],
             "answers": ["red"]} for i in range(2)]  # fmt: skip
    data = write_jsonl(tmp / "d.jsonl", rows)
    predict(
        tmp, "--config", "snapkv", "--model.model", "tiny-qwen2-vl", "--trainer.enable_progress_bar", "false",
        "--model.max_new_tokens", "3", "--data.dataset", f"{{name: jsonl, path: {data}}}",
        "--model.compression.budget", "{tokens: 12, window: 4}",  # snapkv's window attention observes it
        "--model.inspect_layers", "[0, -1]",
    )  # fmt: skip
    return tmp / "runs" / "exp" / "snapkv"


def test_event_files_hold_every_view(vlm_run):
    acc = events(vlm_run / "tensorboard")
    tags = acc.Tags()
    layers = len(
        json.loads((vlm_run / "predictions.jsonl").read_text().splitlines()[0])["kept_per_layer_head"]
    )
    figures = {"budget/kept_layer_head", "budget/kept_per_layer", "budget/kept_layer_head_mean",
               "modality/kept_fraction_per_layer"}  # fmt: skip
    assert figures <= set(tags["images"])
    for tag in figures:  # rendered figures a screen shows, not a layers x heads pixel strip
        image = acc.Images(tag)[0]
        assert image.width >= 600 and image.height >= 200
    for layer in (0, layers - 1):
        assert f"patches/layer_{layer}/image_0" in tags["images"]
        assert f"scores/layer_{layer}" in tags["histograms"]
        assert f"scores/attention/layer_{layer}" in tags["histograms"]  # per-scorer histograms, by role
    for name in ("text", "image"):
        fractions = acc.Scalars(f"modality/kept_fraction_{name}")
        assert [e.step for e in fractions] == list(range(layers))
        assert all(0 <= e.value <= 1 for e in fractions)
    assert any(e.value < 1 for e in acc.Scalars("modality/kept_fraction_image"))  # 12 of ~30 tokens kept
    assert all(e.value >= 0 for e in acc.Scalars("time/compression_s"))
    assert 0 < acc.Scalars("summary/kv_ratio")[0].value < 1
    assert 0 <= acc.Scalars("summary/fidelity_top1")[0].value <= 1
    image = acc.Images("patches/layer_0/image_0")[0]
    assert image.width >= 600 and image.height >= 250


def naive_kept(selection, length):
    B, H, _ = selection.indices.shape
    out = torch.zeros(B, H, length, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for p in selection.kept_positions(b, h):
                out[b, h, p] = True
    return out


def test_kept_mask_and_modality_counts_match_loops():
    indices = torch.tensor([[[0, 2, 5], [1, 4, 0]], [[3, 0, 0], [2, 3, 5]]])
    counts = torch.tensor([[3, 2], [1, 3]])
    selection = Selection(indices, counts)
    modality = torch.tensor([[0, 1, 1, 1, 0, 0], [-1, 0, 1, 1, 0, 0]])
    mask = selection.kept_mask(6)
    assert torch.equal(mask, naive_kept(selection, 6))
    kept, present = modality_counts(selection, modality)
    for m in range(3):
        assert kept[m] == sum(int(mask[b, h, t]) for b in range(2) for h in range(2) for t in range(6)
                              if modality[b, t] == m)  # fmt: skip
        assert present[m] == 2 * int((modality == m).sum())


def test_image_grids_and_overlay():
    class Adapter:
        merge_size = 2

    class Proc:
        images = Adapter()

    sample = type("S", (), {"images": [Image.new("RGB", (8, 8))] * 2})()
    modality = torch.tensor([[-1, 0, 1, 1, 1, 1, 0, 1, 1, 0]])
    grid_thw = torch.tensor([[1, 4, 4], [1, 4, 2]])  # merged 2x2: 2x2 and 2x1 tokens
    batch = {"samples": [sample], "modality": modality, "model_inputs": {"image_grid_thw": grid_thw}}
    assert image_grids(batch, 0, Proc()) == [(2, 2, 2), (7, 2, 1)]
    square_plus_cls = {"samples": [sample], "modality": torch.tensor([[0] + [1] * 10])}
    assert image_grids(square_plus_cls, 0, None) == [(2, 2, 2), (7, 2, 2)]  # 5 tokens: CLS + 2x2
    kept = render(patch_figure(Image.new("RGB", (10, 10), "white"), torch.tensor([[1.0, 0.0]]), "t"))
    dropped = render(patch_figure(Image.new("RGB", (10, 10), "white"), torch.tensor([[0.0, 0.0]]), "t"))
    assert kept.shape == dropped.shape and kept.shape[2] == 3
    assert kept.mean() > dropped.mean()  # a kept patch is drawn bright, a dropped one dark

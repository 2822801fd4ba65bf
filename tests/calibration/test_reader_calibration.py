"""The reader calibrations (docs/calibration.md, "smollm2-reader"): the answer cells as targets,
HybridKV's head classes and the image attention of reading heads, against naive loops; the
shipped smollm2-reader artefacts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from naive.attention import softmax
from naive.context import make_ctx

from kvlab.calibration import reading as _reading  # noqa: F401  (registers the reader statistics)
from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch, region_targets
from kvlab.compression.hybridkv import text_centric_sparsity
from kvlab.config.artefacts import Artefact


def test_answer_cells_are_the_targets():
    modality = torch.tensor([0] + [1] * 16 + [0, 0] + [1] * 16 + [0])  # two 16-token images
    got = region_targets(modality, {"answer_cells": [[1, 9], [1, 10], [0, 0]]}, 16)
    assert torch.nonzero(got).flatten().tolist() == [1, 19 + 9, 19 + 10]


def test_answer_cells_of_another_image_grid_are_refused():
    """The reader's cells index 16-token images: on a model with 36 (smollm2-llava) they would
    name unrelated patches, so the targets are refused rather than built."""
    modality = torch.tensor([0] + [1] * 36 + [0, 0] + [1] * 36 + [0])  # two 36-token images
    meta = {"answer_cells": [[1, 9]], "image_cells": [["a"] * 16, ["b"] * 16]}
    with pytest.raises(ValueError, match="16 tokens per image"):
        region_targets(modality, meta, 16)
    with pytest.raises(ValueError, match="answer_cells"):
        region_targets(modality[:38], {"answer_cells": [[0, 40]]}, 36)


def _image_ctx(seed: int, layer: int):
    ctx = make_ctx([24, 20], seed=seed, layer_idx=layer, num_layers=2, scale=3.0)
    modality = ctx.modality.clone()
    modality[:, 6:14] = torch.where(ctx.valid[:, 6:14], 1, -1)  # image tokens, then text
    return dataclasses.replace(ctx, modality=modality)


def test_hybridkv_head_classes_are_the_rules_scores_averaged():
    contexts = {layer: [_image_ctx(seed, layer) for seed in range(3)] for layer in range(2)}
    scores = {layer: torch.cat([text_centric_sparsity(c, 0.05, "trailing", 8, "mean") for c in ctxs])
              for layer, ctxs in contexts.items()}  # fmt: skip
    theta = float(torch.cat(list(scores.values())).median())  # both classes occur
    stat = CALIBRATIONS.build({"name": "hybridkv_head_classes", "theta": theta})
    stat.start(num_layers=2, num_heads=4, num_kv_heads=2)
    for ctxs in contexts.values():
        for ctx in ctxs:
            stat.observe(ctx, CalibrationBatch(answer_tokens=torch.zeros(2, dtype=torch.long)))
    out = stat.result()
    for layer, every in scores.items():  # every: [6 samples, Hkv]
        torch.testing.assert_close(out["score"][layer], every.mean(0))
        torch.testing.assert_close(out["static_share"][layer], (every >= theta).float().mean(0))
    assert 0 < float(out["static_share"].mean()) < 1


def test_image_attention_is_the_answer_rows_mass_on_image_and_targets():
    stat = CALIBRATIONS.build({"name": "image_attention"})
    stat.start(num_layers=1, num_heads=4, num_kv_heads=2)
    ctx = _image_ctx(seed=5, layer=0)
    targets = torch.zeros(2, ctx.seq_len, dtype=torch.bool)
    targets[:, 8:10] = True
    answer = torch.tensor([3, 2])
    stat.observe(ctx, CalibrationBatch(answer_tokens=answer, targets=targets))
    out = stat.result()
    want_image, want_target = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    T, G = ctx.seq_len, ctx.group_size
    for b in range(2):
        keys = [j for j in range(T) if ctx.valid[b, j]]
        for h in range(4):
            image = target = 0.0
            for i in range(T - int(answer[b]), T):
                q, k = ctx.queries[b, h, i].double(), ctx.keys[b, h // G].double()
                seen = [j for j in keys if j <= i]
                probs = softmax([float(q @ k[j]) * ctx.scaling for j in seen])
                image += sum(p for p, j in zip(probs, seen, strict=True) if ctx.modality[b, j] == 1)
                target += sum(p for p, j in zip(probs, seen, strict=True) if targets[b, j])
            want_image[h] += image / int(answer[b])
            want_target[h] += target / int(answer[b])
    torch.testing.assert_close(out["image"][0].double(), want_image / 2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["target"][0].double(), want_target / 2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kind, tensors",
    [("visual_heads", {"scores": (30, 9)}), ("image_attention", {"image": (30, 9), "target": (30, 9)}),
     ("hybridkv_head_classes", {"score": (30, 3), "static_share": (30, 3)}),
     ("prefixkv_layer_ratios", {"ratios": (9, 30)})],
)  # fmt: skip
def test_shipped_reader_artefacts_are_found_by_auto(tmp_path, monkeypatch, kind, tensors):
    from kvlab.config.artefacts import PACKAGED, resolve_path

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    path = resolve_path("auto", "smollm2-reader", kind, "artefact")
    assert path.parent == PACKAGED
    artefact = Artefact.load(path).check(kind, "artefact", model="smollm2-reader")
    for name, shape in tensors.items():
        assert tuple(artefact.tensors[name].shape) == shape and float(artefact.tensors[name].sum()) > 0
    assert artefact.settings["data"]["dataset"]["name"] == "reader"

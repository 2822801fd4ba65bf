"""Q-Filters: the calibrated directions and the scores against the paper's formula
(``naive.qfilters``: power iteration in fp64), batched equals unbatched, and the preset's refusal
on a model without its artefact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from naive.context import assert_scores, make_ctx, sample_ctx, sample_lists
from naive.qfilters import first_right_singular_vector, qfilter_scores

from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch
from kvlab.config.artefacts import PACKAGED, Artefact
from kvlab.pipeline import Pipeline

LENGTHS = [23, 15]
DIM = 8
LAYERS = 2


def anisotropic_ctx(layer: int, seed: int):
    """A random batch whose queries share a dominant direction (as trained models' do), so the
    first singular vector is well separated and the power iteration converges."""
    ctx = make_ctx(LENGTHS, dim=DIM, seed=seed, layer_idx=layer, num_layers=LAYERS, scale=0.5)
    offset = torch.linspace(-1.0, 2.0, DIM) * (1 + layer)
    return dataclasses.replace(ctx, queries=ctx.queries + offset)


def calibrate(contexts) -> dict[str, torch.Tensor]:
    statistic = CALIBRATIONS.build({"name": "qfilters"}, "calibration")
    statistic.start(LAYERS, 4, 2)
    for ctx in contexts:
        statistic.observe(ctx, CalibrationBatch(answer_tokens=torch.zeros(ctx.batch_size, dtype=torch.long)))
    return statistic.result()


def test_filters_are_the_signed_first_right_singular_vectors():
    contexts = [anisotropic_ctx(layer, seed) for seed in (1, 2) for layer in range(LAYERS)]
    tensors = calibrate(contexts)
    filters, explained = tensors["filters"], tensors["explained"]
    assert filters.shape == (LAYERS, 2, DIM) and explained.shape == (LAYERS, 2)
    for layer in range(LAYERS):
        for h in range(2):  # KV head h: query heads 2h, 2h + 1 (G = 2), every valid position, both batches
            rows = []
            for ctx in contexts:
                if ctx.layer_idx != layer:
                    continue
                for b in range(ctx.batch_size):
                    _, _, q, _, _ = sample_lists(ctx, b)
                    rows += q[2 * h] + q[2 * h + 1]
            want = first_right_singular_vector(rows)
            torch.testing.assert_close(
                filters[layer, h].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0
            )
            energy = sum(x * x for row in rows for x in row)
            top = sum(sum(a * b for a, b in zip(row, want, strict=True)) ** 2 for row in rows)
            assert float(explained[layer, h]) == pytest.approx(top / energy, abs=1e-5)


def test_padding_and_batching_do_not_change_the_filters():
    contexts = [anisotropic_ctx(layer, 3) for layer in range(LAYERS)]
    alone = [sample_ctx(ctx, b) for ctx in contexts for b in range(2)]
    for ctx, one in zip(alone, [0, 0, 1, 1], strict=True):
        ctx.layer_idx = one
        ctx.num_layers = LAYERS
    torch.testing.assert_close(calibrate(contexts)["filters"], calibrate(alone)["filters"], atol=1e-6, rtol=0)


def artefact_file(tmp_path, filters: torch.Tensor) -> str:
    artefact = Artefact(
        "qfilters", "toy", LAYERS, 4, 2, {"filters": filters, "explained": torch.ones(LAYERS, 2)}
    )
    return str(artefact.save(tmp_path / "qfilters.safetensors"))


def test_scores_are_the_keys_projections_and_batch_alone_agree(tmp_path):
    filters = torch.nn.functional.normalize(
        torch.randn(LAYERS, 2, DIM, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    path = artefact_file(tmp_path, filters)
    node = {"budget": {"tokens": 8, "window": 2}, "importance": {"qfilters": {"artefact": path}}}
    scorer = Pipeline.from_config(node).importance["qfilters"]
    for layer in range(LAYERS):
        ctx = make_ctx(LENGTHS, dim=DIM, seed=5 + layer, layer_idx=layer, num_layers=LAYERS)
        scores = scorer.score(ctx)
        assert scores.shape == (2, 2, ctx.seq_len) and scores.dtype == torch.float32
        for b in range(2):
            _, off, _, k, _ = sample_lists(ctx, b)
            expected = [qfilter_scores(k[h], filters[layer, h].double().tolist()) for h in range(2)]
            assert_scores(scores[b, :, off:], expected)
            alone = scorer.score(sample_ctx(ctx, b))
            assert torch.equal(scores[b, :, off:], alone[0])


def test_shipped_artefacts_hold_unit_filters_that_fit_their_models():
    for model, shape in [
        ("smollm2-135m", (30, 3, 64)),
        ("tiny-llama", (2, 4, 16)),
        ("tiny-qwen2", (3, 2, 16)),
    ]:
        artefact = Artefact.load(PACKAGED / f"{model}.qfilters.safetensors").check(
            "qfilters", "x", model=model
        )
        filters = artefact.tensors["filters"]
        assert tuple(filters.shape) == shape
        torch.testing.assert_close(filters.norm(dim=-1), torch.ones(shape[:2]))
        assert bool((artefact.tensors["explained"] > 0).all())

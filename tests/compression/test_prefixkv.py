"""PrefixKV: the scorer, the global-threshold solvers, the offline and online allocators, the
calibration artefact and the decode rule, each against an independent naive implementation
(tests/naive/prefixkv.py) and the invariants of docs/methods/prefixkv.md (tiny models: plumbing only)."""

import functools
import hashlib
import json

import pytest
import torch
from naive.attention import dot, softmax
from naive.context import LENGTHS, make_ctx, sample_lists
from naive.prefixkv import naive_fixed_index_decode, naive_layer_importance, naive_prefix_sizes
from support import e2e
from support.preset_runs import RECORD, is_vlm_preset, preset_compression, preset_models, preset_samples
from support.presets import preset_config

from kvlab.cache.cache import CompressedCache
from kvlab.cache.selection import Selection
from kvlab.cache.state import RunState
from kvlab.calibration.prefixkv import PrefixLayerRatios, artefact_from_released_configs
from kvlab.calibration.run import calibrate
from kvlab.cli.main import main
from kvlab.compression.allocators import LAYER_ALLOCATORS
from kvlab.compression.decode import DECODE_POLICIES
from kvlab.compression.importance import IMPORTANCE
from kvlab.compression.prefixkv import (
    exclusive_priority,
    fit_to_total,
    gini,
    global_sizes,
    rescale,
    solve_bisect,
    solve_exact,
)
from kvlab.config.artefacts import Artefact
from kvlab.config.errors import ConfigError
from kvlab.config.loader import preset_names
from kvlab.data import build_dataset
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.engine.attention import kvlab_attention
from kvlab.engine.generation import RunOptions, generate, prefill
from kvlab.engine.protocols import build_protocol
from kvlab.engine.session import CompressionSession, active_session, compression_session
from kvlab.pipeline import Pipeline

RECORDED = json.loads(RECORD.read_text())


def dirichlet(L: int, n: int, alpha: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch._standard_gamma(torch.full((L, n), alpha, dtype=torch.float64), generator=gen)


def protect(n: int, sinks: int, window: int) -> torch.Tensor:
    position = torch.arange(n)
    return (position < sinks) | (position >= n - window)


@functools.cache
def items(*words: int) -> tuple:
    return tuple(
        SyntheticRetrieval(num_samples=1, context_words=w, seed=i).samples()[0] for i, w in enumerate(words)
    )


def prefixkv(budget=None, **compression) -> Pipeline:
    node = preset_config("prefixkv")["model"]["compression"]
    if budget is not None:
        kept = {k: v for k, v in node["budget"].items() if k not in ("ratio", "tokens")}  # one of the two
        node["budget"] = {**kept, **budget}
    return Pipeline.from_config({**node, **compression})


# --- scorer and solver against the paper's definitions ---------------------------------------
def test_layer_cumulative_attention_is_the_head_mean_of_accumulated_attention():
    ctx = make_ctx(LENGTHS)  # GQA: 4 query heads on 2 KV heads, left padded
    got = IMPORTANCE.build({"name": "layer_cumulative_attention"}).score(ctx)
    for b in range(len(LENGTHS)):
        n, off, q, k, _ = sample_lists(ctx, b)
        want = torch.tensor(naive_layer_importance(q, k, ctx.scaling), dtype=torch.float64)
        for h in range(ctx.num_kv_heads):  # every KV head holds the same scores
            torch.testing.assert_close(got[b, h, off:].double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sinks, window", [(0, 0), (1, 1), (3, 2)])
def test_exact_solver_is_the_threshold_of_eq_1(sinks, window):
    L, n = 4, 30
    importance = dirichlet(L, n, 0.5, seed=sinks)
    protected = protect(n, sinks, window)
    for total in (L * max(1, sinks + window) + 3, 37, 60, 91, L * n - 5):
        got = global_sizes(importance, protected, total, "exact")
        assert got.tolist() == naive_prefix_sizes(importance.tolist(), protected.tolist(), total)


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.5, 0.9])
def test_bisection_agrees_with_the_exact_solver(ratio):
    L, n = 8, 300
    importance = dirichlet(L, n, 0.3, seed=int(ratio * 10))
    for protected in (protect(n, 0, 0), protect(n, 1, 1)):
        E = exclusive_priority(importance, protected)
        total = round(ratio * L * n)
        found = solve_bisect(E, total, tol_tokens=1, max_iter=64)
        assert int(found.counts.sum()) == total  # an exact threshold exists: no rescaling needed
        assert torch.equal(found.counts, solve_exact(E, total))
        assert torch.equal(global_sizes(importance, protected, total, "bisect"), solve_exact(E, total))


def test_bisection_tolerance_then_rescale_meets_the_budget():
    L, n, held = 8, 300, 2
    importance = dirichlet(L, n, 0.3, seed=7)
    protected = protect(n, 1, 1)
    E = exclusive_priority(importance, protected)
    for ratio in (0.1, 0.2, 0.5):
        total = round(ratio * L * n)
        found = solve_bisect(E, total, tol_tokens=5, max_iter=64)  # the release's 5-token stop
        assert abs(int(found.counts.sum()) - total) < 5 and found.steps < 64
        exact = rescale(found.counts, total, held, n, "largest_remainder")
        assert int(exact.sum()) == total and bool((exact >= held).all() and (exact <= n).all())
        floor = rescale(found.counts, total, held, n, "evicted_floor")
        assert total <= int(floor.sum()) <= total + L


def test_exact_sizes_are_the_minimal_prefixes_reaching_one_threshold():
    L, n = 6, 80
    importance, protected = dirichlet(L, n, 0.4, seed=3), protect(n, 1, 1)
    sizes = global_sizes(importance, protected, 150, "exact")
    p = PrefixLayerRatios.threshold(importance, protected, sizes)
    E = exclusive_priority(importance, protected)  # E[l, k] = C_l[k - 1], the mass ranked above rank k
    for layer, k in enumerate(sizes.tolist()):
        assert float(E[layer, k - 1]) < p  # C_l[k_l - 1] < p: one token fewer misses the threshold
        assert k == n or float(E[layer, k]) >= p  # C_l[k_l] >= p: the prefix reaches it


def test_hand_example():
    importance = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    none = torch.zeros(4, dtype=torch.bool)
    assert global_sizes(importance, none, 4).tolist() == [3, 1]  # r = 0.5: p in (0.5, 0.7]
    assert global_sizes(importance, none, 6).tolist() == [4, 2]  # r = 0.75: p in (0.75, 0.8]


def test_identical_layers_get_the_uniform_budget_and_sizes_grow_with_it():
    L, n = 5, 64
    importance = dirichlet(1, n, 0.5, seed=1).expand(L, n)
    for ratio in (0.1, 0.33, 0.5, 0.9):
        total = round(ratio * L * n)
        sizes = global_sizes(importance, protect(n, 1, 1), total)
        assert set(sizes.tolist()) <= {total // L, -(-total // L)} and int(sizes.sum()) == total
    varied, previous = dirichlet(L, n, 0.5, seed=2), None
    for total in range(L * 2, L * n + 1, 7):
        sizes = global_sizes(varied, protect(n, 1, 1), total)
        assert previous is None or bool((sizes >= previous).all())
        previous = sizes


def test_a_one_hot_layer_keeps_one_token_until_the_others_are_full():
    L, n = 3, 20
    importance = dirichlet(L, n, 1.0, seed=4)
    importance[0] = 0.0
    importance[0, 7] = 1.0
    none = torch.zeros(n, dtype=torch.bool)
    for total in (3, 10, 21, 2 * n + 1):
        sizes = global_sizes(importance, none, total)
        assert int(sizes[0]) == 1 and int(sizes.sum()) == total
    assert global_sizes(importance, none, 2 * n + 2).tolist() == [2, n, n]


def test_gini_orders_layers_and_the_concentrated_layer_keeps_less():
    n = 200
    assert gini(torch.ones(1, n)).item() == pytest.approx(0.0, abs=1e-12)
    assert gini(torch.eye(n)[:1]).item() == pytest.approx(1 - 1 / n)
    concentrated, dispersed = dirichlet(1, n, 0.1, seed=5), dirichlet(1, n, 10.0, seed=6)
    importance = torch.cat([concentrated, dispersed])
    g = gini(importance)
    assert g[0] > g[1]
    sizes = global_sizes(importance, torch.zeros(n, dtype=torch.bool), n)  # r = 0.5
    assert sizes[0] < sizes[1]


def test_fit_to_total_respects_bounds_and_total():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        real = torch.rand(9, generator=gen) * 60
        sizes = fit_to_total(real, 2, 40, 150)
        assert int(sizes.sum()) == 150 and bool((sizes >= 2).all() and (sizes <= 40).all())
    assert fit_to_total(torch.tensor([10.0, 30.0]), 1, 100, 40).tolist() == [10, 30]
    with pytest.raises(ValueError, match="cannot be split"):
        fit_to_total(torch.ones(3), 5, 10, 12)


def test_online_allocator_splits_each_sample_by_its_own_threshold():
    """``prefix_threshold`` fed every layer's scores (what the pipeline's global schedule does)
    returns, per sample, the exact solution on that sample's own valid tokens."""
    L, run = 3, RunState()  # one prefill's shared state, as the engine gives every layer
    allocator = LAYER_ALLOCATORS.build({"name": "prefix_threshold"})
    scorer = IMPORTANCE.build({"name": "layer_cumulative_attention"})
    sharpness = (0.3, 1.5, 4.0)  # larger logits: attention concentrated on fewer tokens
    contexts = [
        make_ctx(LENGTHS, layer_idx=i, num_layers=L, seed=i, scale=sharpness[i], run=run) for i in range(L)
    ]
    for ctx in contexts:
        ctx.protected = ctx.valid & (ctx.positions() == 0)  # one sink
        scores = {"attention": scorer.score(ctx)}
        allocator.observe(ctx, scores, scores["attention"])
    lengths = torch.tensor(LENGTHS)
    budget = torch.tensor([9, 26])  # the second sample keeps everything
    held = torch.ones_like(lengths)
    sizes = torch.stack([allocator.allocate(budget, lengths, held, ctx) for ctx in contexts])  # [L, B]
    T = max(LENGTHS)
    importance = torch.stack([scorer.score(ctx)[0, 0, T - LENGTHS[0] :] for ctx in contexts])
    protected = torch.arange(LENGTHS[0]) == 0
    assert torch.equal(sizes[:, 0], global_sizes(importance, protected, L * 9))
    assert bool((sizes[:, 1] == 26).all())  # a budget covering the prompt: no compression
    assert len(set(sizes[:, 0].tolist())) > 1  # the layers really differ


# --- offline allocator and its artefact --------------------------------------------------------
def ratios_artefact(tmp_path, L=4, H=4, Hkv=2) -> str:
    ratios = torch.tensor([[0.4, 0.1, 0.05, 0.25], [0.8, 0.5, 0.3, 0.4]])  # budgets 0.2 and 0.5
    artefact = Artefact(
        "prefixkv_layer_ratios",
        "m",
        L,
        H,
        Hkv,
        {"budgets": torch.tensor([0.2, 0.5], dtype=torch.float64), "ratios": ratios},
    )
    return str(artefact.save(tmp_path / "r.safetensors"))


def calibrated_sizes(allocator, budget, lengths, held, ctx) -> torch.Tensor:
    """``[L, B]`` the allocator's budgets of every layer."""
    out = []
    for layer in range(ctx.num_layers):
        ctx.layer_idx = layer
        out.append(allocator.allocate(budget, lengths, held, ctx))
    return torch.stack(out)


def test_calibrated_allocator_uses_the_budget_row_and_keeps_the_total(tmp_path):
    ctx = make_ctx(LENGTHS, num_layers=4)
    lengths = torch.tensor(LENGTHS)
    held = torch.full_like(lengths, 2)
    strict = LAYER_ALLOCATORS.build({"name": "prefix_calibrated", "artefact": ratios_artefact(tmp_path)})
    budget = torch.floor(lengths.double() * 0.2).long()  # what budget: {ratio: 0.2} asks
    sizes = calibrated_sizes(strict, budget, lengths, held, ctx)
    assert torch.equal(sizes.sum(0), 4 * budget)  # exactly L x the uniform budget
    assert bool((sizes >= 2).all() and (sizes <= lengths).all())
    want = fit_to_total(torch.tensor([0.4, 0.1, 0.05, 0.25]) * 37, 2, 37, 4 * 7)
    assert torch.equal(sizes[:, 0], want) and sizes[0, 0] > sizes[2, 0]  # the row's shape
    with pytest.raises(ConfigError, match="not one the artefact was calibrated for.*interpolate: linear"):
        calibrated_sizes(strict, torch.tensor([12, 9]), lengths, held, ctx)
    linear = LAYER_ALLOCATORS.build(
        {"name": "prefix_calibrated", "artefact": ratios_artefact(tmp_path), "interpolate": "linear"}
    )
    grid = torch.tensor([0.2, 0.5], dtype=torch.float64)
    rows = torch.tensor([[0.4, 0.1, 0.05, 0.25], [0.8, 0.5, 0.3, 0.4]], dtype=torch.float64)
    fractions = linear.fractions(grid, rows, 35, 100)  # r = 0.35: halfway between the rows
    torch.testing.assert_close(fractions, torch.tensor([0.6, 0.3, 0.175, 0.325], dtype=torch.float64))
    assert torch.equal(calibrated_sizes(linear, budget, lengths, held, ctx), sizes)  # on the grid: no change
    nearest = LAYER_ALLOCATORS.build(
        {"name": "prefix_calibrated", "artefact": ratios_artefact(tmp_path), "rounding": "nearest"}
    )
    got = calibrated_sizes(nearest, budget, lengths, held, ctx)[:, 0]
    assert got.tolist() == [15, 4, 2, 9]  # the release: 37 - round((1 - R_l) 37), at least the protected 2


def test_released_configs_convert_from_evicted_to_kept_fractions():
    # the 7B 20% config as kept fractions, rounded to 2 decimals (hence the 0.005 tolerance)
    kept20 = [0.72, 0.57, 0.35, 0.09, 0.07, 0.02, 0.16, 0.22, 0.24, 0.33, 0.38, 0.43, 0.33, 0.26, 0.20, 0.29]
    kept20 += [0.16, 0.14, 0.12, 0.07, 0.13, 0.01, 0.03, 0.03, 0.02, 0.04, 0.02, 0.02, 0.20, 0.06, 0.29, 0.47]
    evicted = {0.8: [1 - x for x in kept20], 0.0: [0.0] * 32}  # `_0.8.json` is the 20% budget
    artefact = artefact_from_released_configs(evicted, "llava-1.5-7b", 32, 32, 32, tolerance=0.005)
    assert artefact.tensors["budgets"].tolist() == [0.2, 1.0]
    torch.testing.assert_close(artefact.tensors["ratios"][0], torch.tensor(kept20))
    with pytest.raises(ConfigError, match="has 31 layers"):
        artefact_from_released_configs({0.8: evicted[0.8][:31]}, "m", 32, 32, 32, tolerance=0.005)
    with pytest.raises(ConfigError, match="not evicted fractions"):
        artefact_from_released_configs({0.8: kept20}, "m", 32, 32, 32)  # kept numbers given as evicted


@pytest.mark.parametrize(
    "model, shape", [("smollm2-135m", (30, 9, 3)), ("tiny-llama", (2, 4, 4)), ("tiny-qwen2", (3, 4, 2))]
)
def test_shipped_ratio_artefacts_fit_their_model_and_keep_their_budgets(tmp_path, monkeypatch, model, shape):
    from kvlab.config.artefacts import PACKAGED, resolve_path
    from kvlab.models.shape import model_shape

    facts = model_shape(model)  # before KVLAB_CACHE moves: SmolLM2 reads its converted config
    shape_facts = {k: facts[k] for k in ("num_layers", "num_heads", "num_kv_heads")}
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))  # nothing calibrated locally
    path = resolve_path("auto", model, "prefixkv_layer_ratios", "artefact")
    assert path.parent == PACKAGED
    artefact = Artefact.load(path).check("prefixkv_layer_ratios", "artefact", model=model, **shape_facts)
    assert (artefact.num_layers, artefact.num_heads, artefact.num_kv_heads) == shape
    budgets, ratios = artefact.tensors["budgets"], artefact.tensors["ratios"]
    assert budgets.dtype == torch.float64 and ratios.shape == (len(budgets), shape[0])
    torch.testing.assert_close(ratios.double().mean(1), budgets, atol=0.01, rtol=0)  # kept fractions
    assert bool((ratios[1:] >= ratios[:-1]).all())  # every layer keeps more at a larger budget


# --- end to end on the tiny models -----------------------------------------------------------
def test_unlimited_budget_reproduces_full_exactly():
    loaded = e2e.kvlab_model("tiny-llama")
    batch = items(40, 25)
    full = e2e.run(loaded, Pipeline.from_config(None), batch, 5)
    online = {"schedule": "global", "allocate": {"layer": {"name": "prefix_threshold"}}}
    for budget in ({"ratio": 1.0}, {"tokens": 10_000}):
        for mode in ({}, online):  # offline ratios, then the threshold solved online
            got = e2e.run(loaded, prefixkv(budget, **mode), batch, 5)
            assert got.tokens == full.tokens and torch.equal(got.step_logits, full.step_logits)
            assert torch.equal(got.kept, full.kept)


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_protected_tokens_are_kept_and_heads_of_a_layer_share_positions(ratio):
    loaded = e2e.kvlab_model("tiny-qwen2")  # GQA: 2 KV heads
    result = e2e.run(loaded, prefixkv({"ratio": ratio}), items(60, 35), 2)
    T = int(result.prompt_lengths.max())
    for report in result.reports:
        for b, n in enumerate(result.prompt_lengths.tolist()):
            heads = [report.selection.kept_positions(b, h) for h in range(report.kept.shape[1])]
            assert all(kept == heads[0] for kept in heads)
            assert {T - n, T - 1} <= set(heads[0]) and len(heads[0]) < n
    kept = torch.stack([r.kept[:, 0] for r in result.reports])  # [L, B]
    assert torch.equal(kept.sum(0), len(result.reports) * torch.floor(result.prompt_lengths * ratio).long())


def test_prefix_threshold_needs_the_global_schedule():
    node = preset_config("prefixkv")["model"]["compression"]
    node["allocate"]["layer"] = {"name": "prefix_threshold"}
    with pytest.raises(
        ConfigError, match=r"allocate\.layer \(prefix_threshold\) compares every layer.*schedule: global"
    ):
        Pipeline.from_config(node)


def test_offline_sizes_equal_the_calibration_prompt_solution_and_online(tmp_path):
    """Calibrate on one prompt, then compress that prompt offline: the sizes are the row the
    statistic solved; online (schedule: global) solves the same threshold on the same scores."""
    dataset = {"name": "synthetic_retrieval", "num_samples": 1, "context_words": 80, "seed": 9}
    settings = {
        "model": "tiny-qwen2",
        "calibration": {"name": "prefixkv_layer_ratios", "budgets": [0.2, 0.4]},
        "data": {"dataset": dataset},
        "output": str(tmp_path / "p.safetensors"),
    }
    artefact = Artefact.load(calibrate(settings))
    assert artefact.kind == "prefixkv_layer_ratios" and artefact.tensors["ratios"].shape == (2, 3)
    assert artefact.tensors["per_sample"].shape == (2, 1, 3)
    loaded = e2e.kvlab_model("tiny-qwen2")
    sample = build_dataset(dataset, "data.dataset").samples()
    for row, ratio in enumerate((0.2, 0.4)):
        offline = prefixkv(
            {"ratio": ratio},
            allocate={
                "layer": {"name": "prefix_calibrated", "artefact": str(tmp_path / "p.safetensors")},
                "head": {"name": "uniform"},
            },
        )
        got = e2e.run(loaded, offline, sample, 2)
        n = int(got.prompt_lengths[0])
        sizes = torch.stack([r.kept[0, 0] for r in got.reports])
        assert torch.equal(sizes, torch.round(artefact.tensors["ratios"][row].double() * n).long())
        online = e2e.run(
            loaded,
            prefixkv({"ratio": ratio}, schedule="global", allocate={"layer": {"name": "prefix_threshold"}}),
            sample,
            2,
        )
        for mine, theirs in zip(got.reports, online.reports, strict=True):
            assert torch.equal(mine.selection.indices, theirs.selection.indices)


def layer_local(name: str) -> bool:
    """A preset whose components need only their own layer, and which can run ``schedule: global``
    (a progressive prefill, Finch's, compresses after every chunk: it refuses the global schedule)."""
    node = preset_config(name)["model"].get("compression")
    if not node:
        return False
    pipeline = Pipeline.from_config(node)
    return not pipeline.needs_all_layers and not pipeline.prefill_mode.progressive


LAYER_LOCAL = [(name, model) for name in preset_names() if layer_local(name) for model in preset_models(name)]


def selection_record(node: dict, preset: str, model: str) -> dict:
    """Generated tokens, kept counts and per-layer digests of the kept positions (as
    ``tests/support/preset_runs.py`` records them) of ``node`` on the preset's samples."""
    result = e2e.run(
        e2e.kvlab_model(model), Pipeline.from_config(node), preset_samples(is_vlm_preset(preset)), 6
    )
    assert [r.layer_idx for r in result.reports] == list(range(len(result.reports)))
    digests = []
    for report in result.reports:
        positions = torch.where(report.selection.mask(), report.selection.indices, -1)
        digests.append(hashlib.sha256(positions.cpu().numpy().tobytes()).hexdigest()[:16])
    return {"tokens": result.tokens, "kept": result.kept.tolist(), "positions": digests}


@pytest.mark.parametrize(("preset", "model"), LAYER_LOCAL)
def test_every_layer_local_preset_keeps_the_same_selection_under_both_schedules(preset, model, visual_heads):
    """schedule: global scores every layer during the prefill and compresses them all after the
    last one; a method whose components need only their own layer (routes, merges, decode
    policies, retrieval included) keeps the positions and tokens of its layerwise run (the
    recorded one when the preset is layerwise)."""
    node = preset_compression(preset, model, visual_heads)
    key = f"{preset}/{model}"
    if node.get("schedule", "layerwise") == "layerwise" and key in RECORDED:
        want = RECORDED[key]
    else:
        want = selection_record({**node, "schedule": "layerwise"}, preset, model)
    got = selection_record({**node, "schedule": "global"}, preset, model)
    assert got["kept"] == want["kept"] and got["positions"] == want["positions"]
    assert got["tokens"] == want["tokens"]


def test_global_schedule_keeps_what_layerwise_keeps_for_layer_local_methods():
    loaded = e2e.kvlab_model("tiny-qwen2")
    node = preset_config("snapkv")["model"]["compression"]
    node["budget"] = {"tokens": 40, "window": 8}
    want = e2e.run(loaded, Pipeline.from_config(node), items(60, 35), 4)
    got = e2e.run(loaded, Pipeline.from_config({**node, "schedule": "global"}), items(60, 35), 4)
    assert got.tokens == want.tokens and torch.equal(got.step_logits, want.step_logits)
    for mine, theirs in zip(got.reports, want.reports, strict=True):
        assert torch.equal(mine.selection.indices, theirs.selection.indices)


@pytest.mark.parametrize("solver", ["exact", "bisect"])
def test_online_allocator_splits_the_total_budget_over_layers(solver):
    loaded = e2e.kvlab_model("tiny-qwen2")
    pipeline = prefixkv(
        {"ratio": 0.3},
        schedule="global",
        allocate={"layer": {"name": "prefix_threshold", "solver": solver}, "head": {"name": "uniform"}},
    )
    result = e2e.run(loaded, pipeline, items(60, 35), 4)
    kept = torch.stack([r.kept[:, 0] for r in result.reports])  # [L, B]
    L = kept.shape[0]
    assert torch.equal(kept.sum(0), L * torch.floor(result.prompt_lengths * 0.3).long())
    assert bool((kept >= 2).all())


def online(**compression) -> Pipeline:
    return Pipeline.from_config({**preset_config("prefixkv_online")["model"]["compression"], **compression})


def test_per_head_selection_keeps_the_layer_sizes_of_the_head_mean():
    """The per-head extension (cumulative_attention, mean over each GQA group) ranks tokens per KV
    head, but the mean of its scores over KV heads is the head-mean I_l, so the online threshold
    gives every layer the same size as the paper's shared ranking."""
    loaded = e2e.kvlab_model("tiny-qwen2")  # 4 query heads on 2 KV heads
    shared = e2e.run(loaded, online(budget={"ratio": 0.3, "window": 1, "sinks": 1}), items(60, 35), 2)
    per_head = online(
        budget={"ratio": 0.3, "window": 1, "sinks": 1},
        importance={"attention": {"name": "cumulative_attention", "gqa": "mean"}},
    )
    got = e2e.run(loaded, per_head, items(60, 35), 2)
    assert torch.equal(got.kept, shared.kept)
    ctx = make_ctx(LENGTHS)  # the identity behind it, on a GQA context: KV heads' mean = I_l
    own = IMPORTANCE.build({"name": "cumulative_attention", "gqa": "mean"}).score(ctx)  # [B, Hkv, T]
    assert not torch.allclose(own[:, 0], own[:, 1])  # one ranking per KV head
    torch.testing.assert_close(
        own.mean(1), IMPORTANCE.build({"name": "layer_cumulative_attention"}).score(ctx)[:, 0]
    )


def test_global_schedule_refuses_what_cannot_work():
    loaded = e2e.kvlab_model("tiny-llama")
    batch = loaded.processor.collate(list(items(60)))
    with pytest.raises(ConfigError, match=r"schedule = global cannot run with model\.prefill_chunk = 16"):
        prefill(loaded, online(), batch, options=RunOptions(prefill_chunk=16))
    with pytest.raises(ConfigError, match=r"importance\.attention \(layer_cumulative_attention\) needs the"):
        prefill(
            loaded, prefixkv(), batch, options=RunOptions(prefill_chunk=16)
        )  # the scorer needs every prompt query
    with pytest.raises(ConfigError, match=r"schedule must be 'layerwise'.*or 'global'.*Did you mean"):
        online(schedule="globl")
    decode_time = build_protocol({"name": "decode_time", "interval": 8, "target_size": 16})
    with pytest.raises(ConfigError, match=r"decode_time: model\.compression\.allocate\.layer \(prefix_thre"):
        decode_time.check(online())
    routed = preset_config("david")["model"]["compression"]
    routed.update(
        schedule="global", allocate={**routed.get("allocate", {}), "layer": {"name": "prefix_threshold"}}
    )
    with pytest.raises(
        ConfigError, match=r"route: the layer allocator 'prefix_threshold' compares every layer"
    ):
        Pipeline.from_config(routed)


def test_global_prefill_compresses_every_layer_once_the_last_is_observed(monkeypatch):
    """Observed layers wait with their dense K/V and only the recent window's queries (the scorer
    ran already); all are compressed after the last layer's attention, in layer order."""
    loaded = e2e.kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(items(60, 35)))
    waiting = []
    pipeline = online()
    compress = pipeline.compress  # the engine hands each layer's context to the pipeline

    def spy(ctx, **kwargs):
        session = active_session()  # the run's session, as the attention function sees it
        waiting.append(
            (ctx.layer_idx, len(session.pending), ctx.queries.shape[2], session.cache.layers[-1].compressed)
        )
        return compress(ctx, **kwargs)

    monkeypatch.setattr(pipeline, "compress", spy)
    state = prefill(loaded, pipeline, batch)
    L = loaded.info.num_layers
    assert [w[0] for w in waiting] == list(range(L))
    assert [w[1] for w in waiting] == list(range(L - 1, -1, -1))  # all observed before the first compression
    assert all(w[2] == 1 for w in waiting)  # queries cut to the window (budget.window = 1)
    assert all(layer.compressed and layer.keys is None for layer in state.cache.layers)
    assert not state.session.pending and [r.layer_idx for r in state.session.reports] == list(range(L))
    h2o = online(decode={"name": "h2o", "recent": 1})  # its seed reads every prompt query
    waiting.clear()
    prefill(loaded, h2o, batch)
    assert all(w[2] == batch.input_ids.shape[1] for w in waiting)


def test_online_threshold_on_a_model_with_sliding_window_layers():
    """Sliding-window layers keep their visible window (as for every method); the threshold splits
    the full-attention layers' total. Compressing within the window is refused."""
    from support.attention_variants import WINDOW, build, prompts, tokenizer

    import kvlab
    from kvlab.models.prompts import collate_ids

    loaded = kvlab.wrap_model(build("gemma3-text"), tokenizer(), name="gemma3-text")
    batch = collate_ids(loaded, prompts())
    node = {"budget": {"ratio": 0.3, "window": 1, "sinks": 1}}
    result = generate(loaded, online(**node), batch, RunOptions(max_new_tokens=8))
    kinds = loaded.model.config.layer_types
    full = [layer for layer, kind in enumerate(kinds) if kind == "full_attention"]
    assert full and len(full) < len(kinds)
    kept = torch.stack([report.kept[:, 0] for report in result.reports])  # [L, B] after the prefill
    for b, n in enumerate(result.prompt_lengths.tolist()):
        for layer, kind in enumerate(kinds):
            if kind == "sliding_attention":  # its window, also after decoding (the decode rule skips it)
                assert int(kept[layer, b]) == int(result.kept[layer, b, 0]) == min(n, WINDOW - 1)
        assert int(kept[full, b].sum()) == len(full) * int(0.3 * n)
    with pytest.raises(ConfigError, match="sliding-window layer compressed within its window"):
        generate(loaded, online(**node, sliding_layers="compress"), batch, RunOptions(max_new_tokens=2))


def test_calibrated_ratios_are_refused_on_a_sliding_window_layer():
    """The offline ratios cover every layer as a full-attention one: refused, pointing to the online mode."""
    from types import SimpleNamespace

    from kvlab.compression.prefixkv import PrefixCalibratedAllocator

    ctx = SimpleNamespace(sliding_window=512, layer_idx=0)
    one = torch.tensor([100])
    with pytest.raises(ConfigError, match="sliding-window layer.*prefixkv_online"):
        PrefixCalibratedAllocator().allocate(one, torch.tensor([400]), torch.tensor([2]), ctx)


# --- the decode rule ---------------------------------------------------------------------------
def test_decode_rule_matches_a_naive_list_simulation():
    """One layer, two samples with different prompt lengths and kept fractions (so they drop on
    different steps), ragged heads: the stored entries equal the naive list after every step and
    the attention outputs equal attention over that list."""
    B, HKV, G, D, T, steps, distance = 2, 2, 2, 4, 12, 14, 3
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(B, HKV, T, D, generator=gen), torch.randn(B, HKV, T, D, generator=gen)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False  # sample 1 has 9 prompt tokens
    prompt = [12, 9]
    kept = [[[0, 2, 3, 7, 9, 11], [1, 4, 8, 11]], [[3, 5, 11], [4, 6, 9, 10, 11]]]  # (b, h) positions
    counts = torch.tensor([[len(c) for c in row] for row in kept])
    K = int(counts.max())
    indices = torch.tensor([[c + [0] * (K - len(c)) for c in row] for row in kept])
    cache = CompressedCache(num_layers=1, decode_capacity=2)  # the decode region grows on the way
    layer = cache.layers[0]
    layer.update(keys, values)
    layer.compress(Selection(indices=indices, counts=counts))
    policy = DECODE_POLICIES.build({"name": "fixed_index_evict", "distance": distance})
    run = RunState(cache=cache, valid=valid, modality=torch.zeros(B, T))
    session = CompressionSession(run, pipeline=None)
    policy.start(run)
    attention = torch.nn.Module()
    attention.layer_idx = 0
    queries = [torch.randn(B, HKV * G, 1, D, generator=gen) for _ in range(steps)]
    new_kv = [
        (torch.randn(B, HKV, 1, D, generator=gen), torch.randn(B, HKV, 1, D, generator=gen))
        for _ in range(steps)
    ]
    naive = {
        (b, h): naive_fixed_index_decode(
            [("prompt", p) for p in kept[b][h]], len(kept[b][h]), prompt[b], distance, steps
        )
        for b in range(B)
        for h in range(HKV)
    }

    def vector(entry, which):
        kind, i = entry
        return (keys if which == 0 else values)[b, h, i] if kind == "prompt" else new_kv[i][which][b, h, 0]

    dropped_apart = False
    for step in range(steps):
        layer.update(*new_kv[step])
        with compression_session(session):
            out, _ = kvlab_attention(attention, queries[step], *new_kv[step], None, D**-0.5)
        before = [
            naive[(b, h)][step - 1] if step else [("prompt", p) for p in kept[b][h]]
            for b in range(B)
            for h in range(HKV)
        ]
        policy.after_step(run, step)
        for b in range(B):
            for h in range(HKV):
                seen = before[b * HKV + h] + [("new", step)]  # what the step's query attended to
                for g in range(G):
                    q = queries[step][b, h * G + g, 0].double().tolist()
                    probs = softmax([dot(q, vector(e, 0).double().tolist()) * D**-0.5 for e in seen])
                    want = sum(p * vector(e, 1).double() for p, e in zip(probs, seen, strict=True))
                    torch.testing.assert_close(out[b, 0, h * G + g].double(), want, atol=1e-5, rtol=0)
                entries = naive[(b, h)][step]
                stored = torch.cat([layer.segment(b, h)[0], layer.decode_keys[b, h, : layer.decode_length]])
                assert stored.shape[0] == len(entries) and len(seen) - len(entries) in (0, 1)
                assert sorted(map(tuple, stored.tolist())) == sorted(
                    tuple(vector(e, 0).tolist()) for e in entries
                )
                n0 = len(kept[b][h])
                assert abs(len(entries) - (prompt[b] + step + 1) * n0 / prompt[b]) <= 1  # fraction held
        dropped = [len(naive[(b, 0)][step]) - len(naive[(b, 0)][step - 1]) if step else 0 for b in range(B)]
        dropped_apart |= dropped[0] != dropped[1]
    assert dropped_apart  # the samples really dropped on different steps (both paths of evict_rows)


def test_decode_uses_true_positions_and_a_batch_equals_its_samples_alone():
    loaded = e2e.kvlab_model("tiny-llama")
    pipeline = prefixkv({"ratio": 0.3}, decode={"name": "fixed_index_evict", "distance": 4})
    seen = []

    def record(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            seen.append(kwargs["position_ids"].flatten().tolist())

    handle = loaded.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        batched = e2e.run(loaded, pipeline, items(60, 35), 10)
    finally:
        handle.remove()
    lengths = batched.prompt_lengths.tolist()
    assert seen == [[n + step for n in lengths] for step in range(9)]  # the original prompt continues
    for b, item in enumerate(items(60, 35)):
        alone = e2e.run(loaded, pipeline, [item], 10)
        assert batched.tokens[b] == alone.tokens[0]
        torch.testing.assert_close(batched.step_logits[b], alone.step_logits[0], atol=1e-4, rtol=1e-4)
        for mine, theirs in zip(batched.reports, alone.reports, strict=True):
            assert torch.equal(mine.kept[b], theirs.kept[0])


# --- the presets and the commands --------------------------------------------------------------
def test_prefixkv_preset_runs_through_the_cli(tmp_path):
    args = [
        "--model.model",
        "tiny-llama",
        "--trainer.enable_progress_bar",
        "false",
        "--model.max_new_tokens",
        "3",
        "--data.dataset.num_samples",
        "2",
        "--data.dataset.context_words",
        "40",
        "--run.dir",
        str(tmp_path),
    ]
    for preset in ("prefixkv", "prefixkv_online"):
        main(["predict", "--config", preset, *args, "--run.method", preset])
        run = tmp_path / "default" / preset
        records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
        assert len(records) == 2 and all(0 < r["kv_ratio"] < 0.35 for r in records)
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["samples"] == 2 and 0 < metrics["kv_ratio"] < 0.35


def test_calibrated_ratios_are_refused_with_other_protected_tokens():
    """The artefact's ratios were solved with one sink and one window token: another budget window
    would make them the sizes of another problem."""
    loaded = e2e.kvlab_model("tiny-qwen2")
    with pytest.raises(ConfigError, match="calibrated with 2 protected tokens"):
        e2e.run(loaded, prefixkv({"ratio": 0.2, "window": 8}), items(60, 35), 2)

"""kvpress's kept positions on a tiny model, the cases of ``tests/fixtures/kvpress/kept.json``.

One prompt of seeded random token ids (:func:`prompt_ids`). Each case names a kvpress press with
its arguments and the kvlab ``model.compression`` that should keep the same positions;
``tests/fixtures/kvpress/make_kept.py`` records kvpress's, run in a separate environment holding
kvpress (its versions are in the file), and the method tests compare kvlab's. Two kinds of case:

- a press that scores keys and values alone (LagKV, CUR, ChunkKV, EntropyGatedChunkKV): the
  prompt through the plain model (its own attention, no kvlab) gives each layer's keys and values
  ``[1, Hkv, T, D]`` (post-RoPE, as both frameworks see them); kvpress scores them, and kvlab's
  pipeline compresses a :class:`LayerContext` of them (:func:`kvlab_kept`);
- a press that reads the attention layer (``forward``: the layer's input hidden states, its
  ``q_proj``, rotary embedding or ``o_proj``: Expected Attention, TOVA, CriticalKV, ThinK): kvpress's
  own hooks run during a forward of the plain model, and kvlab's side is its prefill of the same
  prompt with the same weights (:func:`kvlab_prefill_kept`; a channel pruning case also records
  each head's kept key channels, :func:`kvlab_prefill_channels`). A press that also writes text into
  the model's input (``tokenizer``: KVzip's repeat request) reads the model's tokenizer, saved
  without a chat template for the recording; kvlab's side then formats with
  ``data.chat_template: none`` (both write ``"\n"`` after the request).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvlab.compression.context import LayerContext
from kvlab.config.loader import merge, resolve
from kvlab.engine.generation import prefill
from kvlab.models import load_model
from kvlab.models.base import Batch
from kvlab.pipeline import Pipeline
from support.e2e import kvlab_model
from support.paths import FIXTURES

RECORD = FIXTURES / "kvpress" / "kept.json"
MODEL = "tiny-llama"
LENGTH = 55  # 4 sinks + 6 partitions of 8 + 3: LagKV scores 5 partitions, its tail is 11 tokens
SEED = 0


@dataclass(frozen=True)
class Case:
    """A kvpress press (class name in ``kvpress``, its arguments) and the kvlab compression node
    expected to keep the same ``kept`` positions per head (with head budgets, ``kept`` is the
    mean count)."""

    press: str
    args: dict[str, Any]
    kvlab: dict[str, Any]
    kept: int
    wraps: str | None = None  # the ScorerPress a wrapping press (ChunkKVPress) scores with
    ratio: float | None = None  # the compression ratio, when it is not ``ratio_for(kept)``
    wraps_args: dict[str, Any] = field(default_factory=dict)  # the wrapped press's arguments
    model: str = MODEL
    forward: bool = False  # the press reads the attention layer: recorded from the model's forward
    channels: bool = False  # the press prunes key channels (ThinK): each head's kept channels recorded
    tokenizer: bool = False  # the press writes text (KVzip): the model's tokenizer, no chat template
    sketch: bool = False  # the press draws a Gaussian sketch: the recording hands it kvlab's (seed 0)


def ratio_for(kept: int) -> float:
    """The ``compression_ratio`` for which kvpress keeps ``int(LENGTH * (1 - ratio)) == kept``."""
    return 1 - (kept + 0.5) / LENGTH


#: LagKV: 4 sinks + the 11-token tail + 3 tokens from each of the 5 scored partitions (a count that
#: divides evenly, so no tie between partitions decides); cross scoring has no ties at all
CASES: dict[str, Case] = {
    "lagkv": Case(
        "LagKVPress",
        {"n_sink": 4, "lag_size": 8},
        {"budget": {"tokens": 30, "window": 0, "sinks": 4}, "importance": {"lagkv": {"lag_size": 8}}},
        30,
    ),
    "lagkv_cross": Case(
        "LagKVPress",
        {"n_sink": 4, "lag_size": 8, "cross_scoring": True},
        {
            "budget": {"tokens": 27, "window": 0, "sinks": 4},
            "importance": {"lagkv": {"lag_size": 8, "cross_scoring": True}},
        },
        27,
    ),
    # CURPress with its defaults (kv_product, local windows of 16, no projection) and kv_avg; kvpress
    # scores its 4 sinks 1.0 and has no recent window: budget.sinks 4, window 0
    "cur": Case(
        "CURPress",
        {"num_sinks": 4},
        {"budget": {"tokens": 20, "window": 0, "sinks": 4}, "importance": {"cur": {}}},
        20,
    ),
    "cur_kv_avg": Case(
        "CURPress",
        {"num_sinks": 4, "leverage_type": "kv_avg"},
        {"budget": {"tokens": 33, "window": 0, "sinks": 4}, "importance": {"cur": {"leverage": "kv_avg"}}},
        33,
    ),
    # ChunkKVPress around KnormPress: 11 chunks of 5 (4 kept: ratio 1 - 4.5 / 11) or 5 of 11 (2 kept);
    # kvpress sums the scores over the heads (every head keeps the same chunks) and keeps whole
    # chunks only, so the budget is whole chunks, with no sinks or window
    "chunkkv": Case(
        "ChunkKVPress",
        {"chunk_length": 5},
        {
            "budget": {"tokens": 20, "window": 0},
            "importance": {"key_norm": {}},
            "select": {"name": "chunkkv", "chunk": 5, "heads": "shared"},
        },
        20,
        wraps="KnormPress",
        ratio=1 - 4.5 / 11,
    ),
    "chunkkv_11": Case(
        "ChunkKVPress",
        {"chunk_length": 11},
        {
            "budget": {"tokens": 22, "window": 0},
            "importance": {"key_norm": {}},
            "select": {"name": "chunkkv", "chunk": 11, "heads": "shared"},
        },
        22,
        wraps="KnormPress",
        ratio=1 - 2.5 / 5,
    ),
    # EntropyGatedChunkKVPress around KnormPress, every head ranking the scores summed over the heads
    # (kvpress's convention: heads shared): chunks of 10 (5 whole, the partial last of 5) keeping 24,
    # and chunks of 4 (13 whole, the last of 3) keeping 50, which leaves budget after every chunk
    # (the spiky ones cut to 1 token) for the best remaining tokens; no sinks or window
    "entropy_gated_chunkkv": Case(
        "EntropyGatedChunkKVPress",
        {"chunk_length": 10, "low_entropy_chunk_length": 4},
        {
            "budget": {"tokens": 24, "window": 0},
            "importance": {"key_norm": {}},
            "select": {
                "name": "entropy_gated_chunkkv",
                "chunk": 10,
                "low_entropy_chunk": 4,
                "heads": "shared",
            },
        },
        24,
        wraps="KnormPress",
    ),
    "entropy_gated_chunkkv_topup": Case(
        "EntropyGatedChunkKVPress",
        {"chunk_length": 4, "low_entropy_chunk_length": 1},
        {
            "budget": {"tokens": 50, "window": 0},
            "importance": {"key_norm": {}},
            "select": {
                "name": "entropy_gated_chunkkv",
                "chunk": 4,
                "low_entropy_chunk": 1,
                "heads": "shared",
            },
        },
        50,
        wraps="KnormPress",
    ),
    # Expected Attention with the reference's settings (4 sinks, 512 future positions, covariance,
    # value norm; epsilon 0.02 as kvlab's preset, kvpress' default being 0): the sinks are
    # budget.sinks, no recent window; tiny-qwen2 for GQA (the softmax averaged over a group)
    "expected_attention": Case(
        "ExpectedAttentionPress",
        {"n_sink": 4, "epsilon": 0.02},
        {
            "budget": {"tokens": 24, "window": 0, "sinks": 4},
            "importance": {"expected": {"name": "expected_attention", "epsilon": 0.02}},
        },
        24,
        model="tiny-qwen2",
        forward=True,
    ),
    "expected_attention_mean": Case(
        "ExpectedAttentionPress",
        {"n_sink": 2, "n_future_positions": 64, "use_covariance": False, "use_vnorm": False},
        {
            "budget": {"tokens": 30, "window": 0, "sinks": 2},
            "importance": {
                "expected": {
                    "name": "expected_attention",
                    "n_future_positions": 64,
                    "use_covariance": False,
                    "use_vnorm": False,
                    "epsilon": 0.0,
                }
            },
        },
        30,
        forward=True,
    ),
    # CapPress (CAPKV) with the reference's settings (4 sinks, tau 5, 512 future positions, epsilon
    # 1e-6): the sinks are budget.sinks, no recent window (kvpress has none); tiny-qwen2 for GQA (the
    # scores of a group's query heads averaged); tiny-llama with other settings of every parameter
    "capkv": Case(
        "CapPress",
        {"n_sink": 4},
        {"budget": {"tokens": 24, "window": 0, "sinks": 4}, "importance": {"capkv": {}}},
        24,
        model="tiny-qwen2",
        forward=True,
    ),
    "capkv_llama": Case(
        "CapPress",
        {"n_sink": 2, "tau": 2.0, "n_future_positions": 64, "epsilon": 1e-3},
        {
            "budget": {"tokens": 30, "window": 0, "sinks": 2},
            "importance": {"capkv": {"tau": 2.0, "n_future_positions": 64, "epsilon": 1e-3}},
        },
        30,
        forward=True,
    ),
    # TOVAPress scores the last token above every other: budget.window 1 (the preset's window 0 lets
    # it compete, as the paper: tests/compression/test_tova.py)
    "tova": Case(
        "TOVAPress",
        {},
        {"budget": {"tokens": 20, "window": 1}, "importance": {"attention": {"name": "tova"}}},
        20,
        model="tiny-qwen2",
        forward=True,
    ),
    "tova_llama": Case(
        "TOVAPress",
        {},
        {"budget": {"tokens": 33, "window": 1}, "importance": {"attention": {"name": "tova"}}},
        33,
        forward=True,
    ),
    # CriticalKVPress around SnapKVPress (window 8, kernel 5) on uniform head budgets: kvpress's
    # stage one is int(0.5 * 27.5) = 13 of the 27 with the window's 8 inside, so 5 by attention;
    # kvlab's is floor(share * 19) of the 19 beyond the window: share 0.3 gives the same 5 (the
    # preset's 0.5 gives 9)
    "criticalkv": Case(
        "CriticalKVPress",
        {"epsilon": 1e-4, "first_stage_ratio": 0.5},
        {
            "preset": "criticalkv",
            "budget": {"tokens": 27, "window": 8},
            "allocate": {"head": {"name": "uniform"}},
            "select": {"share": 0.3},
        },
        27,
        wraps="SnapKVPress",
        wraps_args={"window_size": 8, "kernel_size": 5},
        model="tiny-qwen2",
        forward=True,
    ),
    # CriticalAdaKVPress around SnapKVPress (window 8): the criticalkv preset (AdaKV head budgets,
    # alpha 0.2, share 0.5) with that window; kvpress's stage one counts the window in (see
    # tests/compression/test_criticalkv.py for what matches and what does not)
    "criticalkv_ada": Case(
        "CriticalAdaKVPress",
        {"alpha_safeguard": 0.2, "epsilon": 1e-4, "first_stage_ratio": 0.5},
        {"preset": "criticalkv", "budget": {"tokens": 27, "window": 8}},
        27,
        wraps="SnapKVPress",
        wraps_args={"window_size": 8, "kernel_size": 5},
        model="tiny-qwen2",
        forward=True,
    ),
    "criticalkv_ada_llama": Case(
        "CriticalAdaKVPress",
        {"alpha_safeguard": 0.2, "epsilon": 1e-4, "first_stage_ratio": 0.5},
        {"preset": "criticalkv", "budget": {"tokens": 30, "window": 8}},
        30,
        wraps="SnapKVPress",
        wraps_args={"window_size": 8, "kernel_size": 5},
        forward=True,
    ),
    # ThinKPress alone (every position kept): half of each head's key channels by the window's 8
    # queries and every key; kvlab's ThinK over the full cache, with its own window
    "think": Case(
        "ThinKPress",
        {"key_channel_compression_ratio": 0.5, "window_size": 8},
        {"channels": {"name": "think", "keep": 0.5, "window": 8}},
        LENGTH,
        model="tiny-qwen2",
        forward=True,
        channels=True,
    ),
    # ThinKPress composed after SnapKVPress (window 8, kernel 5, the same window for both), as the
    # kvpress docstring composes them: ThinK scores the keys SnapKV kept; kvlab's think preset (ThinK
    # over the snapkv preset) with that window; 0.25 of the channels pruned
    "think_snapkv": Case(
        "ComposedPress",
        {
            "presses": [
                ["SnapKVPress", {"compression_ratio": 0.5, "window_size": 8, "kernel_size": 5}],
                ["ThinKPress", {"key_channel_compression_ratio": 0.25, "window_size": 8}],
            ]
        },
        {"preset": "think", "budget": {"tokens": 27, "window": 8}, "channels": {"keep": 0.75}},
        27,
        model="tiny-qwen2",
        forward=True,
        channels=True,
    ),
    # LeverageScorePress with its defaults (a sketch of 48 columns): kvpress draws it unseeded, and its
    # ridge (the Cholesky jitter 1e-2) makes the scores depend on the draw even with more columns than
    # the 16 of a head, so the recording hands it kvlab's seeded sketch (gaussian_sketch, seed 0); no
    # sinks, no recent window, as kvpress's ScorerPress
    "leverage": Case(
        "LeverageScorePress",
        {},
        {"budget": {"tokens": 20, "window": 0}, "importance": {"leverage": {}}},
        20,
        forward=True,
        sketch=True,
    ),
    "leverage_qwen2": Case(
        "LeverageScorePress",
        {"sketch_dimension": 12},
        {"budget": {"tokens": 31, "window": 0}, "importance": {"leverage": {"sketch_dimension": 12}}},
        31,
        model="tiny-qwen2",
        forward=True,
        sketch=True,
    ),
    # DMSPress around KnormPress (its prefill; decoding=False, kvpress's default): every position
    # before the last sliding_window_size = 8 whose score -||k|| is below -0.65 (about 4 in 10 of
    # the tiny models' keys) is evicted; kvlab's threshold selector on key_norm, with the window as
    # budget.window and the whole prompt as the budget (DMS has none)
    "dms": Case(
        "DMSPress",
        {"threshold": -0.65, "sliding_window_size": 8},
        {
            "budget": {"ratio": 1.0, "window": 8},
            "importance": {"key_norm": {}},
            "select": {"name": "threshold", "threshold": -0.65},
        },
        LENGTH,
        wraps="KnormPress",
        ratio=0.0,
        forward=True,
    ),
    "dms_qwen2": Case(
        "DMSPress",
        {"threshold": -0.6, "sliding_window_size": 16},
        {
            "budget": {"ratio": 1.0, "window": 16},
            "importance": {"key_norm": {}},
            "select": {"name": "threshold", "threshold": -0.6},
        },
        LENGTH,
        wraps="KnormPress",
        ratio=0.0,
        model="tiny-qwen2",
        forward=True,
    ),
    # PerLayerCompressionPress around KnormPress: each layer at its own compression ratio, kvlab's
    # per_layer ratios are the kept shares 1 - cr of the whole prompt (budget ratio 1.0); no window
    "per_layer": Case(
        "PerLayerCompressionPress",
        {"compression_ratios": [0.3, 0.65]},
        {
            "budget": {"ratio": 1.0, "window": 0},
            "importance": {"key_norm": {}},
            "allocate": {"layer": {"name": "per_layer", "ratios": [0.7, 0.35]}},
        },
        LENGTH,
        wraps="KnormPress",
        ratio=0.0,
        forward=True,
    ),
    "per_layer_qwen2": Case(
        "PerLayerCompressionPress",
        {"compression_ratios": [0.75, 0.5, 0.15]},
        {
            "budget": {"ratio": 1.0, "window": 0},
            "importance": {"key_norm": {}},
            "allocate": {"layer": {"name": "per_layer", "ratios": [0.25, 0.5, 0.85]}},
        },
        LENGTH,
        wraps="KnormPress",
        ratio=0.0,
        model="tiny-qwen2",
        forward=True,
    ),
}


#: KVzipPress (layerwise: the heads of a layer compete, as the kvzip preset's AdaKV at alpha 0) keeps
#: ``Hkv T - int(Hkv T ratio)`` entries per layer: the ratios keep 27 per head on average
for _name, _model, _heads, _chunk in [
    ("kvzip", "tiny-qwen2", 2, 2048),
    ("kvzip_chunked", "tiny-qwen2", 2, 16),
    ("kvzip_llama_chunked", "tiny-llama", 4, 16),
]:
    CASES[_name] = Case(
        "KVzipPress",
        {"layerwise": True, "n_sink": 4, "chunk_size": _chunk},
        {"preset": "kvzip", "budget": {"ratio": None, "tokens": 27}, "prefill": {"chunk": _chunk}},
        27,
        ratio=(_heads * (LENGTH - 27) + 0.5) / (_heads * LENGTH),
        model=_model,
        forward=True,
        tokenizer=True,
    )


def prompt_ids(vocab_size: int) -> torch.Tensor:
    """``[1, LENGTH]``: the seeded prompt, token ids drawn uniformly below ``vocab_size``."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab_size, (1, LENGTH), generator=gen)


def prompt_states(model: str = MODEL) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)`` ``[1, Hkv, LENGTH, D]`` fp32 of the seeded prompt."""
    loaded = load_model(model)
    ids = prompt_ids(loaded.model.config.vocab_size)
    cache = DynamicCache(config=loaded.model.config)
    with torch.no_grad():
        loaded.model(input_ids=ids, cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def kvlab_kept(case: Case, states: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[list[int]]]:
    """kvlab's kept positions ``[layer][head][kept]`` for ``case`` (keys and values only: the
    queries are zeros, which these components do not read)."""
    pipeline = Pipeline.from_config(case.kvlab)
    kept = []
    for layer, (keys, values) in enumerate(states):
        B, Hkv, T, D = keys.shape
        ctx = LayerContext(
            layer_idx=layer,
            num_layers=len(states),
            queries=torch.zeros(B, Hkv, T, D),
            keys=keys,
            values=values,
            valid=torch.ones(B, T, dtype=torch.bool),
            modality=torch.zeros(B, T, dtype=torch.long),
            scaling=D**-0.5,
        )
        selection, _ = pipeline.compress(ctx)
        kept.append([selection.kept_positions(0, h) for h in range(Hkv)])
    return kept


def compression_node(case: Case) -> dict[str, Any]:
    """``case.kvlab``, a ``preset`` key resolved to that preset's compression node with the case's
    other fields merged in."""
    node = dict(case.kvlab)
    preset = node.pop("preset", None)
    if preset is None:
        return node
    return merge(resolve([preset], [])["model"]["compression"], node)


def kvlab_prefill_kept(case: Case, node: dict[str, Any] | None = None) -> list[list[list[int]]]:
    """kvlab's kept positions ``[layer][head][kept]`` after its prefill of the prompt on
    ``case.model`` (its attention routed through kvlab) with ``node`` (default
    :func:`compression_node` of ``case``)."""
    loaded = kvlab_model(case.model)
    if case.tokenizer:
        loaded = dataclasses.replace(loaded, processor=loaded.processor.with_chat_template("none"))
    ids = prompt_ids(loaded.model.config.vocab_size)
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), modality=torch.zeros_like(ids))
    pipeline = Pipeline.from_config(compression_node(case) if node is None else node)
    reports = prefill(loaded, pipeline, batch, decode_capacity=1).session.reports
    heads = range(loaded.info.num_kv_heads)
    return [[report.selection.kept_positions(0, h) for h in heads] for report in reports]


def kvlab_prefill_channels(case: Case) -> list[list[list[int]]]:
    """kvlab's kept key channels ``[layer][head][channels]`` after its prefill of the prompt on
    ``case.model`` with :func:`compression_node` of ``case`` (what each layer's cache stores)."""
    loaded = kvlab_model(case.model)
    ids = prompt_ids(loaded.model.config.vocab_size)
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), modality=torch.zeros_like(ids))
    state = prefill(loaded, Pipeline.from_config(compression_node(case)), batch, decode_capacity=1)
    return [layer.key_channels[0].tolist() for layer in state.cache.layers]


def jaccard(a: list[int], b: list[int]) -> float:
    """``|a & b| / |a | b|`` of two position lists."""
    return len(set(a) & set(b)) / len(set(a) | set(b))


def recorded() -> dict[str, Any]:
    return json.loads(RECORD.read_text())

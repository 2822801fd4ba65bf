"""kvpress's kept positions on a tiny model, the cases of ``tests/fixtures/kvpress/kept.json``.

One prompt of seeded random token ids through the plain model (its own attention, no kvlab): each
layer's keys and values ``[1, Hkv, T, D]`` (post-RoPE, as both frameworks see them). Each case
names a kvpress press with its arguments and the kvlab ``model.compression`` that should keep the
same positions; ``tests/fixtures/kvpress/make_kept.py`` records kvpress's, run in a separate
environment holding kvpress (its versions are in the file), and the method tests compare kvlab's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvlab.compression.context import LayerContext
from kvlab.models import load_model
from kvlab.pipeline import Pipeline
from support.paths import FIXTURES

RECORD = FIXTURES / "kvpress" / "kept.json"
MODEL = "tiny-llama"
LENGTH = 55  # 4 sinks + 6 partitions of 8 + 3: LagKV scores 5 partitions, its tail is 11 tokens
SEED = 0


@dataclass(frozen=True)
class Case:
    """A kvpress press (class name in ``kvpress``, its arguments) and the kvlab compression node
    expected to keep the same ``kept`` positions per head."""

    press: str
    args: dict[str, Any]
    kvlab: dict[str, Any]
    kept: int
    wraps: str | None = None  # the ScorerPress a wrapping press (ChunkKVPress) scores with
    ratio: float | None = None  # the compression ratio, when it is not ``ratio_for(kept)``


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
}


def prompt_states(model: str = MODEL) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)`` ``[1, Hkv, LENGTH, D]`` fp32 of the seeded prompt."""
    loaded = load_model(model)
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, LENGTH), generator=gen)
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


def recorded() -> dict[str, Any]:
    return json.loads(RECORD.read_text())

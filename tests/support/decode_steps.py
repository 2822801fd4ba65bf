"""Decode-time policies driven step by step on one hand-made compressed layer, without a model: what
the naive list simulations of TOVA and R-KV are compared with (tests/compression/test_tova.py,
test_rkv.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.cache.cache import CompressedCache
from kvlab.cache.layer import CompressedLayer
from kvlab.cache.selection import Selection
from kvlab.cache.state import RunState
from kvlab.compression.decode import DecodePolicy
from kvlab.engine.attention import kvlab_attention
from kvlab.engine.session import CompressionSession, compression_session


@dataclass
class SteppedLayer:
    """One layer whose prompt ``keys`` / ``values`` ``[B, Hkv, T, D]`` were compressed to ``counts``
    (per sample, per KV head, the kept positions), and what each decode step fed and produced."""

    counts: list[list[list[int]]]
    keys: torch.Tensor
    values: torch.Tensor
    run: RunState
    layer: CompressedLayer
    indices: torch.Tensor  # [B, Hkv, K] kept positions, padded with 0
    queries: list[torch.Tensor] = field(default_factory=list)  # per step [B, H, 1, D]
    new_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per step [B, Hkv, 1, D]
    outputs: list[torch.Tensor] = field(default_factory=list)  # per step [B, H, 1, D]
    sizes: list[torch.Tensor] = field(default_factory=list)  # per step [B, Hkv] entries held

    def naive_inputs(self) -> tuple[dict, list, list]:
        """The list simulation's inputs, in float64: entries ``{(b, h): [[position, key, value], ...]}``,
        the step queries ``[B][H][D]`` and the step ``(keys, values)`` ``[B][Hkv][D]``."""
        k64, v64 = self.keys.double().tolist(), self.values.double().tolist()
        B, Hkv = self.keys.shape[:2]
        entries = {
            (b, h): [[p, k64[b][h][p], v64[b][h][p]] for p in self.counts[b][h]]
            for b in range(B)
            for h in range(Hkv)
        }
        queries = [q[:, :, 0].double().tolist() for q in self.queries]
        new = [(k[:, :, 0].double().tolist(), v[:, :, 0].double().tolist()) for k, v in self.new_kv]
        return entries, queries, new


def compressed_layer(counts: list[list[list[int]]], T: int, D: int, gen: torch.Generator) -> SteppedLayer:
    """A one-layer cache holding random ``[B, Hkv, T, D]`` keys and values compressed to ``counts``,
    with room to grow while decoding."""
    B, Hkv = len(counts), len(counts[0])
    keys, values = torch.randn(B, Hkv, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)
    K = max(len(c) for row in counts for c in row)
    indices = torch.tensor([[c + [0] * (K - len(c)) for c in row] for row in counts])
    lengths = torch.tensor([[len(c) for c in row] for row in counts])
    cache = CompressedCache(num_layers=1, decode_capacity=2)  # grows while decoding
    layer = cache.layers[0]
    layer.update(keys, values)
    layer.compress(Selection(indices=indices, counts=lengths))
    run = RunState(cache=cache, valid=torch.ones(B, T, dtype=torch.bool), modality=torch.zeros(B, T))
    return SteppedLayer(counts, keys, values, run, layer, indices)


def decode_steps(state: SteppedLayer, policy: DecodePolicy, steps: int, G: int, gen: torch.Generator) -> None:
    """Feed ``steps`` random decode steps (queries scaled by 2: peaked attention) through kvlab's
    attention with ``policy`` started on ``state``'s run; record outputs and sizes after each step."""
    B, Hkv, _, D = state.keys.shape
    session = CompressionSession(state.run, pipeline=None)
    policy.start(state.run)
    attention = torch.nn.Module()
    attention.layer_idx = 0
    state.queries = [torch.randn(B, Hkv * G, 1, D, generator=gen) * 2 for _ in range(steps)]
    state.new_kv = [
        (torch.randn(B, Hkv, 1, D, generator=gen), torch.randn(B, Hkv, 1, D, generator=gen))
        for _ in range(steps)
    ]
    for step in range(steps):
        state.layer.update(*state.new_kv[step])
        with compression_session(session):
            out, _ = kvlab_attention(attention, state.queries[step], *state.new_kv[step], None, D**-0.5)
        state.outputs.append(out.transpose(1, 2))
        policy.after_step(state.run, step)
        state.sizes.append(state.layer.slot_valid().sum(-1))

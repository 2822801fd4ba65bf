"""Long prompts without quadratic memory, and scores reduced in fp32.

- Prefill attention (padded batches, sliding windows, soft-capping, sinks, chunks of a prompt)
  equals a naive per-row attention, and never creates a ``T x T`` tensor: every op of a padded
  tiny-qwen2 prefill is watched with a dispatch mode.
- The torch references of the scores (window attention, accumulated attention) work in bounded
  blocks and equal their one-block results.
- A padded batch of 4 long prompts prefills under a ceiling linear in T (process RSS high-water
  mark, measured in a fresh process by ``kvlab bench memory --prefill``'s measuring function).
- Every scorer computes in fp32: 16-bit inputs give the scores of their fp32 upcast, and a bf16
  rounding tie does not decide which token is kept.
"""

from __future__ import annotations

import math

import pytest
import torch
from naive.context import LENGTHS, make_ctx
from torch.utils._python_dispatch import TorchDispatchMode

import kvlab
from kvlab.cache.options import AttentionOptions
from kvlab.compression.context import LayerContext, QuestionView
from kvlab.compression.diversity import DIVERSITY
from kvlab.compression.importance import IMPORTANCE
from kvlab.compression.reconstruction import ReconstructionStep
from kvlab.compression.selectors import topk_indices
from kvlab.config.artefacts import Artefact, UsesArtefact
from kvlab.config.errors import ConfigError
from kvlab.engine.generation import RunOptions
from kvlab.engine.prefill_attention import prefill_attention
from kvlab.kernels.window_scores import window_attention_scores_reference

# ---------------------------------------------------------------------------------------------
# prefill attention against a naive per-row attention


def naive_attention(query, key, value, valid, scaling, options: AttentionOptions):
    """Dense float64 attention with the mask written out key by key, for query ``i`` at position
    ``k - q + i``: earlier valid keys (within the window), and itself when it is padding."""
    B, H, q, _ = query.shape
    k, groups = key.shape[2], H // key.shape[1]
    allowed = torch.zeros(B, q, k, dtype=torch.bool)
    for b in range(B):
        for i in range(q):
            pos = k - q + i
            for j in range(pos + 1):
                inside = options.sliding_window is None or j > pos - options.sliding_window
                allowed[b, i, j] = (bool(valid[b, j]) and inside) or (j == pos and not valid[b, pos])
    keys = key.double().repeat_interleave(groups, 1)
    logits = query.double() @ keys.transpose(-1, -2) * scaling  # [B, H, q, k]
    if options.softcap is not None:
        logits = torch.tanh(logits / options.softcap) * options.softcap
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    if options.sinks is not None:
        logits = torch.cat([logits, options.sinks.double().view(1, H, 1, 1).expand(B, H, q, 1)], -1)
    probs = torch.softmax(logits, -1)[..., :k]
    return probs @ value.double().repeat_interleave(groups, 1)


SINKS = torch.linspace(-1.0, 1.5, 4)
VARIANTS = {
    "plain": AttentionOptions(),
    "window": AttentionOptions(sliding_window=5),
    "softcap": AttentionOptions(softcap=2.0),
    "sinks": AttentionOptions(sinks=SINKS),
    "all": AttentionOptions(sliding_window=4, softcap=1.5, sinks=SINKS),
}


def padded_inputs(lengths, T, heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    valid = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, T - n :] = True
    q = torch.randn(len(lengths), heads, T, dim, generator=gen)
    k = torch.randn(len(lengths), kv_heads, T, dim, generator=gen)
    v = torch.randn(len(lengths), kv_heads, T, dim, generator=gen)
    return q, k, v, valid


@pytest.mark.parametrize("queries", [29, 9, 1])  # the whole prompt, a chunk, one query
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_attention_matches_naive_attention(variant, queries):
    """Padded (and one empty) samples, GQA, whole prompts and chunks; blocks of 1 row, 2 rows, all."""
    q, k, v, valid = padded_inputs([29, 17, 0], 29)
    options = VARIANTS[variant]
    wanted = naive_attention(q[:, :, -queries:], k, v, valid, 0.4, options)
    for block in (None, 2 * 4 * 3 * 29, 1):
        got = prefill_attention(q[:, :, -queries:], k, v, valid, 0.4, options, block_elements=block)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), wanted, atol=1e-5, rtol=1e-5)
    unpadded = naive_attention(q[:, :, -queries:], k, v, torch.ones_like(valid), 0.4, options)
    got = prefill_attention(q[:, :, -queries:], k, v, torch.ones_like(valid), 0.4, options)
    torch.testing.assert_close(got.double(), unpadded, atol=1e-5, rtol=1e-5)


def test_padding_rows_are_their_own_values_without_sinks():
    """A padding query sees only itself: its own value (with sinks, a share of it)."""
    q, k, v, valid = padded_inputs([11, 6], 11)
    for options in (VARIANTS["plain"], VARIANTS["window"], VARIANTS["softcap"]):
        out = prefill_attention(q, k, v, valid, 0.3, options)
        assert torch.equal(out[1, :, :5], v[1, :, :5].repeat_interleave(2, dim=0))


def test_right_padding_takes_the_blocked_path_and_stays_exact():
    """Valid tokens that are not a suffix (not a left-padded batch) are masked all the same (a
    padding query then also sees the valid keys before it, as before: its output is never used)."""
    q, k, v, _ = padded_inputs([13, 13], 13)
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, 9:] = False
    wanted = naive_attention(q, k, v, valid, 0.3, AttentionOptions())
    torch.testing.assert_close(prefill_attention(q, k, v, valid, 0.3).double(), wanted, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# no T x T tensor anywhere in a prefill


class SquareWatch(TorchDispatchMode):
    """Records every tensor an op returns with two dimensions of at least ``size`` (a ``T x T``
    mask, logits or probabilities of the whole prompt would have them)."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.found, self.shapes = size, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.shapes.add(tuple(tensor.shape))
                if sum(d >= self.size for d in tensor.shape) >= 2:
                    self.found.append((str(func), tuple(tensor.shape)))
        return out


#: blocks of 2**14 elements (8 query rows of 2 samples x 4 heads x 256 keys)
SMALL_BLOCKS = 1 << 14


@pytest.mark.parametrize("preset, chunk", [("snapkv", None), ("h2o", None), ("mixkv_adakv", 96)])
def test_no_op_of_a_padded_prefill_creates_a_t_by_t_tensor(preset, chunk):
    """Attention, scores (window and accumulated attention), selection: nothing is ``T x T``; the
    largest tensors are O(T) (hidden states, MLP, one layer's K/V)."""
    from kvlab.bench.memory import padded_batch
    from kvlab.engine.generation import prefill

    loaded = kvlab.load_model("tiny-qwen2")
    T = 256
    batch = padded_batch(loaded, [T, 170])
    pipeline = kvlab.load_pipeline(preset, {"budget.tokens": 48})
    with SquareWatch(T * 3 // 4) as watch:
        state = prefill(
            loaded, pipeline, batch, 1, RunOptions(prefill_chunk=chunk), block_elements=SMALL_BLOCKS
        )
    assert int(state.cache.kept_tokens().sum()) == 3 * 2 * 2 * 48  # layers x samples x KV heads x budget
    assert watch.found == []


@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "sinks", "all"])
def test_no_t_by_t_tensor_for_windows_softcapping_and_sinks(variant):
    q, k, v, valid = padded_inputs([256, 150], 256)
    with SquareWatch(192) as watch:
        prefill_attention(q, k, v, valid, 0.3, VARIANTS[variant], block_elements=1 << 15)
        prefill_attention(q[:, :, -100:], k, v, valid, 0.3, VARIANTS[variant], block_elements=1 << 15)
    assert watch.found == []


# ---------------------------------------------------------------------------------------------
# bounded blocks in the score references


def test_window_score_reference_blocks_equal_one_block():
    q, k, _, valid = padded_inputs([50, 30, 4], 50, heads=6, kv_heads=2)
    window = q[:, :, -7:]
    whole = window_attention_scores_reference(window, k, valid, 0.4, block_elements=1 << 30)
    assert torch.equal(window_attention_scores_reference(window, k, valid, 0.4), whole)  # fits one block
    for block in (1, 49, 50, 7 * 50, 7 * 50 * 3, 7 * 50 * 3 * 2 + 1):  # rows, heads, pairs of blocks
        got = window_attention_scores_reference(window, k, valid, 0.4, block_elements=block)
        torch.testing.assert_close(got, whole, atol=1e-6, rtol=1e-6)


def test_cumulative_attention_blocks_bounded():
    ctx = make_ctx(LENGTHS, seed=3)
    whole = ctx.cumulative_attention()
    blocked = make_ctx(LENGTHS, seed=3)
    blocked.block_elements = 2 * 4 * 3 * ctx.seq_len  # 3 rows of [B, H, rows, T] at a time
    with SquareWatch(ctx.seq_len) as watch:
        got = blocked.cumulative_attention()
    torch.testing.assert_close(got, whole, atol=1e-6, rtol=1e-6)
    blocks = [s for s in watch.shapes if len(s) == 4 and s[:2] == (2, 4) and s[-1] == ctx.seq_len]
    assert blocks and max(shape[2] for shape in blocks) == 3  # [B, H, rows, T] probabilities, 3 rows


# ---------------------------------------------------------------------------------------------
# peak memory of a padded batch of 4 long prompts, in a fresh process


def linear_ceiling(info, lengths: list[int], window: int) -> int:
    """Bytes a prefill may add to the process: linear in B x T, with a 2x margin, plus 32 MiB.

    Per padded token of each sample, fp32: the residual stream, the normed and attention-output
    states (3 x hidden), queries/keys/values ((H + 2 Hkv) x D), the MLP's gate, up and activation
    (3 x intermediate), the dense K/V of one layer in the cache (2 Hkv x D) and the window
    scores' probabilities (H x W, the block of the torch reference).
    """
    hidden, intermediate = 64, 128  # tiny-qwen2 (kvlab/models/scaffolding/tiny.py)
    H, Hkv, D = info.num_heads, info.num_kv_heads, info.head_dim
    per_token = 3 * hidden + (H + 2 * Hkv) * D + 3 * intermediate + 2 * Hkv * D + H * window
    return 2 * 4 * len(lengths) * max(lengths) * per_token + (32 << 20)


def test_padded_batch_of_four_long_prompts_prefills_under_a_linear_ceiling():
    """Process RSS high-water mark (reset before the prefill) of 4 prompts of 4096..2560 tokens.

    Sound in a process that ran other tests: memory the allocator kept from them can only hide
    small allocations, while a quadratic prefill's tensors (a [4, 4096, 4096] mask is 64 MiB) are
    above glibc's largest mmap threshold (32 MiB) and always come as new pages.
    """
    from kvlab.bench.memory import measure_prefill, padded_lengths

    T, batch = 4096, 4
    loaded = kvlab.load_model("tiny-qwen2")
    lengths = padded_lengths(T, batch, 0.125)
    assert lengths == [4096, 3584, 3072, 2560]
    point = measure_prefill(loaded, kvlab.load_pipeline("snapkv"), lengths)
    if not point["reset"]:
        pytest.skip("the kernel cannot reset the RSS high-water mark (/proc/self/clear_refs)")
    ceiling = linear_ceiling(loaded.info, lengths, window=32)
    growth = point["peak"] - point["rss_before"]
    assert growth <= ceiling, (growth / 2**20, ceiling / 2**20)
    # a quadratic prefill cannot pass: one [B, T, T] bool mask and its fp32 copy are 5 x B x T^2 bytes
    assert ceiling < 5 * batch * T * T / 2


# ---------------------------------------------------------------------------------------------
# fp32 reductions


def bf16_ctx(window: int = 6) -> tuple[LayerContext, LayerContext]:
    """A left-padded bf16 context and the same inputs upcast to fp32 (bf16 -> fp32 is exact)."""
    ctx = make_ctx(LENGTHS, seed=5)
    # a 3-token question (Finch's scorer reads it): the last queries and keys, in bf16
    asked = QuestionView(
        ctx.queries[:, :, -3:].bfloat16(), ctx.keys[:, :, -3:].bfloat16(), torch.ones(2, 3, dtype=torch.bool)
    )
    low = LayerContext(
        0, 4, ctx.queries.bfloat16(), ctx.keys.bfloat16(), ctx.values.bfloat16(), ctx.valid,
        ctx.modality, ctx.scaling, window=torch.full((2,), window), question=asked,
    )  # fmt: skip
    up = LayerContext(
        0, 4, low.queries.float(), low.keys.float(), low.values.float(), ctx.valid, ctx.modality,
        ctx.scaling, window=low.window,
        question=QuestionView(asked.queries.float(), asked.keys.float(), asked.valid),
    )  # fmt: skip
    return low, up


def reconstruction_step(ctx: LayerContext) -> ReconstructionStep:
    """A reconstruction step of layer 0 whose block is ``ctx``'s last 3 queries and keys, scoring
    every real prompt entry of ``ctx`` (in ``ctx``'s dtype)."""
    B, T = ctx.valid.shape
    return ReconstructionStep(
        layer_idx=0, queries=ctx.queries[:, :, -3:], block_keys=ctx.keys[:, :, -3:],
        block_valid=torch.ones(B, 3, dtype=torch.bool), keys=ctx.keys, values=ctx.values,
        entry_valid=ctx.valid, columns=torch.arange(T).expand(B, T), scored=ctx.valid, seq_len=T,
        scaling=ctx.scaling,
    )  # fmt: skip


#: the tensors of a random artefact for each scorer that reads one, from (layers, KV heads, head dim)
SCORER_ARTEFACTS = {
    "qfilters": lambda L, Hkv, D: {"filters": torch.randn(L, Hkv, D), "explained": torch.ones(L, Hkv)},
}


@pytest.mark.parametrize("registry, name", [(IMPORTANCE, n) for n in IMPORTANCE.names()]
                         + [(DIVERSITY, n) for n in DIVERSITY.names()])  # fmt: skip
def test_every_scorer_reduces_in_fp32(registry, name, tmp_path):
    """bf16 keys, values and queries give fp32 scores equal to those of the fp32-upcast inputs:
    every reduction (norms, softmax, window sums, GQA, pooling, means) ran in fp32. A scorer that
    reads a calibration artefact gets a random one of the context's shape (:data:`SCORER_ARTEFACTS`)."""
    cls = registry.get(name)
    node: dict = {"name": name}
    low, up = bf16_ctx()
    if issubclass(cls, UsesArtefact):
        assert name in SCORER_ARTEFACTS, f"{name} reads an artefact: add its tensors to SCORER_ARTEFACTS"
        tensors = SCORER_ARTEFACTS[name](low.num_layers, low.num_kv_heads, low.keys.shape[-1])
        shape = (low.num_layers, low.num_heads, low.num_kv_heads)
        artefact = Artefact(cls.artefact_kind, "toy", *shape, tensors)
        node["artefact"] = str(artefact.save(tmp_path / f"{name}.safetensors"))
    if "window" in cls.budget_settings:
        node["window"] = 6
    if "layer" in cls.layer_allocator_settings:
        node["layer"] = 1  # FastV's K, which its layer allocator restates
    scorer = registry.build(node)
    if scorer.capabilities.model_facts:  # a synthetic context has no model: tested through one
        pytest.skip(
            f"{name} reads model facts {scorer.capabilities.model_facts}: its own test runs it on a model"
        )
    if scorer.capabilities.reads_reconstruction:  # KVzip: its reductions run on a reconstruction step
        for ctx in (low, up):
            scorer.observe(reconstruction_step(ctx), ctx.run)
    got, wanted = scorer.score(low), scorer.score(up)
    assert got.dtype == torch.float32
    assert torch.equal(got, wanted)


def test_a_bf16_rounding_tie_does_not_decide_the_kept_token():
    """Value norms 1 and sqrt(1 + 2**-8): equal once rounded to bf16 (8 significant bits), so a
    bf16 reduction would tie and keep the earlier token; kvlab reduces in fp32 and keeps the larger."""
    values = torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16)
    values[0, 0, 0, 0] = 1.0
    values[0, 0, 1, 0], values[0, 0, 1, 1] = 1.0, 2**-4
    assert values.norm(dim=-1)[0, 0, 0] == values.norm(dim=-1)[0, 0, 1]  # the bf16 tie
    ctx = LayerContext(
        0, 1, torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16), torch.ones_like(values), values,
        torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.long), 1.0,
    )  # fmt: skip
    scores = IMPORTANCE.build({"name": "value_norm"}).score(ctx)
    assert scores.dtype == torch.float32 and scores[0, 0, 1] > scores[0, 0, 0]
    assert math.isclose(float(scores[0, 0, 1]), math.sqrt(1 + 2**-8), rel_tol=1e-6)
    keep_one = torch.ones(1, 1, dtype=torch.long)
    assert topk_indices(scores, keep_one).tolist() == [[[1]]]  # the bf16 scores would keep token 0
    assert topk_indices(values.norm(dim=-1), keep_one).tolist() == [[[0]]]


def test_gqa_reduction_and_pooling_upcast_16_bit_scores():
    from kvlab.compression.ops import pool_tokens, reduce_groups

    scores = torch.rand(2, 4, 9).bfloat16()
    for how in ("mean", "max", "sum"):
        assert torch.equal(reduce_groups(scores, 2, how), reduce_groups(scores.float(), 2, how))
    for pool in ("avg", "max", "none"):
        assert torch.equal(pool_tokens(scores, pool, 5), pool_tokens(scores.float(), pool, 5))


def test_context_helpers_say_which_queries_they_need():
    ctx = make_ctx(LENGTHS, seed=2)
    tail = LayerContext(
        0, 4, ctx.queries[:, :, -8:], ctx.keys, ctx.values, ctx.valid, ctx.modality, ctx.scaling,
        query_start=ctx.seq_len - 8,
    )  # fmt: skip
    torch.testing.assert_close(tail.window_attention_scores(8), ctx.window_attention_scores(8))
    torch.testing.assert_close(tail.window_attention(5), ctx.window_attention(5))
    with pytest.raises(ConfigError, match="holds only the last 8.*prefill_chunk"):
        tail.window_attention_scores(9)
    with pytest.raises(ConfigError, match="cumulative_attention"):
        tail.cumulative_attention()


def test_the_block_size_reaches_hybridkvs_classifier():
    """``block_elements`` reaches every attention helper, HybridKV's text-sparsity classifier
    included (it used to bind the default at import, so a smaller block never reached it)."""
    from kvlab.bench.memory import padded_batch
    from kvlab.engine.generation import prefill

    loaded = kvlab.load_model("tiny-qwen2")
    T = 256
    batch = padded_batch(loaded, [T, 170])
    pipeline = kvlab.load_pipeline("hybridkv", {"budget.tokens": 48})
    with SquareWatch(T * 3 // 4) as watch:
        prefill(loaded, pipeline, batch, decode_capacity=1, block_elements=SMALL_BLOCKS)
    assert watch.found == []
    with SquareWatch(T * 3 // 4) as default:  # the default block holds every query row at once
        prefill(loaded, pipeline, batch, decode_capacity=1)
    assert default.found

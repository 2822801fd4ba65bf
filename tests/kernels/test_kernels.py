"""Triton kernels against their torch references (interpreted on CPU, native on a GPU), dispatch.

tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU, so the ``*_triton`` launchers run
the real kernel code on CPU tensors. Shapes are small (the interpreter runs every program in
numpy) but cover GQA, odd head dims and lengths, several split-K chunks, padding, and a
(sample, head) with no kept prompt token. The cases and their inputs: tests/support/kernel_cases.py.
"""

import dataclasses
import functools

import pytest
import torch

pytest.importorskip("triton")

from naive.attention import naive_attention  # noqa: E402
from naive.quantization import naive_turbo_dequantize  # noqa: E402
from support.kernel_cases import (  # noqa: E402
    COMPACTION_CASES,
    CROWDED_CASES,
    CROWDED_MERGE,
    CROWDED_RUN,
    DECODE_CASES,
    DEVICE,
    GATHER_CASES,
    MERGE_CASES,
    PACKED_CASES,
    PAGE_CASES,
    PRUNED_CASES,
    REAL_DECODE,
    REAL_PACKED,
    REAL_PRUNED,
    REAL_WINDOW,
    ROTATED_CASES,
    TOPK_CASES,
    WINDOW_CASES,
    assert_close,
    compaction_inputs,
    gather_inputs,
    merge_case,
    merge_inputs,
    packed_inputs,
    page_inputs,
    rotated_case,
    run_crowded_merge,
    run_decode,
    run_gather,
    run_packed,
    run_page_topk,
    run_pruned,
    run_real_decode,
    run_real_packed,
    run_real_pruned,
    run_real_window,
    run_topk,
    run_window,
    topk_inputs,
    window_inputs,
)

from kvlab.cache.layer import CompressedLayer  # noqa: E402
from kvlab.cache.packed import PackedPrompt  # noqa: E402
from kvlab.cache.selection import Selection  # noqa: E402
from kvlab.compression.context import LayerContext  # noqa: E402
from kvlab.compression.quantizers import KIVI  # noqa: E402
from kvlab.compression.selectors import topk_indices  # noqa: E402
from kvlab.compression.turboquant import RotatedCodes, TurboQuant, turbo_quantize  # noqa: E402
from kvlab.config.errors import ConfigError  # noqa: E402
from kvlab.kernels import dispatch  # noqa: E402
from kvlab.kernels.compaction import compact_kv_reference  # noqa: E402
from kvlab.kernels.merge import merge_scatter, merge_scatter_reference  # noqa: E402
from kvlab.kernels.retrieval import (  # noqa: E402
    chunk_topk_reference,
    gather_chunks_reference,
    page_bounds_reference,
    page_topk,
    page_topk_reference,
)
from kvlab.kernels.tl.compaction import compact_kv_triton  # noqa: E402
from kvlab.kernels.tl.launches import record_launches  # noqa: E402
from kvlab.kernels.tl.merge import merge_scatter_triton  # noqa: E402
from kvlab.kernels.tl.packed_attention import packed_decode_attention_triton  # noqa: E402
from kvlab.kernels.tl.retrieval import (  # noqa: E402
    chunk_topk_triton,
    gather_chunks_triton,
    page_bounds_triton,
    page_topk_triton,
)
from kvlab.kernels.window_scores import window_attention_scores  # noqa: E402


@pytest.fixture(autouse=True)
def restore_mode():
    previous = dispatch.get_mode()
    yield
    dispatch.set_mode(previous)


@pytest.mark.parametrize("B, Hkv, G, q, D, max_len, split, dtype", DECODE_CASES)
def test_ragged_decode_attention_kernel_matches_reference(B, Hkv, G, q, D, max_len, split, dtype):
    got, want = run_decode(B, Hkv, G, q, D, max_len, split, dtype)
    assert got.dtype == dtype and got.shape == (B, Hkv * G, q, D)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("D, G, dtype, max_len, q", REAL_DECODE)
def test_ragged_decode_attention_at_real_model_shapes(D, G, dtype, max_len, q):
    got, want = run_real_decode(D, G, dtype, max_len, q)
    assert got.shape == (1, 2 * G, q, D)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("B, Hkv, G, q, D, max_len, split, dtype, quantizer", PACKED_CASES)
def test_packed_decode_kernel_matches_the_torch_path(B, Hkv, G, q, D, max_len, split, dtype, quantizer):
    got, want = run_packed(B, Hkv, G, q, D, max_len, split, dtype, quantizer)
    assert got.dtype == dtype and got.shape == (B, Hkv * G, q, D)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("D, G, dtype, max_len, quantizer", REAL_PACKED)
def test_packed_decode_kernel_at_real_model_shapes(D, G, dtype, max_len, quantizer):
    got, want = run_real_packed(D, G, dtype, max_len, quantizer)
    assert_close(got, want, dtype)


def naive_rows(codes: RotatedCodes) -> list[list[float]]:
    """Every row of TurboQuant ``codes`` dequantized by the naive loops, from their bytes."""

    def listed(t: torch.Tensor | None) -> list | None:
        return None if t is None else t.cpu().double().tolist() if t.is_floating_point() else t.cpu().tolist()

    tensors = (codes.codebook, codes.rotation, codes.norm, codes.signs, codes.gamma, codes.projection)
    return naive_turbo_dequantize(listed(codes.packed), codes.mse_bits, *map(listed, tensors))


def naive_packed_decode(inputs: dict, packed: PackedPrompt) -> torch.Tensor:
    """``[B, H, q, D]`` fp64: each query over its segment's body (naive dequantization), residual
    and the decode entries up to its own, by the naive attention of one query over lists."""
    query, scaling, t = inputs["query"].cpu().double(), inputs["scaling"], inputs["decode_length"]
    B, H, q, D = query.shape
    Hkv = packed.body_starts.shape[1]
    keys, values = naive_rows(packed.keys), naive_rows(packed.values)
    out = torch.zeros(B, H, q, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            start, length = int(packed.body_starts[b, h]), int(packed.body_lengths[b, h])
            body = slice(start, start + length)
            start, length = int(packed.residual_starts[b, h]), int(packed.residual_lengths[b, h])
            rest = slice(start, start + length)
            seg_k = keys[body] + packed.residual_keys[rest].cpu().double().tolist()
            seg_v = values[body] + packed.residual_values[rest].cpu().double().tolist()
            for head in range(h * (H // Hkv), (h + 1) * (H // Hkv)):
                for i in range(q):
                    seen = t - q + i + 1
                    dk = inputs["decode_keys"][b, h, :seen].cpu().double().tolist()
                    dv = inputs["decode_values"][b, h, :seen].cpu().double().tolist()
                    row = naive_attention(query[b, head, i].tolist(), seg_k + dk, seg_v + dv, scaling)
                    out[b, head, i] = torch.tensor(row, dtype=torch.float64)
    return out


@pytest.mark.parametrize("bits, sketch, dtype", ROTATED_CASES)
def test_turboquant_decode_kernel_matches_the_torch_path_and_naive_attention(bits, sketch, dtype):
    """The fused kernel over TurboQuant codes (query rotated once, codebook lookups per tile, the
    values' sum rotated back once) against the torch path (``dequantize_rows`` per chunk, then
    attention) and against a naive fp64 attention over the rows dequantized bit by bit from their
    bytes (Algorithms 1-2), 2-4 bits, keys with and without the QJL sketch."""
    case = rotated_case(bits, sketch, dtype)
    got, want = run_packed(*case)
    B, Hkv, G, q, D, max_len, _, _, name = case
    assert got.dtype == dtype and got.shape == (B, Hkv * G, q, D)
    assert_close(got, want, dtype)
    inputs, packed = packed_inputs(B, Hkv, G, q, D, max_len, dtype, name)
    assert packed.keys.mse_bits == bits - sketch and (packed.keys.signs is not None) == sketch
    assert int(packed.body_lengths.max()) > 0 and int(packed.body_lengths.min()) == 0  # ragged, one empty
    assert_close(got, naive_packed_decode(inputs, packed), dtype)


def test_packed_decode_kernel_refuses_codes_it_cannot_read_exactly():
    """Values with a QJL sketch (TurboQuant stores none: their ``S^T sign`` term has no
    rotated-basis accumulator) and keys and values of two kinds are refused, not approximated."""
    inputs, packed = packed_inputs(1, 2, 2, 1, 16, 40, torch.float32, "turbo3")
    body_values = packed.values.dequantize_rows(slice(0, int(packed.body_lengths.sum())))
    layout = (packed.body_starts, packed.body_lengths, packed.residual_keys, packed.residual_values,
              packed.residual_starts, packed.residual_lengths, inputs["decode_keys"], inputs["decode_values"],
              inputs["decode_length"], inputs["scaling"])  # fmt: skip
    sketched = turbo_quantize(body_values, 3, seed=3, sketch=True)
    with pytest.raises(ValueError, match="values carry no QJL sketch"):
        packed_decode_attention_triton(inputs["query"], packed.keys, sketched, *layout)
    uniform = KIVI(bits=2, group=1, residual=0).quantize_values(body_values)
    with pytest.raises(ValueError, match="both uniform or both TurboQuant"):
        packed_decode_attention_triton(inputs["query"], packed.keys, uniform, *layout)


@pytest.mark.parametrize("B, Hkv, G, q, D, Dk, max_len, split, dtype", PRUNED_CASES)
def test_pruned_decode_kernel_matches_the_torch_path(B, Hkv, G, q, D, Dk, max_len, split, dtype):
    got, want = run_pruned(B, Hkv, G, q, D, Dk, max_len, split, dtype)
    assert got.dtype == dtype and got.shape == (B, Hkv * G, q, D)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("D, Dk, G, dtype, max_len", REAL_PRUNED)
def test_pruned_decode_kernel_at_real_model_shapes(D, Dk, G, dtype, max_len):
    got, want = run_real_pruned(D, Dk, G, dtype, max_len)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("B, Hkv, G, W, T, D, split, dtype", WINDOW_CASES)
def test_window_scores_kernel_matches_reference(B, Hkv, G, W, T, D, split, dtype):
    got, want, valid = run_window(B, Hkv, G, W, T, D, split, dtype)
    assert got.dtype == torch.float32 and got.shape == (B, Hkv * G, T)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # every valid window query distributes exactly one unit of attention
    valid_queries = valid[:, T - W :].sum(-1).float()[:, None].expand(-1, Hkv * G)
    torch.testing.assert_close(got.sum(-1), valid_queries, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("D, G, dtype, W, T", REAL_WINDOW)
def test_window_scores_at_real_model_shapes(D, G, dtype, W, T):
    got, want, _ = run_real_window(D, G, dtype, W, T)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def layer_context(B=2, Hkv=2, G=2, T=23, D=8):
    gen = torch.Generator().manual_seed(3)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :5] = False
    return LayerContext(
        layer_idx=0,
        num_layers=1,
        queries=torch.randn(B, Hkv * G, T, D, generator=gen).to(DEVICE),
        keys=torch.randn(B, Hkv, T, D, generator=gen).to(DEVICE),
        values=torch.randn(B, Hkv, T, D, generator=gen).to(DEVICE),
        valid=valid.to(DEVICE),
        modality=torch.zeros(B, T, dtype=torch.long, device=DEVICE),
        scaling=D**-0.5,
    )


@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_context_window_scores_equal_summed_window_attention(mode):
    dispatch.set_mode(mode)
    ctx = layer_context()
    want = ctx.window_attention(6).sum(-2)
    got = ctx.window_attention_scores(6)
    if mode == "reference" and DEVICE == "cpu":  # on CUDA, cuBLAS may pick other kernels per shape
        assert torch.equal(got, want)  # the scorer's selections cannot change on the torch path
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ctx.window_attention_scores(6) is got  # memoised


def naive_compaction(keys, indices, counts):
    """Kept rows of every (b, h) concatenated by a Python loop over heads."""
    B, Hkv = counts.shape
    rows = [keys[b, h, indices[b, h, : int(counts[b, h])]] for b in range(B) for h in range(Hkv)]
    return torch.cat(rows)


@pytest.mark.parametrize("dtype, merged, D", COMPACTION_CASES)
def test_compaction_kernel_matches_reference_exactly(dtype, merged, D):
    keys, values, indices, counts = compaction_inputs(dtype, merged, D)
    got = compact_kv_triton(keys, values, indices, counts)
    want = compact_kv_reference(keys, values, indices, counts)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    B, Hkv, T = keys.shape[:3]
    positions = indices if indices is not None else torch.arange(T).expand(B, Hkv, T)
    assert torch.equal(want[0], naive_compaction(keys, positions, counts))
    assert torch.equal(want[1], naive_compaction(values, positions, counts))


@pytest.mark.parametrize("dtype, normalize, weighted", MERGE_CASES)
def test_merge_kernel_matches_reference(dtype, normalize, weighted):
    args = merge_case(dtype, normalize, weighted)
    got = merge_scatter_triton(*args)
    want = merge_scatter_reference(*args)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    if not weighted:
        assert torch.equal(got[-1], args[0][-1])  # a row no evicted entry merges into is unchanged


@pytest.mark.parametrize("dtype, normalize", CROWDED_CASES)
def test_merge_bounds_the_work_of_a_program_when_many_entries_merge_into_one(dtype, normalize):
    with record_launches() as launches:
        got, want, args = run_crowded_merge(dtype, normalize)
    assert_close(got, want, dtype)
    counts = torch.bincount(args[2], minlength=CROWDED_MERGE["N"])
    assert int(counts.max()) > 4 * CROWDED_RUN  # one serial program per row would sum them all
    # level 1: each row's run cut into pieces of <= 32; level 2: <= 32 pieces per kept row
    pieces = int((-(-counts // CROWDED_RUN)).sum())
    assert [launch.grid for launch in launches] == [(pieces,), (CROWDED_MERGE["N"],)]


@pytest.mark.parametrize("case", TOPK_CASES)
def test_chunk_topk_kernel_equals_the_reference(case):
    """The same chunk ids as the reference's stable sort (exact), ascending, -1 past each count."""
    inputs = topk_inputs(*case)
    want = chunk_topk_reference(*inputs)
    assert torch.equal(run_topk(*case), want)
    query, _, _, chunk_valid, n_sel, _ = inputs
    k = torch.minimum(n_sel[:, None], chunk_valid.sum(-1, keepdim=True))  # [R, 1]
    assert torch.equal((want >= 0).sum(-1), k.expand(-1, query.shape[2]))


@pytest.mark.parametrize("case", PAGE_CASES)
def test_page_topk_kernel_equals_the_reference(case):
    """Quest's page bounds and top-k: the same page ids as the torch path (exact), ascending, -1 past
    each count; through the dispatcher, ``kernels: triton`` runs the kernel."""
    inputs = page_inputs(*case)
    want = page_topk_reference(*inputs)
    assert torch.equal(run_page_topk(*case), want)
    query, _, _, chunk_valid, n_sel, _ = inputs
    k = torch.minimum(n_sel[:, None], chunk_valid.sum(-1, keepdim=True))  # [R, 1]
    assert torch.equal((want >= 0).sum(-1), k.expand(-1, query.shape[2]))
    dispatch.CALLS.clear()
    with dispatch.kernel_mode("triton"):
        assert torch.equal(page_topk(*inputs), want)
    assert dispatch.CALLS[("page_topk", "triton")] == 1


def test_page_bound_kernel_equals_the_reference_bounds():
    """The kernel's bounds themselves (not only the ranking) against the torch path, in fp32."""
    query, index, rows, chunk_valid, _, Hkv = page_inputs(2, 2, 2, 2, 24, 70, 3, torch.float32)
    got = page_bounds_triton(query, index, rows, chunk_valid, Hkv)
    want = page_bounds_reference(query, index, rows, chunk_valid, Hkv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", GATHER_CASES)
def test_gather_kernel_equals_the_reference(case):
    got, want = run_gather(*case), gather_chunks_reference(*gather_inputs(*case))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_retrieval_launches_do_not_recompile_with_chunk_counts_rows_queries_or_slots():
    """Launches that differ only in the chunk count, rows, queries per step, counts and slots have
    the same compile key (one compilation per head dim, group and dtype)."""

    def launches(B, q, NC, R, S, M):
        with record_launches(execute=False) as recorded:
            chunk_topk_triton(*topk_inputs(B, 2, 4, q, 64, NC, R, torch.bfloat16))
            page_topk_triton(*page_inputs(B, 2, 4, q, 64, NC, R, torch.bfloat16))
            gather_chunks_triton(*gather_inputs(R, q, S, M, 64, 8, torch.bfloat16))
        return recorded

    short, long = launches(1, 1, 9, 2, 3, 40), launches(3, 2, 500, 6, 60, 4000)
    assert [launch.grid for launch in short] != [launch.grid for launch in long]
    assert [launch.compile_key() for launch in short] == [launch.compile_key() for launch in long]
    assert {launch.kernel for launch in short} == {
        "_chunk_scores",
        "_page_bounds",
        "_chunk_select",
        "_gather_chunks",
    }


def test_merge_reference_gives_the_three_lookm_rules():
    """LOOK-M's rules are scatter_reduce(mean, include_self=True) of a rule-specific source."""
    kept, evicted, target = merge_inputs()
    sim = torch.rand(target.shape[0]) * 2 - 1  # cosine weights, negative allowed

    def lookm(source):
        index = target[:, None].expand_as(source)
        return kept.scatter_reduce(0, index, source, reduce="mean", include_self=True)

    pivot = (evicted + kept[target]) / 2
    torch.testing.assert_close(merge_scatter(kept, evicted, target), lookm(evicted))
    torch.testing.assert_close(merge_scatter(kept, pivot, target), lookm(pivot))
    weighted = merge_scatter(kept, evicted, target, evicted_weight=sim, normalize="count")
    torch.testing.assert_close(weighted, lookm(sim[:, None] * evicted))


def test_reference_mode_never_runs_triton(monkeypatch):
    import kvlab.kernels.tl.decode_attention as tl_decode

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel ran in reference mode")

    monkeypatch.setattr(tl_decode, "ragged_decode_attention_triton", boom)
    layer, query = decoded_layer()
    dispatch.CALLS.clear()
    dispatch.set_mode("reference")
    layer.decode_attention(query, 0.3)
    assert dispatch.CALLS == {("ragged_decode_attention", "reference"): 1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks Triton on CUDA tensors")
def test_auto_on_cpu_tensors_uses_the_references():
    """``auto`` with triton importable (and the interpreter on) still runs torch on CPU tensors."""
    assert dispatch.triton_available() and dispatch.interpreter()
    dispatch.CALLS.clear()
    dispatch.set_mode("auto")
    layer, query = decoded_layer()
    layer.decode_attention(query, 0.3)
    merge_scatter(*merge_inputs())
    queries, keys, valid = window_inputs(1, 1, 2, 4, 9, 8, torch.float32)
    window_attention_scores(queries, keys, valid, 0.3)
    assert dispatch.CALLS == {
        ("compact_kv", "reference"): 1,
        ("ragged_decode_attention", "reference"): 1,
        ("merge_scatter", "reference"): 1,
        ("window_attention_scores", "reference"): 1,
    }


@functools.cache
def _layer_inputs():
    gen = torch.Generator().manual_seed(0)
    B, Hkv, T, D = 2, 2, 30, 8
    keys, values = torch.randn(B, Hkv, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)
    counts = torch.tensor([[0, 9], [30, 4]])
    selection = Selection(indices=topk_indices(torch.rand(B, Hkv, T, generator=gen), counts), counts=counts)
    step = torch.randn(B, Hkv, 1, D, generator=gen), torch.randn(B, Hkv, 1, D, generator=gen)
    query = torch.randn(B, Hkv * 3, 1, D, generator=gen)

    def on(tensor):  # the kernels run natively on a GPU
        return tensor.to(DEVICE)

    selection = Selection(indices=on(selection.indices), counts=on(selection.counts))
    return on(keys), on(values), selection, (on(step[0]), on(step[1])), on(query)


def decoded_layer(quantizer=None, steps=1, channels=None):
    """A compressed layer (head (0, 0) keeps nothing) after ``steps`` decode steps, and its query;
    ``channels [B, Hkv, Dk]``: the key channels each head keeps (a channel-pruned layer)."""
    keys, values, selection, step, query = _layer_inputs()
    layer = CompressedLayer(decode_capacity=2)
    layer.update(keys, values)
    channels = channels.to(DEVICE) if channels is not None else None
    layer.compress(dataclasses.replace(selection, quantizer=quantizer, channels=channels))
    for _ in range(steps):
        layer.update(*step)
    return layer, query


def test_cache_decode_through_the_kernels_equals_the_reference_path():
    dispatch.set_mode("reference")
    reference_layer, query = decoded_layer()
    want = reference_layer.decode_attention(query, 0.3)
    dispatch.set_mode("triton")
    dispatch.CALLS.clear()
    layer, _ = decoded_layer()
    for name in ("prompt_keys", "prompt_values", "starts", "lengths"):
        assert torch.equal(getattr(layer, name), getattr(reference_layer, name))
    torch.testing.assert_close(layer.decode_attention(query, 0.3), want, atol=1e-5, rtol=1e-5)
    assert dispatch.CALLS == {("compact_kv", "triton"): 1, ("ragged_decode_attention", "triton"): 1}


@pytest.mark.parametrize(
    "quantizer, folded", [(KIVI(bits=2, group=4, residual=4), 4), (TurboQuant(bits=3, residual=2), 0)]
)
def test_quantized_cache_decode_runs_the_fused_kernel_under_triton_and_equals_the_torch_path(
    quantizer, folded
):
    """KIVI-2 with its residual folded in after 5 steps, TurboQuant-3: the layer's decode attention
    runs the fused kernel when the mode says triton (never the dequantized layout through the ragged
    kernel), and gives the torch path's result."""
    dispatch.set_mode("reference")
    reference_layer, query = decoded_layer(quantizer, steps=6)
    assert reference_layer.folded == folded
    want = reference_layer.decode_attention(query, 0.3)
    dispatch.set_mode("triton")
    layer, _ = decoded_layer(quantizer, steps=6)
    dispatch.CALLS.clear()
    torch.testing.assert_close(layer.decode_attention(query, 0.3), want, atol=1e-5, rtol=1e-5)
    assert dispatch.CALLS == {("packed_decode_attention", "triton"): 1}


def test_pruned_cache_decode_runs_the_pruned_kernel_under_triton_and_equals_the_torch_path():
    """Half the key channels of each head kept: under triton the layer's decode attention runs the
    pruned kernel (and the ragged kernel's partials over the decode region), as the torch path."""
    channels = torch.tensor([[[0, 2, 5, 7], [1, 2, 3, 4]], [[4, 5, 6, 7], [0, 1, 6, 7]]])
    dispatch.set_mode("reference")
    reference_layer, query = decoded_layer(steps=2, channels=channels)
    want = reference_layer.decode_attention(query, 0.3)
    dispatch.set_mode("triton")
    layer, _ = decoded_layer(steps=2, channels=channels)
    assert layer.prompt_keys.shape[1] == 4
    dispatch.CALLS.clear()
    torch.testing.assert_close(layer.decode_attention(query, 0.3), want, atol=1e-5, rtol=1e-5)
    assert dispatch.CALLS == {("pruned_decode_attention", "triton"): 1}


def test_module_kernels_argument_is_the_mode_of_its_steps_alone_and_rejects_unknown_values(monkeypatch):
    """``model.kernels`` is the run's: its prediction steps run under it, and building the module
    or finishing a step leaves the mode of the surrounding code as it was."""
    from kvlab.runner.module import KVLabModule

    with dispatch.kernel_mode("auto"):
        module = KVLabModule(model="tiny-qwen2", kernels="reference")
        assert dispatch.get_mode() == "auto"  # building a module sets nothing process-wide
        seen = []
        monkeypatch.setattr(module, "predict_batch", lambda batch, index: seen.append(dispatch.get_mode()))
        module.predict_step({}, 0)
        assert seen == ["reference"] and dispatch.get_mode() == "auto"
    with pytest.raises(ConfigError, match="model.kernels"):
        KVLabModule(model="tiny-qwen2", kernels="cuda")


SMALL = ["--contexts", "300", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeat", "1"]


@pytest.mark.parametrize(
    "bench, extra", [("decode", ["--budgets", "0.1,0.5"]), ("window", ["--window", "8"])]
)
def test_bench_commands_print_a_table(bench, extra, capsys):
    from kvlab.cli.main import main

    main(["bench", bench, *SMALL, *extra])
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| 300 ")]
    assert len(table) == (2 if bench == "decode" else 1)
    if not torch.cuda.is_available():
        assert "need a CUDA device" in out


def test_bench_decode_formats_prints_the_16_bit_row_then_one_per_format(capsys):
    from kvlab.cli.main import main

    main(["bench", "decode", *SMALL, "--formats", "int8,int4,kivi2,turbo3"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 300 ")]
    assert [row[4].strip() for row in rows] == ["bf16", "int8", "int4", "kivi2", "turbo3"]
    assert rows[0][7].strip() == "1.00" and all(float(row[7]) > 0 for row in rows)


def test_bench_decode_channels_prints_the_full_cache_every_channel_and_each_share(capsys):
    from kvlab.cli.main import main

    main(["bench", "decode", *SMALL, "--channels", "0.5,0.25"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 300 ")]
    assert [row[4].strip() for row in rows] == [
        "full cache (sdpa)",
        "all channels",
        "keys at 50%",
        "keys at 25%",
    ]
    sizes = [float(row[5]) for row in rows[1:]]
    assert sizes[0] > sizes[1] > sizes[2]  # the kept entries' bytes fall with the key channels
    assert rows[1][7].strip() == "1.00" and all(float(row[6]) > 0 for row in rows)


def test_unknown_bench_exits_2_and_a_registered_bench_runs(capsys, monkeypatch):
    from kvlab import bench
    from kvlab.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "decod"])
    assert exc.value.code == 2 and "did you mean 'decode'" in capsys.readouterr().err.lower()
    monkeypatch.setattr(bench, "BENCHES", dict(bench.BENCHES))  # the registration is undone afterwards
    bench.register_bench("window2", "kvlab.bench.window", "the window bench under another name")
    main(["bench", "--help"])
    assert "window2" in capsys.readouterr().out
    main(["bench", "window2", *SMALL, "--window", "4"])
    assert "| 300 " in capsys.readouterr().out


def test_generation_through_the_triton_kernels_equals_the_torch_path():
    """A whole compressed run (prefill, compaction, decode) gives the same tokens and logits."""
    from support.e2e import kvlab_model, run

    from kvlab import load_model
    from kvlab.data.synthetic import SyntheticRetrieval
    from kvlab.pipeline import Pipeline

    loaded = kvlab_model("tiny-qwen2") if DEVICE == "cpu" else load_model("tiny-qwen2", device=DEVICE)
    pipeline = Pipeline.from_config(
        {"budget": {"tokens": 40, "window": 8}, "importance": {"window_attention": {"window": 8}}}
    )
    items = SyntheticRetrieval(num_samples=2, context_words=40, seed=1).samples()
    dispatch.set_mode("reference")
    want = run(loaded, pipeline, items, 3)
    dispatch.set_mode("triton")
    dispatch.CALLS.clear()
    got = run(loaded, pipeline, items, 3)
    assert {path for _, path in dispatch.CALLS} == {"triton"}
    assert {"ragged_decode_attention", "compact_kv"} <= {name for name, _ in dispatch.CALLS}
    assert got.tokens == want.tokens
    for b in range(2):
        torch.testing.assert_close(got.step_logits[b], want.step_logits[b], atol=1e-4, rtol=1e-4)

"""Memory is real: ragged per-head budgets (AdaKV, SparseMM) shrink the bytes the cache allocates.

``CompressedCache.kv_bytes()`` counts every tensor the cache holds. With head budgets that differ
per head it must equal (sum of kept tokens) x head_dim x 2 (K and V) x dtype size, plus the
reserved decode region and the per-(sample, head) offsets, to within 2%; and it must fall with
the budget, far below a masking implementation that keeps full-size buffers.
"""

import pytest
from support.e2e import kvlab_model, run
from support.presets import budgeted_pipeline

from kvlab.data.synthetic import SyntheticRetrieval

NEW_TOKENS = 3


@pytest.fixture(scope="module")
def long_samples():
    return SyntheticRetrieval(num_samples=2, context_words=220, seed=3).samples()


@pytest.mark.parametrize("preset", ["adakv", "sparsemm"])
def test_kv_bytes_match_the_kept_tokens_and_fall_with_the_budget(preset, long_samples):
    loaded = kvlab_model("tiny-qwen2")
    info = loaded.info
    allocated = {}
    for budget in (96, 40):
        pipe = budgeted_pipeline(preset, "tiny-qwen2", tokens=budget)
        result = run(loaded, pipe, long_samples, NEW_TOKENS)
        B = len(long_samples)
        element = 4  # float32
        kept = int(result.kept.sum())
        assert len(set(result.kept.flatten().tolist())) > 1  # the heads really differ
        decode_region = info.num_layers * B * info.num_kv_heads * NEW_TOKENS * info.head_dim * 2 * element
        offsets = info.num_layers * 2 * B * info.num_kv_heads * 8  # starts + lengths, int64
        expected = kept * info.head_dim * 2 * element + decode_region + offsets
        got = result.kv_bytes_allocated
        assert abs(got - expected) <= 0.02 * expected, (got, expected)
        # a masking implementation keeps every prompt token of every head
        longest = int(result.prompt_lengths.max())
        masked = info.num_layers * B * info.num_kv_heads * longest * info.head_dim * 2 * element
        assert got < masked * (budget + NEW_TOKENS + 8) / int(result.prompt_lengths.min())
        allocated[budget] = got
    assert allocated[40] < allocated[96]
    assert allocated[40] / allocated[96] < 0.6


def test_memory_and_scoring_benches_print_their_tables(capsys):
    """Smoke test of the benches (tiny sizes; nothing is timed or asserted about speed)."""
    import torch

    from kvlab.cli.main import main

    threads = torch.get_num_threads()  # the benches set their own thread count
    try:
        main(["bench", "memory", "--contexts", "300", "--budget", "48", "--steps", "1", "--repeat", "1"])
        rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 300 ")]
        assert [row.split("|")[2].strip() for row in rows] == ["full", "adakv", "sparsemm"]
        main(["bench", "scoring", "--contexts", "300", "--hosts", "snapkv", "--repeat", "1", "--layers", "4"])
        rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 300 ")]
        assert len(rows) == 1 and rows[0].split("|")[2].strip() == "snapkv"
    finally:
        torch.set_num_threads(threads)

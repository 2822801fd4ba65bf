"""Quest (Tang et al. 2024): the `key_bounds` retrieval index of the `retrieve` selector and the
`quest` preset. The page bound and the page choice against the paper's formula written as loops
(tests/naive/quest.py), the bound against every logit of its page, decode attention against a
loop over the pages the naive choice picks, and the index as a YAML component. The Triton kernel
is tested against the torch path in tests/kernels/test_kernels.py and compiled for sm_80/sm_90 by
tests/kernels/test_kernel_compile.py; the preset runs through the preset matrices
(tests/engine/test_methods.py, test_batching.py, test_preset_regression.py)."""

import pytest
import torch
from naive.attention import dot
from naive.quest import naive_page_bounds, naive_page_choice
from naive.retrieval import assert_attends_to
from support.retrieval_layers import retrieval_layer

import kvlab
from kvlab.compression.quest import KeyBoundsIndex
from kvlab.compression.retrieval import ChunkStore
from kvlab.compression.retrieval_index import MeanKeyIndex
from kvlab.config.errors import ConfigError
from kvlab.config.loader import resolve
from kvlab.kernels.retrieval import page_bounds_reference
from kvlab.pipeline import Pipeline


def store_of(keys: torch.Tensor, page: int, ranker=None) -> ChunkStore:
    """The store of one retrieving row holding every token of ``keys [1, 1, T, D]``."""
    region = torch.ones(1, keys.shape[2], dtype=torch.bool)
    return ChunkStore.build(keys, keys, torch.tensor([[0, 0]]), region, torch.tensor([1]), page,
                            ranker or KeyBoundsIndex())  # fmt: skip


@pytest.mark.parametrize("G", [1, 3])
def test_page_bound_is_the_papers_formula(G):
    """``U_c = sum_i max(q_i M_i, q_i m_i)`` over 16-token pages (a partial last page), per channel."""
    gen = torch.Generator().manual_seed(G)
    keys = torch.randn(1, 1, 70, 12, generator=gen) * torch.linspace(0.2, 3.0, 12)  # uneven channels
    store = store_of(keys, 16)
    assert store.index.shape == (1, 5, 2, 12)
    query = torch.randn(1, G, 2, 12, generator=gen)
    bounds = page_bounds_reference(query, store.index, store.rows, store.chunk_valid, 1)  # [1, 2, 5]
    rows = keys[0, 0].tolist()
    for i in range(2):
        want = naive_page_bounds([query[0, g, i].tolist() for g in range(G)], rows, 16)
        torch.testing.assert_close(bounds[0, i].double(), torch.tensor(want, dtype=torch.float64),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_bound_holds_every_logit_of_its_page_and_is_tight_for_one_token_pages():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 1, 200, 16, generator=gen) * 2.0
    query = torch.randn(1, 4, 1, 16, generator=gen)  # GQA: 4 query heads on the KV head
    for page in (1, 5, 16, 64):
        store = store_of(keys, page)
        bounds = page_bounds_reference(query, store.index, store.rows, store.chunk_valid, 1)[0, 0]
        qbar = query[0, :, 0].double().mean(0)
        for c, bound in enumerate(bounds.tolist()):
            page_keys = keys[0, 0, c * page : (c + 1) * page].double()
            logits = page_keys @ qbar  # the group's mean logit of every key of the page
            assert bound >= float(logits.max()) - 1e-5
            for g in range(4) if page == 16 else ():  # each head's own bound holds its own logits
                own = naive_page_bounds([query[0, g, 0].tolist()], page_keys.tolist(), page)[0]
                assert own >= max(dot(query[0, g, 0].tolist(), k) for k in page_keys.tolist()) - 1e-9
            if page == 1:  # min = max = the key: the bound is the logit itself
                assert bound == pytest.approx(float(logits[0]), abs=1e-5)


def test_decode_attends_to_the_pages_the_papers_bound_picks():
    """Each retrieving head attends, in one softmax, to its resident tokens, its decoded tokens and
    the tokens of the top ``(budget - resident) // page`` pages by the naive bound."""
    lengths, counts, page, G = (23, 17), ((9, 30), (13, 8)), 4, 2
    layer, query, ctx, _, decoded = retrieval_layer(
        lengths, counts, "protected", page, G=G, index={"name": "key_bounds"}
    )
    got = layer.decode_attention(query, ctx.scaling)
    T = ctx.seq_len
    for b, n in enumerate(lengths):
        off = T - n
        for h in range(2):
            if counts[b][h] >= n:
                chosen_tokens = list(range(n))
            else:
                held = [n - 3, n - 2, n - 1]
                region = list(range(n - 3))
                q_group = [query[b, h * G + g, 0].tolist() for g in range(G)]
                region_keys = [ctx.keys[b, h, off + j].tolist() for j in region]
                chosen = naive_page_choice(q_group, region_keys, page, (counts[b][h] - 3) // page)
                pages = [range(c * page, min(c * page + page, n - 3)) for c in chosen]
                chosen_tokens = held + [j for tokens in pages for j in tokens]
            assert_attends_to(got, query, ctx, decoded, (b, h, G), [off + j for j in chosen_tokens])


def test_pages_of_one_token_pick_what_the_mean_key_picks():
    """With one token per page the bound is the logit and the mean key the key: both indexes fetch
    the same tokens, so decode attention is the same."""
    outputs = []
    for index in ({"name": "mean_key"}, {"name": "key_bounds"}):
        layer, query, ctx, _, _ = retrieval_layer((23, 17), ((9, 30), (13, 8)), "protected", 1, index=index)
        outputs.append(layer.decode_attention(query, ctx.scaling))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-6)


def test_index_bytes_are_twice_the_mean_keys():
    keys = torch.randn(1, 1, 64, 8)
    mean, bounds = store_of(keys, 16, MeanKeyIndex()), store_of(keys, 16)
    assert bounds.device_bytes() - mean.device_bytes() == 4 * 8 * 4  # one more [NC, D] fp32 tensor
    assert bounds.offloaded_bytes() == mean.offloaded_bytes()


def test_the_index_is_a_yaml_component_under_the_selector():
    node = {"budget": {"tokens": 32, "window": 4}, "importance": {"recency": {}}}
    default = Pipeline.from_config({**node, "select": {"name": "retrieve"}})
    quest = Pipeline.from_config({**node, "select": {"name": "retrieve", "index": {"name": "key_bounds"}}})
    assert isinstance(default.selector.parts()["index"], MeanKeyIndex)
    part = [p for p in quest.walk() if p.field == "model.compression.select.index"]
    assert [type(p.component) for p in part] == [KeyBoundsIndex]
    with pytest.raises(ConfigError, match=r"model\.compression\.select\.index.*key_bounds"):
        Pipeline.from_config({**node, "select": {"name": "retrieve", "index": {"name": "key_bound"}}})
    paged = {"name": "retrieve", "index": {"name": "key_bounds", "page": 16}}
    with pytest.raises(ConfigError, match="key_bounds"):  # no parameters: the page is the selector's chunk
        Pipeline.from_config({**node, "select": paged})


def test_quest_preset_pages_of_16_and_the_bound_index():
    node = resolve(["quest"], [])["model"]["compression"]
    want = {"name": "retrieve", "chunk": 16, "local": "protected", "index": {"name": "key_bounds"}}
    assert node["select"] == want
    pipeline = kvlab.load_pipeline("quest")
    assert isinstance(pipeline.selector.parts()["index"], KeyBoundsIndex)


def test_bench_decode_compares_the_indexes_in_one_table(capsys):
    from kvlab.cli.main import main

    main(["bench", "decode", "--indexes", "mean_key,key_bounds", "--contexts", "256", "--budgets", "0.25",
          "--repeat", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 256 |")]
    assert [row.split(" | ")[2] for row in rows] == ["kvlab full", "retrieve mean_key", "retrieve key_bounds"]
    assert [row.split(" | ")[3] for row in rows] == ["all", "3", "3"]  # (64 - 16 resident) // 16 pages

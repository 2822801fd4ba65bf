"""The cache API protocols build on: padded blocks of new tokens, checkpoints, keeping slots.

- A left-padded block of questions prefilled on top of a compressed context
  (:meth:`CompressedCache.appending_valid`) gives each sample exactly what its unpadded prompt
  gives (the full cache: transformers-exact; sliding-window layers included, whose positions
  count real tokens only), and with compression each sample what it gets alone.
- :meth:`CompressedCache.checkpoint` / :meth:`CompressedCache.restore` return the cache to the
  checkpointed context, even after a decode policy evicted entries in place.
- :meth:`CompressedLayer.keep_slots` keeps exactly the marked entries.
"""

import dataclasses

import pytest
import torch
from support.attention_variants import build, tokenizer

import kvlab
from kvlab.engine.generation import PrefillState, decode, prefill
from kvlab.engine.session import compression_session
from kvlab.kernels.decode_attention import ragged_decode_attention_reference
from kvlab.models.prompts import collate_ids
from kvlab.pipeline import Pipeline

CONTEXTS = (23, 17, 9)
QUESTIONS = (3, 5, 1)
STEPS = 4
SNAPKV = {"budget": {"tokens": 8, "window": 2}, "importance": {"attention": {"name": "window_attention"}}}
H2O = {
    "budget": {"tokens": 8, "window": 2},
    "importance": {"attention": {"name": "cumulative_attention"}},
    "decode": {"name": "h2o"},
}


def rows(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1024, (n,), generator=g).tolist() for n in lengths]


def extend(state: PrefillState, questions: list[list[int]]) -> PrefillState:
    """Prefill left-padded ``questions`` on top of ``state``'s compressed cache (one forward)."""
    width = max(len(q) for q in questions)
    ids = torch.zeros(len(questions), width, dtype=torch.long)
    valid = torch.zeros(len(questions), width, dtype=torch.bool)
    for b, q in enumerate(questions):
        ids[b, width - len(q) :] = torch.tensor(q)
        valid[b, width - len(q) :] = True
    positions = state.next_positions + valid.long().cumsum(1) - 1  # padding repeats a position: hidden
    with compression_session(state.session), state.cache.appending_valid(valid), torch.no_grad():
        out = state.loaded.model(
            input_ids=ids, position_ids=positions.clamp(min=0), cache=state.cache, use_cache=True
        )
    return dataclasses.replace(
        state,
        logits=out.logits[:, -1].float(),
        next_positions=state.next_positions + valid.sum(1, keepdim=True),
    )


def run_after(state: PrefillState, questions: list[list[int]]):
    return decode(extend(state, questions), STEPS, return_logits=True)


@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gemma3-text"])
def test_padded_questions_on_the_full_cache_equal_the_whole_prompt(name):
    loaded = kvlab.wrap_model(build(name), tokenizer(), name=name)
    contexts, questions = rows(CONTEXTS, 1), rows(QUESTIONS, 2)
    full = Pipeline.from_config(None)
    state = prefill(loaded, full, collate_ids(loaded, contexts), decode_capacity=2)  # grows on the way
    got = run_after(state, questions)
    for b in range(len(contexts)):
        whole = prefill(loaded, full, collate_ids(loaded, [contexts[b] + questions[b]]))
        wanted = decode(whole, STEPS, return_logits=True)
        torch.testing.assert_close(got.step_logits[b], wanted.step_logits[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(got.tokens[b], wanted.tokens[0])


@pytest.mark.parametrize("name", ["llama", "mistral-sliding"])
def test_padded_questions_on_a_compressed_context_equal_each_alone(name):
    loaded = kvlab.wrap_model(build(name), tokenizer(), name=name)
    contexts, questions = rows(CONTEXTS, 3), rows(QUESTIONS, 4)
    pipeline = Pipeline.from_config(SNAPKV)
    batched = run_after(prefill(loaded, pipeline, collate_ids(loaded, contexts)), questions)
    for b in range(len(contexts)):
        alone = run_after(prefill(loaded, pipeline, collate_ids(loaded, [contexts[b]])), [questions[b]])
        torch.testing.assert_close(batched.step_logits[b], alone.step_logits[0], atol=1e-4, rtol=1e-4)


def test_restore_returns_to_the_checkpoint_after_in_place_evictions():
    """H2O evicts in place at every decode step; restoring the checkpoint (and the policy's own
    state, which the protocol keeps) gives the next question exactly a fresh context's run."""
    loaded = kvlab.wrap_model(build("llama"), tokenizer(), name="llama")
    contexts = rows(CONTEXTS, 5)
    first, second = rows((1, 1, 1), 6), rows((1, 1, 1), 7)  # one token: H2O's slot bookkeeping holds
    pipeline = Pipeline.from_config(H2O)
    state = prefill(loaded, pipeline, collate_ids(loaded, contexts))
    checkpoint = state.session.run.checkpoint()  # the cache and the policy's own state
    saved = [(layer.prompt_keys.clone(), layer.lengths.clone()) for layer in state.cache.layers]

    def restore() -> None:
        state.session.run.restore(checkpoint)

    a1 = run_after(state, first)
    assert any(
        not torch.equal(layer.prompt_keys, keys)
        for layer, (keys, _) in zip(state.cache.layers, saved, strict=False)
    )
    for state_of_layer, (keys, _) in zip(checkpoint.cache.layers, saved, strict=True):
        assert torch.equal(state_of_layer["prompt_keys"], keys)  # the evictions wrote into copies
    restore()
    for layer, (keys, lengths) in zip(state.cache.layers, saved, strict=True):
        assert torch.equal(layer.prompt_keys, keys) and torch.equal(layer.lengths, lengths)
        assert layer.decode_length == 0
    b = run_after(state, second)
    restore()
    a2 = run_after(state, first)
    assert torch.equal(a1.tokens, a2.tokens)
    torch.testing.assert_close(a1.step_logits, a2.step_logits)
    fresh = run_after(prefill(loaded, pipeline, collate_ids(loaded, contexts)), second)
    assert torch.equal(b.tokens, fresh.tokens)
    torch.testing.assert_close(b.step_logits, fresh.step_logits)


def test_keep_slots_keeps_exactly_the_marked_entries():
    loaded = kvlab.wrap_model(build("llama"), tokenizer(), name="llama")
    state = prefill(loaded, Pipeline.from_config(SNAPKV), collate_ids(loaded, rows(CONTEXTS, 8)))
    state = extend(state, rows(QUESTIONS, 9))  # a padded decode region: its padding is no slot
    layer = state.cache.layers[1]
    valid = layer.slot_valid()
    g = torch.Generator().manual_seed(0)
    keep = valid & (torch.rand(valid.shape, generator=g) < 0.6)
    rows_, _ = layer.slot_rows()
    dl = layer.decode_length
    keys = torch.cat([layer.prompt_keys[rows_], layer.decode_keys[:, :, :dl]], 2)
    values = torch.cat([layer.prompt_values[rows_], layer.decode_values[:, :, :dl]], 2)
    layer.keep_slots(keep)
    assert torch.equal(layer.lengths, keep.sum(-1)) and layer.decode_length == 0
    for b in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            k, v = layer.segment(b, h)
            assert torch.equal(k, keys[b, h][keep[b, h]]) and torch.equal(v, values[b, h][keep[b, h]])
    with pytest.raises(ValueError, match="no entry"):
        layer.keep_slots(~layer.slot_valid())


def test_padding_entries_are_hidden_from_decode_attention():
    """Naive check of ``decode_valid``: equal to attention over the real entries alone."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, C = 2, 4, 2, 8, 5
    lengths = torch.tensor([[3, 1], [0, 2]])
    starts = (lengths.flatten().cumsum(0) - lengths.flatten()).view(B, Hkv)
    pk, pv = torch.randn(int(lengths.sum()), D, generator=g), torch.randn(int(lengths.sum()), D, generator=g)
    dk, dv = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    dk[0, :, 1] = 50.0  # a padding entry (its K/V come from a pad token) must never reach a real query
    dv[0, :, 1] = 1e4
    valid = torch.tensor([[True, False, True, True, True], [True, True, True, True, True]])
    query = torch.randn(B, H, 1, D, generator=g)
    out = ragged_decode_attention_reference(
        query, pk, pv, starts, lengths, dk, dv, 4, 0.3, decode_valid=valid
    )
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hkv)
            s, n = int(starts[b, kv]), int(lengths[b, kv])
            real = valid[b, :4]
            k = torch.cat([pk[s : s + n], dk[b, kv, :4][real]])
            v = torch.cat([pv[s : s + n], dv[b, kv, :4][real]])
            probs = torch.softmax(query[b, h, 0] @ k.T * 0.3, -1)
            torch.testing.assert_close(out[b, h, 0], probs @ v)


def test_a_block_without_padding_keeps_the_plain_decode_path():
    """Questions of equal length (or one sample) leave no padding entry: no ``decode_valid``, so
    decode keeps the in-place path (and the Triton kernel on a GPU); a padded block sets it."""
    loaded = kvlab.wrap_model(build("llama"), tokenizer(), name="llama")
    pipeline = Pipeline.from_config(SNAPKV)
    state = extend(prefill(loaded, pipeline, collate_ids(loaded, rows(CONTEXTS, 10))), rows((3, 3, 3), 11))
    assert all(layer.decode_valid is None for layer in state.cache.layers)
    state = extend(prefill(loaded, pipeline, collate_ids(loaded, rows(CONTEXTS, 10))), rows(QUESTIONS, 11))
    assert all(layer.decode_valid is not None for layer in state.cache.layers)

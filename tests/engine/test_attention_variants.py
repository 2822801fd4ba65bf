"""Attention variants (sliding windows, logit soft-capping, sinks) are exact with the full cache.

Tiny random-weight models built from transformers' own config classes, run through kvlab with no
compression, give transformers' own logits (prompt longer than the sliding window, so the window
matters); a padded batch gives each sample what it gets alone; what kvlab does not implement is
refused with a ConfigError naming the model and the argument.
"""

import pytest
import torch
from support.attention_variants import CONFIGS, STEPS, build, prompts, tokenizer

import kvlab
from kvlab.config.errors import ConfigError
from kvlab.engine.generation import RunOptions, generate
from kvlab.models.prompts import collate_ids
from kvlab.pipeline import Pipeline


def ours(loaded, rows: list[list[int]]):
    """kvlab's greedy run with the full cache: ``step_logits [B, STEPS, V]``, tokens."""
    return generate(
        loaded,
        Pipeline.from_config(None),
        collate_ids(loaded, rows),
        RunOptions(max_new_tokens=STEPS, return_logits=True),
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_cache_matches_transformers_and_batch_equals_alone(name):
    model = build(name)
    rows = prompts()
    wanted = []
    with torch.no_grad():
        for row in rows:
            out = model.generate(
                input_ids=torch.tensor([row]),
                attention_mask=torch.ones(1, len(row), dtype=torch.long),
                max_new_tokens=STEPS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            wanted.append(torch.stack(out.logits, 1)[0].float())
    loaded = kvlab.wrap_model(model, tokenizer(), name=name)
    batched = ours(loaded, rows)
    for b, row in enumerate(rows):
        alone = ours(loaded, [row])
        torch.testing.assert_close(alone.step_logits[0], wanted[b], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(batched.step_logits[b], wanted[b], atol=1e-4, rtol=1e-4)
        assert batched.tokens[b] == alone.tokens[0]


def test_the_window_matters():
    """Without its sliding window the Mistral model gives other logits (the test above can fail)."""
    windowed, full = build("mistral-sliding"), build("mistral-sliding")
    full.config.sliding_window = None
    row = prompts()[0]
    with torch.no_grad():
        a = windowed(torch.tensor([row])).logits[0, -1]
        b = full(torch.tensor([row])).logits[0, -1]
    assert (a - b).abs().max() > 1e-2


def test_unsupported_config_refused_at_load_time():
    model = build("llama")
    model.config.name_or_path = "tiny-chunked"
    model.config.attention_chunk_size = 8
    with pytest.raises(ConfigError, match="tiny-chunked.*attention_chunk_size"):
        kvlab.wrap_model(model, tokenizer())
    model = build("gemma3-text")
    model.config.name_or_path = "tiny-linear"
    model.config.layer_types = ["linear_attention"] * 4
    with pytest.raises(ConfigError, match="tiny-linear.*linear_attention"):
        kvlab.wrap_model(model, tokenizer())


def test_unknown_attention_keyword_refused_at_call_time():
    model = build("llama")
    model.config.name_or_path = "tiny-llama-variant"
    loaded = kvlab.wrap_model(model, tokenizer())
    attention = loaded.model.model.layers[0].self_attn
    forward = attention.forward

    def with_extra_keyword(*args, **kwargs):
        return forward(*args, position_bias=torch.zeros(1), **kwargs)

    attention.forward = with_extra_keyword
    with pytest.raises(ConfigError, match="tiny-llama-variant.*LlamaAttention.*position_bias"):
        ours(loaded, prompts()[:1])


def test_forcing_the_triton_decode_kernel_on_a_windowed_layer_is_refused():
    """kernels: triton asks for the Triton kernel, which has no window, softcap or sinks: such a
    layer is refused, never quietly run on the reference (under auto it takes the reference)."""
    from kvlab.kernels.decode_attention import ragged_decode_attention
    from kvlab.kernels.dispatch import kernel_mode

    z = torch.zeros
    args = (z(1, 2, 1, 16), z(4, 16), z(4, 16), torch.tensor([[0]]), torch.tensor([[4]]), z(1, 1, 1, 16))
    kwargs = {
        "sliding_window": 2,
        "prompt_positions": torch.arange(4),
        "decode_positions": torch.tensor([[[4]]]),
    }
    with kernel_mode("triton"), pytest.raises(ConfigError, match="sliding_window.*model.kernels: auto"):
        ragged_decode_attention(*args, z(1, 1, 1, 16), 1, 0.25, 4, softcap=None, **kwargs)


def test_kvlab_attention_outside_a_run_refuses_a_windowed_layer():
    """Called outside a kvlab run (a wrapped model used through transformers' own generate), the
    sdpa fallback would drop the sliding window: refused, naming what it would drop."""
    model = build("mistral-sliding")
    kvlab.wrap_model(model, tokenizer())
    with pytest.raises(ConfigError, match="outside a kvlab run.*sliding_window=6"), torch.no_grad():
        model(torch.tensor([prompts()[0]]))

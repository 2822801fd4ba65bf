"""With nothing evicted, kvlab's ``per_token`` codes give transformers' own ``QuantizedCache``.

transformers' quantized cache with the ``optimum-quanto`` backend (``axis 0``: per token, groups
of ``q_group_size`` channels, asymmetric min/max codes) quantizes the whole prompt after the
prefill and keeps decoded tokens in full precision until its residual fills; kvlab's
``per_token`` quantizer with ``residual: 0`` on the full cache does the same, so the step logits
agree to float rounding while both differ from the unquantized run. Skipped where the backend is
not installed (it is not a kvlab dependency).
"""

import pytest
import torch
from support.e2e import kvlab_model, run
from support.presets import retrieval_samples
from transformers.cache_utils import DynamicCache, QuantizedCache

from kvlab.models import load_model
from kvlab.pipeline import Pipeline

pytest.importorskip("optimum.quanto")

MODEL, STEPS, GROUP = "tiny-llama", 5, 16


def transformers_logits(model, ids, tokens, cache) -> torch.Tensor:
    """``[steps, V]``: the last position's logits of the prompt, then of each teacher-forced token."""
    T = ids.shape[1]
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        logits = [out.logits[0, -1]]
        for step, token in enumerate(tokens):
            position = torch.tensor([[T + step]])
            out = model(input_ids=torch.tensor([[token]]), position_ids=position, cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("bits", [2, 4])
def test_per_token_codes_equal_transformers_quantized_cache(bits):
    loaded = kvlab_model(MODEL)
    items = retrieval_samples(1, 60)
    full = run(loaded, Pipeline.from_config(None), items, STEPS)
    node = {"quantize": {"name": "per_token", "bits": bits, "group": GROUP, "residual": 0}}
    packed = run(loaded, Pipeline.from_config(node), items, STEPS)
    plain = load_model(MODEL)  # transformers' own attention path
    ids = loaded.processor.collate(list(items)).input_ids
    tokens = packed.tokens[0][: STEPS - 1]
    config = plain.model.config
    cache = QuantizedCache(
        "quanto", config, nbits=bits, q_group_size=GROUP, residual_length=64, axis_key=0, axis_value=0
    )
    want = transformers_logits(plain.model, ids, tokens, cache)
    unquantized = transformers_logits(plain.model, ids, tokens, DynamicCache())
    got = packed.step_logits[0, : want.shape[0]]
    assert float((got - unquantized).abs().max()) > 1e-3  # the codes change the logits ...
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # ... exactly as transformers' do
    assert int(packed.kv_bytes_kept[0]) < int(full.kv_bytes_kept[0]) * (bits + 2 * 32 / GROUP + 1) / 32

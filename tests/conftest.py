"""Shared test settings: offline, one torch thread per xdist worker (2 workers on 2 cores), and
the Triton interpreter when there is no GPU (it must be set before triton is first imported, so
that ``@triton.jit`` builds interpreted kernels: tests/kernels/test_kernels.py runs them on CPU).

Tests marked ``gpu`` (the GPU tier, ``tests/gpu``; ``.ci/gpu`` runs it on a GPU machine) are
collected everywhere and skipped without CUDA, unless ``KVLAB_GPU_TIER=interpreted`` asks for the
tier's dry run on the CPU (tests/gpu/gpu_support.py).

Tests sit in folders named after the package they test (tests/README.md). This file, in tests/
(no ``__init__.py``), puts tests/ on ``sys.path`` (pytest's default ``prepend`` import mode), so
every test folder imports the shared helpers as ``support.<module>`` and the naive references as
``naive.<module>``. Each test module is imported by its file name from its own folder, so test
file names must stay unique across folders.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or os.environ.get("KVLAB_GPU_TIER") == "interpreted":
        return
    skip = pytest.mark.skip(reason="GPU tier: needs CUDA (run .ci/gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def visual_heads(tmp_path_factory):
    """``visual_heads(info) -> path``: a seeded synthetic visual-head artefact for a model's shape
    (SparseMM presets need one; the tiny models have no calibrated heads)."""
    from kvlab.calibration.synthetic import synthetic_visual_heads

    def make(info) -> str:
        return synthetic_visual_heads(info, str(tmp_path_factory.mktemp("visual-heads")))

    return make

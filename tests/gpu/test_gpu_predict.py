"""GPU tier: ``kvlab predict`` end to end on CUDA with ``model.kernels: auto`` (skipped without CUDA).

One process on one GPU: the run completes, its records say the memory was measured on CUDA, and
every kernel call took the Triton path (``kvlab.kernels.dispatch.CALLS``, counted in this
process). With two GPUs, ``--trainer.devices 2`` (DDP, one rank per GPU) must merge into the same
predictions as the one-GPU run.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from gpu_support import cli_main, needs_cuda

from kvlab.kernels import dispatch

pytestmark = [pytest.mark.gpu, needs_cuda]


def command(root, method: str) -> list[str]:
    return ["predict", "--config", "snapkv", "--model.model", "tiny-qwen2", "--model.kernels", "auto",
            "--model.compression.budget", "{tokens: 48, window: 8}", "--model.max_new_tokens", "8",
            "--trainer.enable_progress_bar", "false",
            "--data.dataset", "{name: synthetic_retrieval, num_samples: 6, context_words: 300, seed: 1}",
            "--data.batch_size", "2", "--run.dir", str(root), "--run.experiment", "gpu",
            "--run.method", method]  # fmt: skip


def records(root, method: str) -> list[dict]:
    lines = (root / "gpu" / method / "predictions.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    dispatch.CALLS.clear()
    cli_main([*command(root, "one"), "--trainer.accelerator", "gpu", "--trainer.devices", "1"])
    return root, dict(dispatch.CALLS)


def test_predict_runs_on_cuda_through_the_triton_kernels(one_gpu):
    root, calls = one_gpu
    rows = records(root, "one")
    assert len(rows) == 6 and all(r["peak_memory_kind"] == "cuda_allocated" for r in rows)
    assert (root / "gpu" / "one" / "metrics.json").is_file()
    paths = {path for (_, path), n in calls.items() if n}
    assert paths == {"triton"}, calls
    ran = {name for (name, _), n in calls.items() if n}
    assert {"ragged_decode_attention", "compact_kv", "window_attention_scores"} <= ran, calls


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (--trainer.devices 2)")
def test_predict_on_two_gpus_merges_into_the_one_gpu_run(one_gpu):
    root, _ = one_gpu
    ddp = ["--trainer.accelerator", "gpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    result = subprocess.run([sys.executable, "-m", "kvlab.cli", *command(root, "two"), *ddp],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = records(root, "one"), records(root, "two")
    assert [r["id"] for r in two] == [r["id"] for r in one]
    for a, b in zip(one, two, strict=True):
        assert a["prediction"] == b["prediction"] and a["kv_bytes_kept"] == b["kv_bytes_kept"]

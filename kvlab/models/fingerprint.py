"""What a re-run needs to reproduce a run: the model's fingerprint, the seeds and the library versions.

:func:`model_fingerprint` hashes every tensor a model holds (the state dict plus the
non-persistent buffers such as rotary frequencies) with SHA-256: the tensor's name, dtype,
shape and raw bytes. Two models with the same fingerprint compute the same numbers on the same
device. Hashing all of SmolLM2-135M (float32, 538 MB) takes about 0.5 s on a free CPU core and
0.9 s on a loaded 2-core machine (SHA-256 runs at over 1 GB/s with the CPU's SHA instructions),
so every tensor is hashed, not a subset; tied weights are hashed once.
Tensors on the ``meta`` device (not materialised, e.g. offloaded by ``device_map``) contribute
only their name, dtype and shape, and :func:`model_fingerprint` counts them.

:func:`reproduce_record` is the ``reproduce.json`` that every ``kvlab predict`` run writes
(``docs/evaluation.md``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import sys
from typing import Any

import torch

#: distributions whose versions a run records (triton only where it is installed)
LIBRARIES: tuple[str, ...] = ("torch", "transformers", "lightning", "triton", "kvlab")


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` by name: its state dict, then the non-persistent buffers it leaves out."""
    tensors = dict(model.state_dict())
    for name, buffer in model.named_buffers():
        if name not in tensors and buffer is not None:
            tensors[name] = buffer
    return tensors


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 (hex) of a tensor's dtype, shape and bytes (row-major, on the CPU); ``meta``: no bytes."""
    digest = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    if tensor.device.type != "meta":
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
    return digest.hexdigest()


def tensor_digests(model: torch.nn.Module) -> dict[str, str]:
    """:func:`tensor_digest` of every tensor of :func:`model_tensors`, sorted by name.

    Tensors sharing storage, shape and strides (tied weights) are hashed once.
    """
    seen: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name, tensor in sorted(model_tensors(model).items()):
        key = (
            tensor.device,
            tensor.dtype,
            tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
        )
        if key not in seen:
            seen[key] = tensor_digest(tensor)
        out[name] = seen[key]
    return out


def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """``{"sha256", "tensors", "meta_tensors"}``: one SHA-256 over every tensor's name and digest.

    ``meta_tensors`` counts tensors without data (hashed by name, dtype and shape only); when it
    is not 0 the fingerprint does not pin their values.
    """
    digests = tensor_digests(model)
    meta = sum(t.device.type == "meta" for t in model_tensors(model).values())
    return {"sha256": combine_digests(digests), "tensors": len(digests), "meta_tensors": meta}


def combine_digests(digests: dict[str, str]) -> str:
    """One SHA-256 (hex) over ``name=digest`` lines of :func:`tensor_digests`, in name order."""
    total = hashlib.sha256()
    for name in sorted(digests):
        total.update(f"{name}={digests[name]}\n".encode())
    return total.hexdigest()


def library_versions() -> dict[str, str | None]:
    """Installed versions of :data:`LIBRARIES` (None where one is missing) and Python's.

    Read from the package metadata, so nothing (triton included) is imported.
    """
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    if versions["torch"] is not None:
        versions["torch"] = torch.__version__  # the local build tag (+cpu, +cu124) matters
        versions["cuda"] = torch.version.cuda
    return versions


def device_description(device: torch.device | str) -> dict[str, Any]:
    """The device a run computed on: type, name (GPU model or CPU architecture) and count."""
    device = torch.device(device)
    out: dict[str, Any] = {"type": device.type}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        out["name"] = torch.cuda.get_device_name(index)
        out["capability"] = list(torch.cuda.get_device_capability(index))
        out["count"] = torch.cuda.device_count()
    else:
        out["name"] = platform.processor() or platform.machine()
        out["threads"] = torch.get_num_threads()
    return out


def reproduce_record(
    *,
    model: str,
    fingerprint: dict[str, Any] | None,
    model_seed: int | None,
    seed: int | None,
    dtype: str,
    device: torch.device | str,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """The ``reproduce.json`` of a run: model name and fingerprint, seeds, dtype, libraries, device.

    Args:
        model: ``model.model`` as given (built-in name, directory or Hub id).
        fingerprint: :func:`model_fingerprint` of the loaded weights (None if not computed).
        model_seed: the seed a built-in's random weights are drawn with (None for loaded weights).
        seed: the run's global seed (``seed_everything``), None if none was set.
        dtype: the model dtype name.
        device: where the run computed.
        command: the command line (default ``sys.argv``).
    """
    return {
        "model": model,
        "model_fingerprint": fingerprint,
        "model_seed": model_seed,
        "seed": seed,
        "dtype": dtype,
        "libraries": library_versions(),
        "device": device_description(device),
        "command": list(sys.argv if command is None else command),
    }

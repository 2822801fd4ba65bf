"""The full-cache reference of each sample, computed once and reused by every method.

One file per sample under ``<run.dir>/<run.experiment>/reference/``, named by a hash of what
determines the full model's output: the model name and dtype, the sample id, the prompt's
token ids, the sample's image pixels and ``max_new_tokens``. A second method (or a re-run, or
a sweep point) of the same experiment loads the reference instead of running the full cache
again. Files are written atomically (temporary file + rename), so concurrent ranks or an
interrupted run never leave a half-written reference.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from kvlab.data.sample import Sample
from kvlab.metrics.fidelity import Reference

REFERENCE_DIR = "reference"
#: part of every key: 2 since a pipeline that only quantizes (or prunes channels) stopped being
#: taken as its own reference: references stored before are recomputed, never trusted
REFERENCE_FORMAT = 2


def reference_key(
    model: str, dtype: str, max_new_tokens: int, sample: Sample, prompt_ids: torch.Tensor
) -> str:
    """Hex digest naming one sample's reference (``prompt_ids``: the valid prompt token ids)."""
    digest = hashlib.sha256()
    limit = sample.max_new_tokens if sample.max_new_tokens is not None else max_new_tokens
    digest.update(f"{REFERENCE_FORMAT}\0{model}\0{dtype}\0{limit}\0{sample.id}\0".encode())
    digest.update(prompt_ids.to(torch.int64).cpu().numpy().tobytes())
    for image in sample.images:
        digest.update(f"{image.mode}{image.size}".encode())
        digest.update(image.tobytes())
    return digest.hexdigest()[:32]


class ReferenceStore:
    """Reads and writes references under ``directory`` (None: nothing is cached)."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory) if directory is not None else None

    def path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}.pt"

    def load(self, key: str) -> Reference | None:
        """The stored reference, or None (not stored, no directory, or unreadable)."""
        path = self.path(key)
        if path is None or not path.is_file():
            return None
        try:
            data: dict[str, Any] = torch.load(path, weights_only=True)
            return Reference(list(data["tokens"]), data["logprobs"], data["ids"].long())
        except Exception:  # a corrupt or foreign file is recomputed, not trusted
            return None

    def save(self, key: str, ref: Reference) -> None:
        path = self.path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        data = {"tokens": ref.tokens, "logprobs": ref.logprobs.cpu(), "ids": ref.ids.to(torch.int32).cpu()}
        torch.save(data, tmp)
        os.replace(tmp, path)

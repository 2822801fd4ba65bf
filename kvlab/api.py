"""kvlab's public Python API: build a compression pipeline, get a model, run prompts through both.

Everything here is exported from :mod:`kvlab` (``import kvlab``); ``docs/api.md`` is the guide::

    pipeline = kvlab.load_pipeline("snapkv", {"budget.tokens": 64})   # preset, YAML path or dict
    model = kvlab.load_model("tiny-qwen2")                             # or kvlab.wrap_model(hf_model, tok)
    [out] = kvlab.compress_and_generate(model, pipeline, ["What is the capital of France?"])
    out.text, out.kept_positions[layer][head], out.kv_ratio

The functions only compose kvlab's internals (:class:`kvlab.compression.pipeline.Pipeline`,
:func:`kvlab.models.load_model`, the processors' ``collate`` and the protocols of
:mod:`kvlab.engine.protocols` over :mod:`kvlab.engine.generation`), which stay free to move behind them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from PIL import Image

from kvlab.compression.pipeline import Pipeline
from kvlab.config.errors import ConfigError
from kvlab.config.loader import find_config, load_config, merge
from kvlab.config.plugins import IMPORTS_KEY, check_imports, import_plugins
from kvlab.config.registry import to_plain
from kvlab.data.sample import Sample
from kvlab.engine.attention import ATTENTION_NAME, check_prefill_chunk, enable_kvlab_attention
from kvlab.engine.generation import GenerationResult
from kvlab.engine.protocols import Protocol, build_protocol
from kvlab.models.base import PAD, TEXT, LoadedModel

__all__ = [
    "Output",
    "compress_and_generate",
    "compression_config",
    "load_model",
    "load_pipeline",
    "wrap_model",
]

#: top-level groups of a run config (``kvlab predict --config``); a mapping without them is a
#: bare ``model.compression`` node
RUN_GROUPS = ("model", "data", "trainer", "run")
OVERRIDE_PREFIX = "model.compression."

PipelineSource = str | os.PathLike | Mapping[str, Any] | None
ImagesArg = Sequence[Image.Image | Sequence[Image.Image] | None] | None


# ---- pipelines -------------------------------------------------------------------------------
def compression_config(
    source: PipelineSource, overrides: Mapping[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    """The resolved ``model.compression`` mapping of ``source`` with ``overrides`` merged in.

    Args:
        source: a preset name (``"snapkv"``), a YAML path, or a dict. A file or dict holding a run
            config (``model:``/``data:``/``run:`` groups, optionally ``preset: NAME``) gives its
            ``model.compression``; any other mapping is a compression node itself (it may start
            with ``preset: NAME`` to inherit that preset's pipeline). ``None`` or ``{}``: full cache.
        overrides: fields to change, keyed by dotted paths inside the compression node
            (``{"budget.tokens": 64}``; a leading ``model.compression.`` is allowed) or by field
            with nested mappings (``{"budget": {"tokens": 64}}``). Merged with the preset rules of
            :func:`kvlab.config.loader.merge`: siblings are kept, lists and renamed components
            (a new ``name``) are replaced whole, ``tokens`` replaces ``ratio`` and vice versa.
        fields: more overrides as keyword arguments (``budget={"tokens": 64}``), applied last.

    Returns:
        A new plain dict (validated only when a pipeline is built from it).

    Raises:
        ConfigError: unknown preset or file, invalid YAML, a source or override of the wrong type.
    """
    node = _compression_node(source)
    for key, value in [*(overrides or {}).items(), *fields.items()]:
        node = merge(node, _nest(key, value))
    return node


def load_pipeline(
    source: PipelineSource = "full", overrides: Mapping[str, Any] | None = None, **fields: Any
) -> Pipeline:
    """Build and validate a compression pipeline (no model is loaded).

    Takes the arguments of :func:`compression_config` (a preset name, YAML path or dict, then
    overrides such as ``{"budget.tokens": 64}`` or ``budget={"tokens": 64}``).

    Raises:
        ConfigError: any invalid field, named by its path (``model.compression.budget has no
            field 'tokenz'``), before any model loads.
    """
    return Pipeline.from_config(compression_config(source, overrides, **fields))


def _compression_node(source: PipelineSource) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, str | os.PathLike):
        path = find_config(str(source))
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{path} must contain a YAML mapping at the top level, got {type(raw).__name__}."
            )
        if _is_run_config(raw):
            return _from_run_config(load_config(str(path)), str(path))
        return _from_mapping(raw, relative_to=path.parent)
    source = to_plain(source)
    if isinstance(source, Mapping):
        return _from_mapping(copy.deepcopy(dict(source)), relative_to=None)
    raise ConfigError(
        f"A pipeline source must be a preset name, a YAML path or a dict, got {type(source).__name__}: "
        f"{source!r}. Example: kvlab.load_pipeline('snapkv', {{'budget.tokens': 64}})."
    )


def _is_run_config(node: Mapping[str, Any]) -> bool:
    return isinstance(node.get("model"), Mapping) or any(key in node for key in RUN_GROUPS[1:])


def _from_mapping(node: dict[str, Any], relative_to: Path | None) -> dict[str, Any]:
    """A dict source: a run config (its ``model.compression``) or a compression node."""
    parent = node.pop("preset", None)
    if parent is not None and not isinstance(parent, str):
        raise ConfigError(f"`preset` must be a preset name or a path, got {parent!r}.")
    if _is_run_config(node):
        base = load_config(parent, relative_to=relative_to) if parent else {}
        return _from_run_config(merge(base, node), "the given config")
    base = _from_run_config(load_config(parent, relative_to=relative_to), parent) if parent else {}
    return merge(base, node)


def _from_run_config(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A run config's ``model.compression``, after importing the plugins its ``imports`` lists."""
    import_plugins(check_imports(cfg.get(IMPORTS_KEY)))
    model = cfg.get("model") or {}
    if not isinstance(model, Mapping):
        raise ConfigError(f"{where}: `model` must be a mapping, got {model!r}.")
    node = model.get("compression") or {}
    if not isinstance(node, Mapping):
        raise ConfigError(f"{where}: model.compression must be a mapping, got {node!r}.")
    return copy.deepcopy(dict(node))


def _nest(key: Any, value: Any) -> dict[str, Any]:
    """``("budget.tokens", 64)`` -> ``{"budget": {"tokens": 64}}``."""
    if not isinstance(key, str) or not key.strip("."):
        raise ConfigError(
            f"Override keys must be field names or dotted paths such as 'budget.tokens', got {key!r}."
        )
    key = key.removeprefix(OVERRIDE_PREFIX)
    value = to_plain(value)
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


# ---- models ----------------------------------------------------------------------------------
def load_model(
    name: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    device_map: str | dict[str, str | int | torch.device] | None = None,
) -> LoadedModel:
    """Load a model by built-in name (``kvlab list``), local directory or Hub id, ready for kvlab.

    Args:
        name: ``"tiny-qwen2"``, ``"smollm2-135m"``, a directory written by ``save_pretrained`` or
            a Hub id ``org/name``.
        dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` or a :class:`torch.dtype`.
        device: where to put the model (default: stays on the CPU).
        device_map: spread the model over several devices instead (accelerate): ``"auto"``,
            ``"balanced"``, ``"balanced_low_0"``, ``"sequential"`` or a module name -> device
            mapping (``{"model.layers.0": 0, ..., "lm_head": 1}``). Passed to ``from_pretrained``
            for directories and Hub ids; built-ins are dispatched after building. Each layer's
            compressed cache then lives on that layer's device (``docs/scaling.md``). Do not
            ``.to()`` the model afterwards.

    Returns:
        A :class:`~kvlab.models.base.LoadedModel` (``.model``: the HF model in eval mode with its
        language model's attention routed through kvlab; ``.processor``; ``.info``: layers,
        heads and KV heads of the language model).

    Raises:
        ConfigError: unknown name, missing directory, bad dtype or device map, or both ``device``
            and ``device_map`` (before any weight loads).
    """
    from kvlab.models import load_model as _load

    if device is not None and device_map is not None:
        raise ConfigError(
            f"load_model got both device={device!r} and device_map={device_map!r}; give one. device puts the "
            "whole model on one device, device_map spreads its layers over several (e.g. device_map='auto')."
        )
    loaded = _load(name, dtype, device_map=device_map)
    if device is not None:
        loaded.model.to(device)
    enable_kvlab_attention(loaded.model, loaded.info.vision_language)
    return loaded


def wrap_model(
    model: torch.nn.Module,
    tokenizer: Any,
    image_processor: Any = None,
    *,
    name: str | None = None,
    chat_template: str = "auto",
) -> LoadedModel:
    """Make a user's already-loaded transformers model and tokenizer runnable by kvlab.

    The model is put in eval mode and its language model's attention is switched to kvlab's
    (``model.set_attn_implementation``; outside kvlab runs it is plain sdpa, but transformers
    then builds no padding mask: call ``model.set_attn_implementation("sdpa")`` to undo it
    before using the model's own batched ``generate``). Weights, device and dtype are untouched.

    Args:
        model: a ``*ForCausalLM`` (any family whose attention goes through transformers'
            ``AttentionInterface``), or a Qwen2-VL / Qwen2.5-VL / LLaVA ``*ForConditionalGeneration``.
        tokenizer: its tokenizer. Without a chat template, prompts are passed raw with its special
            tokens (a vision-language model then needs ``chat_template``).
        image_processor: vision-language models only: the family's ``*ImageProcessorPil`` (or any
            image processor returning the model's ``pixel_values``/``image_grid_thw``); None takes
            the family's defaults.
        name: the model's name for per-model calibration artefacts (SparseMM's visual heads);
            default: ``model.config.name_or_path`` or the class name.
        chat_template: ``auto`` (the tokenizer's template, else the raw prompt), ``none`` (always
            raw) or the path of a Jinja template file, as ``data.chat_template``.

    Returns:
        A :class:`~kvlab.models.base.LoadedModel` usable with :func:`compress_and_generate`.

    Raises:
        ConfigError: a vision-language family kvlab cannot feed images to, a vision-language
            model without a chat template, or a tokenizer with neither a pad nor an eos token.
    """
    from kvlab.models.info import model_info
    from kvlab.models.processors import ChatProcessor
    from kvlab.models.vlm import image_adapter

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ConfigError(
            f"wrap_model needs a transformers model (an nn.Module with .config), got {model!r}."
        )
    config = model.config
    name = name or getattr(config, "name_or_path", "") or type(model).__name__
    info = model_info(config, name)
    images = image_adapter(config, image_processor) if info.vision_language else None
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
    processor = ChatProcessor(
        tokenizer, info.image_token_ids, info.video_token_ids, images, eos, chat_template=chat_template
    )
    processor.check_template()
    model.eval()
    enable_kvlab_attention(model, info.vision_language)
    parameter = next(model.parameters())
    extras = {"source": "wrapped", "dtype": parameter.dtype, "device": parameter.device}
    return LoadedModel(model=model, processor=processor, info=info, extras=extras)


def _ensure_kvlab_attention(loaded: LoadedModel) -> None:
    """Route attention through kvlab if the model came from elsewhere (idempotent)."""
    from kvlab.models.common import text_config

    if getattr(text_config(loaded.model.config), "_attn_implementation", None) != ATTENTION_NAME:
        enable_kvlab_attention(loaded.model, loaded.info.vision_language)


# ---- running ---------------------------------------------------------------------------------
@dataclass
class Output:
    """What one prompt gave: its text, what the cache kept and what it cost.

    Positions count from the prompt's first token (0-based; padding of the batch removed), so a
    prompt's output is the same in a batch and alone.

    Attributes:
        prompt: the prompt as given (string, chat messages or token ids).
        text: the generated text (special tokens skipped).
        token_ids: the generated token ids (stops before the first eos token or at the limit).
        prompt_ids: the prompt's token ids as the model saw them (chat template applied, each
            image expanded to its image tokens), ``prompt_tokens`` of them.
        modality: per prompt token: 0 text, 1 image, 2 video.
        prompt_tokens: the prompt's length in tokens.
        kept: ``[L, Hkv]`` long tensor, prompt tokens kept per layer and KV head.
        kept_positions: ``kept_positions[layer][head]``: the kept prompt positions, ascending
            (``len == kept[layer, head]``). With a merging method (LOOK-M) an entry at a kept
            position may hold a merge of evicted ones.
        layer_budgets: the budget each layer got for this prompt (tokens per head, protected
            tokens included); a budget of at least ``prompt_tokens`` keeps the whole prompt.
        kv_bytes_full: bytes of the prompt's K/V in an uncompressed cache (all layers and heads).
        kv_bytes_kept: bytes of the prompt's kept K/V.
        kv_ratio: ``kv_bytes_kept / kv_bytes_full``.
        prefill_seconds: prefill time without compression; the batch's time divided by its size.
        compression_seconds: scoring and selection time, all layers (batch time / batch size).
        decode_seconds: greedy decode time (batch time / batch size).
    """

    prompt: Any
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    modality: list[int]
    prompt_tokens: int
    kept: torch.Tensor
    kept_positions: list[list[list[int]]]
    layer_budgets: list[int]
    kv_bytes_full: int
    kv_bytes_kept: int
    kv_ratio: float
    prefill_seconds: float
    compression_seconds: float
    decode_seconds: float

    @property
    def costs(self) -> dict[str, float]:
        """The cost figures as one dict (prompt tokens, KV bytes full/kept, kv ratio, seconds)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "kv_bytes_full": self.kv_bytes_full,
            "kv_bytes_kept": self.kv_bytes_kept,
            "kv_ratio": self.kv_ratio,
            "prefill_seconds": self.prefill_seconds,
            "compression_seconds": self.compression_seconds,
            "decode_seconds": self.decode_seconds,
        }

    def kept_mask(self) -> torch.Tensor:
        """``[L, Hkv, prompt_tokens]`` bool: True where a layer's head kept the prompt position."""
        L, H = self.kept.shape
        mask = torch.zeros(L, H, self.prompt_tokens, dtype=torch.bool)
        for layer, heads in enumerate(self.kept_positions):
            for head, positions in enumerate(heads):
                mask[layer, head, positions] = True
        return mask


@dataclass
class _Item:
    """One normalised prompt: a :class:`Sample` (goes through ``collate``) or ready token ids."""

    index: int
    prompt: Any
    sample: Sample | None = None
    ids: list[int] | None = None


def compress_and_generate(
    model: LoadedModel,
    pipeline: Pipeline | PipelineSource,
    prompts: Any,
    *,
    images: ImagesArg = None,
    max_new_tokens: int = 32,
    batch_size: int | None = None,
    protocol: str | Mapping[str, Any] | Protocol = "query_aware",
    prefill_chunk: int | None = None,
) -> list[Output]:
    """Prefill each prompt, compress its KV cache with ``pipeline``, decode greedily.

    Args:
        model: from :func:`load_model` or :func:`wrap_model`.
        pipeline: from :func:`load_pipeline`, or anything :func:`load_pipeline` takes
            (``"snapkv"``, a path, a dict; ``None``: full cache).
        prompts: a list of prompts, or one prompt. A prompt is a string (the user turn; the
            model's chat template is applied), chat messages (a list of ``{"role", "content"}``
            dicts; the template is applied with the assistant turn opened), token ids (a list
            of ints or a 1-D tensor, used verbatim; a 2-D tensor is a batch of them) or a
            :class:`~kvlab.data.sample.Sample` (its ``question``, ``answer_prefix``,
            ``max_new_tokens`` and ``context_id`` are what the protocols use; its own images).
        images: vision-language models: one entry per prompt, each None, a PIL image or a list
            of them; they go before the text in the user turn. Only string prompts and chats of
            one user turn (after an optional system turn, string contents) take images.
        max_new_tokens: greedy decode limit per prompt.
        batch_size: prompts per forward (left-padded); None runs all of one kind at once. String
            and one-turn prompts are batched by the processor's ``collate``, the others as token
            ids; either way a prompt gives the same output as alone. Under ``multi_question`` it
            counts contexts (each batch holds every prompt of its contexts).
        protocol: what is compressed and when, as ``model.protocol`` (``docs/protocols.md``):
            ``query_aware`` (default), ``query_agnostic``, ``multi_question`` (prompts sharing a
            ``Sample.context_id`` answered from one compressed context) or a ``decode_time``
            node such as ``{"name": "decode_time", "interval": 64, "target_size": 128}``.
            Protocols other than ``query_aware`` need string, one-turn chat or Sample prompts.
        prefill_chunk: as ``model.prefill_chunk``: None prefills each prompt in one forward, N
            in chunks of N tokens (``docs/scaling.md``); refused for scorers that need every
            prompt query and for vision-language models.

    Returns:
        One :class:`Output` per prompt, in order.

    Raises:
        ConfigError: a malformed prompt, images for a text-only model or a token-id prompt, a bad
            ``max_new_tokens`` / ``batch_size``, an invalid pipeline source, a protocol that is
            unknown or cannot run the pipeline, or a ``prefill_chunk`` the pipeline or model refuses.
    """
    if not isinstance(model, LoadedModel):
        raise ConfigError(
            f"compress_and_generate needs a model from kvlab.load_model(name) or "
            f"kvlab.wrap_model(model, tokenizer), got {type(model).__name__}."
        )
    if not isinstance(pipeline, Pipeline):
        pipeline = load_pipeline(pipeline)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"batch_size must be None or an int >= 1, got {batch_size!r}.")
    protocol = build_protocol(protocol)
    protocol.check(pipeline)
    check_prefill_chunk(pipeline, prefill_chunk)
    items = _items(model, _prompt_list(prompts), images)
    _ensure_kvlab_attention(model)
    outputs: list[Output | None] = [None] * len(items)
    for group in ([i for i in items if i.sample is not None], [i for i in items if i.sample is None]):
        for chunk in _chunks(group, batch_size, protocol.groups_contexts):
            if chunk[0].sample is not None:
                batch = model.processor.collate([item.sample for item in chunk])
            else:
                batch = _collate_ids(model, [item.ids for item in chunk])
            result = protocol.run(model, pipeline, batch, max_new_tokens, prefill_chunk=prefill_chunk).result
            for b, item in enumerate(chunk):
                outputs[item.index] = _output(model, batch, result, b, item.prompt)
    return outputs  # type: ignore[return-value]


def _chunks(group: list[_Item], batch_size: int | None, by_context: bool) -> list[list[_Item]]:
    """``group`` in batches of ``batch_size`` prompts (all when None), or of ``batch_size`` whole
    contexts (every prompt of a ``context_id`` together) when ``by_context``."""
    if not group:
        return []
    if by_context and group[0].sample is not None:
        from kvlab.data.contexts import context_batches

        indices = context_batches([item.sample.context_id for item in group], batch_size or len(group))
        return [[group[i] for i in batch] for batch in indices]
    step = batch_size or len(group)
    return [group[start : start + step] for start in range(0, len(group), step)]


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str | Sample):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts]
        if prompts.dim() == 2:
            return list(prompts)
        raise ConfigError(f"token-id prompts must be a 1-D or 2-D tensor, got shape {tuple(prompts.shape)}.")
    if not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError(
            "prompts must be a non-empty list of prompts (strings, chat message lists or token-id lists), "
            f"or one prompt; got {prompts!r}."
        )
    if isinstance(prompts[0], int | Mapping):  # one token-id list or one conversation
        return [prompts]
    return list(prompts)


def _images_per_prompt(images: ImagesArg, count: int) -> list[list[Image.Image]]:
    if images is None:
        return [[] for _ in range(count)]
    if isinstance(images, Image.Image) and count == 1:
        images = [images]
    if isinstance(images, Image.Image) or not isinstance(images, Sequence) or len(images) != count:
        raise ConfigError(
            f"images must hold one entry per prompt ({count}): None, a PIL image or a list of PIL images; "
            f"got {images!r}."
        )
    out = []
    for i, entry in enumerate(images):
        entry = [] if entry is None else [entry] if isinstance(entry, Image.Image) else list(entry)
        if not all(isinstance(img, Image.Image) for img in entry):
            raise ConfigError(
                f"images[{i}] must be None, a PIL image or a list of PIL images, got {entry!r}."
            )
        out.append([img.convert("RGB") for img in entry])
    return out


def _items(loaded: LoadedModel, prompts: list[Any], images: ImagesArg) -> list[_Item]:
    per_prompt = _images_per_prompt(images, len(prompts))
    if any(per_prompt) and not loaded.info.vision_language:
        raise ConfigError(
            f"images were given but model '{loaded.info.name}' is text-only; use a vision-language model "
            "(e.g. tiny-qwen2-vl, smollm2-qwen2-vl) or drop the images."
        )
    items = []
    for i, (prompt, imgs) in enumerate(zip(prompts, per_prompt, strict=True)):
        item = _Item(index=i, prompt=prompt)
        if isinstance(prompt, Sample):
            if imgs:
                raise ConfigError(
                    f"prompts[{i}] is a Sample, which carries its own images; leave its images entry None."
                )
            item.sample = prompt
        elif isinstance(prompt, str):
            item.sample = Sample(id=str(i), prompt=prompt, images=imgs)
        elif _is_token_ids(prompt):
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else [int(t) for t in prompt]
            if imgs:
                raise ConfigError(
                    f"prompts[{i}] is token ids, which cannot carry images; pass the text or chat messages "
                    "with images=..., and kvlab inserts and expands the image tokens."
                )
            if not ids:
                raise ConfigError(f"prompts[{i}] is an empty list of token ids.")
            item.ids = ids
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            _check_messages(prompt, i)
            sample = _chat_sample(prompt, i, imgs)
            if sample is not None:
                item.sample = sample
            elif imgs:
                raise ConfigError(
                    f"prompts[{i}]: images go with a string prompt or a chat of one user turn (after an "
                    "optional system turn) with string contents; this conversation has more turns."
                )
            else:
                item.ids = _render_chat(loaded, prompt)
        else:
            raise ConfigError(
                f"prompts[{i}] must be a string, a list of {{'role': ..., 'content': ...}} messages or token "
                f"ids (list of ints or a 1-D tensor), got {prompt!r}."
            )
        items.append(item)
    return items


def _is_token_ids(prompt: Any) -> bool:
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 1 and not prompt.is_floating_point()
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        and len(prompt) > 0
    )


def _check_messages(messages: Sequence[Mapping[str, Any]], i: int) -> None:
    for j, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ConfigError(
                f"prompts[{i}][{j}] must be a chat message {{'role': 'user', 'content': '...'}}, "
                f"got {message!r}."
            )


def _chat_sample(messages: Sequence[Mapping[str, Any]], i: int, images: list[Image.Image]) -> Sample | None:
    """A Sample for ``[system?, user]`` with string contents (collate renders it identically), else None."""
    system = None
    rest = list(messages)
    if rest and rest[0]["role"] == "system" and isinstance(rest[0]["content"], str):
        system = rest.pop(0)["content"]
    if len(rest) != 1 or rest[0]["role"] != "user" or not isinstance(rest[0]["content"], str):
        return None
    return Sample(id=str(i), prompt=rest[0]["content"], images=images, system=system)


def _render_chat(loaded: LoadedModel, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of a conversation through the processor's chat template (its ``chat_template``
    setting: the tokenizer's own or a file), assistant turn opened; a conversation cannot be
    passed raw, so a model without a template is refused."""
    processor = loaded.processor
    template = getattr(processor, "template", None)
    if template is None:
        raise ConfigError(
            f"prompts: a multi-turn chat needs a chat template, and model {loaded.info.name!r} has none in "
            f"use (chat_template={getattr(processor, 'chat_template', None)!r}). Pass a template file "
            "(wrap_model(..., chat_template='path/to/template.jinja')) or give the prompt as one string."
        )
    tokenizer = processor.tokenizer
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False, chat_template=template
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _collate_ids(loaded: LoadedModel, rows: list[list[int]]) -> dict[str, Any]:
    """Token-id prompts -> a left-padded batch in the processor's ``collate`` layout (no images).

    Returns ``input_ids`` / ``attention_mask`` / ``modality`` ``[B, T]`` and ``model_inputs`` (the
    image adapter's per-token inputs, e.g. Qwen2-VL's ``mm_token_type_ids`` ``[B, T]``).
    """
    processor = loaded.processor
    if not hasattr(processor, "pad_token_id"):
        raise ConfigError(
            f"token-id and multi-turn prompts need kvlab's ChatProcessor; {type(processor).__name__} only "
            "takes string prompts."
        )
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), processor.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    image_ids = torch.tensor(processor.image_token_ids, dtype=torch.long)
    video_ids = torch.tensor(processor.video_token_ids, dtype=torch.long)
    special = (torch.isin(input_ids, image_ids) | torch.isin(input_ids, video_ids)) & attention_mask.bool()
    if bool(special.any()):
        raise ConfigError(
            "a token-id or multi-turn prompt contains image/video tokens but carries no images; pass the "
            "prompt as a string or one-turn chat with images=..."
        )
    modality = torch.full_like(input_ids, TEXT)
    modality[attention_mask == 0] = PAD
    model_inputs: dict[str, Any] = {}
    if processor.images is not None:
        model_inputs = processor.images.batch_inputs(input_ids, image_ids, video_ids)
        for value in model_inputs.values():
            value[attention_mask == 0] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "modality": modality,
        "model_inputs": model_inputs,
        "ids": [str(i) for i in range(len(rows))],
        "samples": [],
    }


def _output(
    loaded: LoadedModel, batch: dict[str, Any], result: GenerationResult, b: int, prompt: Any
) -> Output:
    """Sample ``b`` of a batch's :class:`GenerationResult` as an :class:`Output` (padding removed)."""
    B, T = batch["input_ids"].shape
    length = int(result.prompt_lengths[b])
    pad = T - length
    reports = {report.layer_idx: report for report in result.reports}
    num_layers, num_heads = result.kept.shape[0], result.kept.shape[2]
    positions, budgets = [], []
    for layer in range(num_layers):
        report = reports.get(layer)
        if report is None or report.selection is None:
            raise RuntimeError(f"layer {layer} produced no compression report")
        selection = report.selection
        positions.append([[p - pad for p in selection.kept_positions(b, h)] for h in range(num_heads)])
        budgets.append(int(report.budget[b]))
    full, kept = int(result.kv_bytes_full[b]), int(result.kv_bytes_kept[b])
    modality = batch["modality"][b, pad:]
    return Output(
        prompt=prompt,
        text=loaded.processor.decode(result.tokens[b]),
        token_ids=list(result.tokens[b]),
        prompt_ids=batch["input_ids"][b, pad:].tolist(),
        modality=modality.tolist(),
        prompt_tokens=length,
        kept=result.kept[:, b].clone(),
        kept_positions=positions,
        layer_budgets=budgets,
        kv_bytes_full=full,
        kv_bytes_kept=kept,
        kv_ratio=kept / max(full, 1),
        prefill_seconds=result.prefill_seconds / B,
        compression_seconds=result.compression_seconds / B,
        decode_seconds=result.decode_seconds / B,
    )

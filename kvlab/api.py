"""kvlab's public Python API: build a compression pipeline, get a model, run prompts through both.

Everything here is exported from :mod:`kvlab` (``import kvlab``); ``docs/api.md`` is the guide::

    pipeline = kvlab.load_pipeline("snapkv", {"budget.tokens": 64})   # preset, YAML path or dict
    model = kvlab.load_model("tiny-qwen2")                             # or kvlab.wrap_model(hf_model, tok)
    [out] = kvlab.compress_and_generate(model, pipeline, ["What is the capital of France?"])
    out.text, out.kept_positions[layer][head], out.kv_ratio

A thin facade: the functions only compose kvlab's internals, which stay free to move behind
them: the compression node (:func:`kvlab.config.compression.compression_config`) and
:class:`kvlab.pipeline.Pipeline`; the models (:func:`kvlab.models.load_model`,
:func:`kvlab.models.wrap_model`) with their attention routed through kvlab; the prompts
(:mod:`kvlab.models.prompts`: normalised, batched, collated) run by the protocols of
:mod:`kvlab.engine.protocols`, whose results become one :class:`Output` per prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

import kvlab.models as models
from kvlab.config.compression import PipelineSource, compression_config
from kvlab.config.errors import ConfigError
from kvlab.data.sample import refuse_unused_limit
from kvlab.engine.generation import GenerationResult, RunOptions
from kvlab.engine.prefill_plan import check_prefill_chunk
from kvlab.engine.protocols import Protocol, build_protocol, sample_limits
from kvlab.engine.registration import ATTENTION_NAME, enable_kvlab_attention
from kvlab.models.base import Batch, LoadedModel
from kvlab.models.common import text_config
from kvlab.models.prompts import ImagesArg, collate_items, prompt_batches, prompt_items
from kvlab.pipeline import Pipeline
from kvlab.pipeline.report import LayerReport

#: the decode limit of :func:`compress_and_generate` for prompts without a limit of their own
DEFAULT_MAX_NEW_TOKENS = 32

__all__ = [
    "Output",
    "compress_and_generate",
    "compression_config",
    "load_model",
    "load_pipeline",
    "wrap_model",
]


# ---- pipelines -------------------------------------------------------------------------------
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
    if device is not None and device_map is not None:
        raise ConfigError(
            f"load_model got both device={device!r} and device_map={device_map!r}; give one. device puts the "
            "whole model on one device, device_map spreads its layers over several (e.g. device_map='auto')."
        )
    loaded = models.load_model(name, dtype, device_map=device_map)
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
    loaded = models.wrap_model(model, tokenizer, image_processor, name=name, chat_template=chat_template)
    enable_kvlab_attention(model, loaded.info.vision_language)
    return loaded


def _ensure_kvlab_attention(loaded: LoadedModel) -> None:
    """Route attention through kvlab if the model came from elsewhere (idempotent)."""
    if getattr(text_config(loaded.model.config), "_attn_implementation", None) != ATTENTION_NAME:
        enable_kvlab_attention(loaded.model, loaded.info.vision_language)


# ---- running ---------------------------------------------------------------------------------
@dataclass
class Output:
    """What one prompt gave: its text, what the cache kept and what it cost.

    Positions count from the prompt's first token (0-based; padding of the batch removed), so a
    prompt's output is the same in a batch and alone. A prediction record (``predictions.jsonl``)
    holds :meth:`record` and :attr:`reported`.

    Attributes:
        prompt: the prompt as given (string, chat messages or token ids).
        text: the generated text (special tokens skipped).
        token_ids: the generated token ids (stops before the first eos token or at the limit).
        max_new_tokens: the limit this prompt decoded under: its sample's own (a benchmark's
            answer length) or the run's ``max_new_tokens``.
        prompt_ids: the prompt's token ids as the model saw them (chat template applied, each
            image expanded to its image tokens), ``prompt_tokens`` of them.
        modality: per prompt token: 0 text, 1 image, 2 video.
        prompt_tokens: the prompt's length in tokens.
        kept: ``[L, Hkv]`` long tensor, prompt tokens kept per layer and KV head.
        kv_bytes_full: bytes of the prompt's K/V in an uncompressed cache (all layers and heads).
        kv_bytes_kept: bytes of the prompt's kept K/V.
        kv_ratio: ``kv_bytes_kept / kv_bytes_full``.
        batch_size: prompts in the batch this one ran in (the seconds below are its share).
        prefill_seconds: prefill time without compression; the batch's time divided by its size.
        compression_seconds: scoring and selection time, all layers (batch time / batch size).
        decode_seconds: greedy decode time (batch time / batch size).
        reported: the fields the pipeline's components report for this prompt
            (:meth:`kvlab.pipeline.Pipeline.report`; e.g. a retrieving method's device and host bytes).
        kept_positions, layer_budgets: see the properties (computed when first read).
    """

    prompt: Any
    text: str
    token_ids: list[int]
    max_new_tokens: int
    prompt_ids: list[int]
    modality: list[int]
    prompt_tokens: int
    kept: torch.Tensor
    kv_bytes_full: int
    kv_bytes_kept: int
    kv_ratio: float
    batch_size: int
    prefill_seconds: float
    compression_seconds: float
    decode_seconds: float
    reported: dict[str, Any] = field(default_factory=dict)
    #: the batch's layer reports, this prompt's row in them and its left padding
    _layers: Sequence[LayerReport] = field(default=(), repr=False, compare=False)
    _row: int = field(default=0, repr=False, compare=False)
    _pad: int = field(default=0, repr=False, compare=False)

    @property
    def costs(self) -> dict[str, float]:
        """The cost figures as one dict (prompt tokens, KV bytes full/kept, kv ratio, seconds)."""
        record = self.record()
        return {k: record[k] for k in ("prompt_tokens", "kv_bytes_full", "kv_bytes_kept", "kv_ratio")} | {
            k: v for k, v in record.items() if k.endswith("_seconds")
        }

    def record(self) -> dict[str, Any]:
        """This prompt's figures as a prediction record writes them (``docs/evaluation.md``), in
        the file's order: output text and tokens, prompt tokens, kept per layer and head, bytes,
        batch size and seconds."""
        return {
            "output": self.text,
            "output_tokens": len(self.token_ids),
            "max_new_tokens": self.max_new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "kept_per_layer_head": self.kept.tolist(),
            "kv_bytes_full": self.kv_bytes_full,
            "kv_bytes_kept": self.kv_bytes_kept,
            "kv_ratio": self.kv_ratio,
            "batch_size": self.batch_size,
            "prefill_seconds": self.prefill_seconds,
            "compression_seconds": self.compression_seconds,
            "decode_seconds": self.decode_seconds,
        }

    @cached_property
    def kept_positions(self) -> list[list[list[int]]]:
        """``kept_positions[layer][head]``: the kept prompt positions, ascending (``len ==
        kept[layer, head]``). With a merging method (LOOK-M) an entry at a kept position may hold
        a merge of evicted ones."""
        return [[[p - self._pad for p in report.selection.kept_positions(self._row, h)]  # type: ignore[union-attr]
                 for h in range(self.kept.shape[1])] for report in self._ordered_layers()]  # fmt: skip

    @cached_property
    def layer_budgets(self) -> list[int]:
        """The budget each layer got for this prompt (tokens per head, protected tokens included);
        a budget of at least ``prompt_tokens`` keeps the whole prompt."""
        return [int(report.budget[self._row]) for report in self._ordered_layers()]

    def _ordered_layers(self) -> list[LayerReport]:
        """The layer reports in layer order, one per layer, each with its selection."""
        reports = {report.layer_idx: report for report in self._layers}
        for layer in range(self.kept.shape[0]):
            if reports.get(layer) is None or reports[layer].selection is None:
                raise RuntimeError(f"layer {layer} produced no compression report")
        return [reports[layer] for layer in range(self.kept.shape[0])]

    def kept_mask(self) -> torch.Tensor:
        """``[L, Hkv, prompt_tokens]`` bool: True where a layer's head kept the prompt position."""
        L, H = self.kept.shape
        mask = torch.zeros(L, H, self.prompt_tokens, dtype=torch.bool)
        for layer, heads in enumerate(self.kept_positions):
            for head, positions in enumerate(heads):
                mask[layer, head, positions] = True
        return mask


def compress_and_generate(
    model: LoadedModel,
    pipeline: Pipeline | PipelineSource,
    prompts: Any,
    *,
    images: ImagesArg = None,
    max_new_tokens: int | None = None,
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
        max_new_tokens: greedy decode limit per prompt; None: a Sample's own ``max_new_tokens``,
            else :data:`DEFAULT_MAX_NEW_TOKENS`. Given, it must apply to every prompt: a Sample
            whose own limit differs is refused (its own limit would win).
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
    limit = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"max_new_tokens must be None or an int >= 1, got {max_new_tokens!r}.")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"batch_size must be None or an int >= 1, got {batch_size!r}.")
    protocol = build_protocol(protocol)
    protocol.check(pipeline)
    check_prefill_chunk(pipeline, prefill_chunk)
    options = RunOptions(limit, prefill_chunk=prefill_chunk)
    items = prompt_items(model, prompts, images)
    if max_new_tokens is not None:
        samples = [item.sample for item in items if item.sample is not None]
        fix = "Pass max_new_tokens=None (each Sample keeps its own limit), or edit Sample.max_new_tokens."
        refuse_unused_limit(samples, limit, "max_new_tokens", fix)
    _ensure_kvlab_attention(model)
    outputs: list[Output | None] = [None] * len(items)
    for chunk in prompt_batches(items, batch_size, protocol.groups_contexts):
        batch = collate_items(model, chunk)
        result = protocol.run(model, pipeline, batch, options).result
        reported = pipeline.report(result.reports, result.kv_bytes_kept).samples
        for item, output in zip(chunk, batch_outputs(model, batch, result, reported, limit), strict=True):
            output.prompt = item.prompt
            outputs[item.index] = output
    return outputs  # type: ignore[return-value]


def batch_outputs(
    loaded: LoadedModel,
    batch: Batch,
    result: GenerationResult,
    reported: Sequence[dict[str, Any]],
    max_new_tokens: int,
) -> list[Output]:
    """One :class:`Output` per sample of a batch's :class:`GenerationResult` (padding removed; its
    ``prompt`` the prompt's ids until the caller sets it); ``reported``: each sample's fields from
    the pipeline's components (:meth:`kvlab.pipeline.Pipeline.report`); ``max_new_tokens``: the
    run's limit, for the samples without their own."""
    B, T = batch.input_ids.shape
    limits = sample_limits(batch, max_new_tokens).tolist()
    outputs = []
    for b in range(B):
        length = int(result.prompt_lengths[b])
        pad = T - length
        full, kept = int(result.kv_bytes_full[b]), int(result.kv_bytes_kept[b])
        prompt_ids = batch.input_ids[b, pad:].tolist()
        outputs.append(Output(
            prompt=prompt_ids,
            text=loaded.processor.decode(result.tokens[b]),
            token_ids=list(result.tokens[b]),
            max_new_tokens=int(limits[b]),
            prompt_ids=prompt_ids,
            modality=batch.modality[b, pad:].tolist(),
            prompt_tokens=length,
            kept=result.kept[:, b].clone(),
            kv_bytes_full=full,
            kv_bytes_kept=kept,
            kv_ratio=kept / max(full, 1),
            batch_size=B,
            prefill_seconds=result.prefill_seconds / B,
            compression_seconds=result.compression_seconds / B,
            decode_seconds=result.decode_seconds / B,
            reported=reported[b],
            _layers=result.reports,
            _row=b,
            _pad=pad,
        ))  # fmt: skip
    return outputs

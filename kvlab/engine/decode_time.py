"""The ``decode_time`` protocol (``model.protocol: {name: decode_time, ...}``): a ``query_aware``
prefill, then the configured pipeline compresses every layer again during generation, every
``interval`` fed tokens, down to ``target_size`` tokens per head or ``ratio`` of the sample's
prompt + generated tokens (kvpress' ``DecodingPress``; ``docs/protocols.md``). The protocols'
base and registry are in :mod:`kvlab.engine.protocols`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from kvlab.compression.budget import TargetBudget
from kvlab.compression.context import LayerContext
from kvlab.config.errors import ConfigError
from kvlab.engine.decode_positions import EvictionLog
from kvlab.engine.generation import (
    DEFAULT_OPTIONS,
    DecodeResult,
    GenerationResult,
    PrefillState,
    decode,
    generation_result,
    prefill,
)
from kvlab.engine.protocols import PROTOCOLS, WHERE, Protocol, ProtocolResult, cut_at_limits, sample_limits
from kvlab.engine.session import CompressionSession
from kvlab.models.base import PAD, TEXT
from kvlab.pipeline import Pipeline


@dataclass
class DecodeLayerContext(LayerContext):
    """A compressed layer's entries as a :class:`LayerContext` for decode-time compression.

    ``keys``/``values`` ``[B, Hkv, S, D]`` are each sample's stored entries (kept prompt, then
    generated) right-aligned, as a left-padded prompt; ``valid [B, S]``. No query is held:
    the attention the recent window's queries paid to each entry was taken during decoding
    (``observed [B, H, S]``, summed over the last ``observed_window`` decoded tokens, from the
    cache's own decode attention), and :meth:`window_attention_scores` serves it.
    """

    observed: torch.Tensor | None = None
    observed_window: int = 0

    def window_attention_scores(self, window: int) -> torch.Tensor:
        if self.observed is None or window != self.observed_window:
            raise ValueError(
                f"decode-time compression observed the last {self.observed_window} decoded queries, "
                f"not {window}"
            )
        return self.observed

    def window_attention(self, window: int) -> torch.Tensor:
        raise ValueError("decode-time compression keeps the window's summed attention only, not each query's")


@PROTOCOLS.register("decode_time")
@dataclass
class DecodeTime(Protocol):
    """A query-aware prefill, then the pipeline again every ``interval`` fed tokens (for long outputs).

    Each time, every layer keeps ``target_size`` entries per (sample, KV head), or ``ratio`` of
    the sample's prompt + generated tokens, chosen by the configured pipeline among the kept
    prompt entries and the generated ones (kvpress' ``DecodingPress``, with ``compression_steps``
    = ``interval`` and ``token_buffer_size`` = ``target_size``).
    """

    interval: int = 512
    target_size: int | None = None
    ratio: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.interval, bool) or self.interval < 1:
            raise ConfigError(
                f"{WHERE}.interval must be an integer >= 1 (fed tokens between two decode-time "
                f"compressions), got {self.interval!r}."
            )
        if (self.target_size is None) == (self.ratio is None):
            raise ConfigError(
                f"{WHERE}.target_size / {WHERE}.ratio: decode_time needs exactly one of them, got "
                f"target_size={self.target_size}, ratio={self.ratio}. Write e.g. `{{name: decode_time, "
                "interval: 64, target_size: 256}` (tokens per head) or `ratio: 0.5` (of prompt + generated "
                "tokens)."
            )
        if self.target_size is not None and self.target_size < 1:
            raise ConfigError(f"{WHERE}.target_size must be >= 1 (tokens per head), got {self.target_size}.")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ConfigError(
                f"{WHERE}.ratio must be in (0, 1] (the share of prompt + generated tokens kept), got "
                f"{self.ratio}."
            )

    def check(self, pipeline: Pipeline) -> None:
        """Refuse what decode-time compression cannot score or store (see docs/protocols.md).

        The cache holds each (sample, head)'s entries in its own order; the pipeline scores them
        as a left-padded prompt per sample, which is exact when every head of a sample holds
        the same number of entries (uniform head allocation) and the scorers need no query older
        than the recent window (the ``chunked_prefill`` scorers). Modality allocators, routes,
        merging selectors, evicting decode policies and components reading model facts are refused.
        """
        where = f"{WHERE} = decode_time"
        if pipeline.prefill_mode.reconstructs:
            raise ConfigError(
                f"{where} rescores the cache during generation with the pipeline's scorers, and "
                "model.compression.prefill = reconstruct scores only at the prefill, from the model's "
                "reconstruction of the prompt; use `model.protocol: query_agnostic` (KVzip's) or query_aware."
            )
        if pipeline.prefill_mode.progressive:
            raise ConfigError(
                f"{where} compresses one layer's whole cache at a time, and model.compression.prefill = "
                "progressive holds its entries between chunks its own way; use `model.compression.prefill: "
                "{name: once}` with decode_time, or `model.protocol: query_aware`."
            )
        if not pipeline.compresses or pipeline.budget is None:
            raise ConfigError(
                f"{where} compresses with the configured pipeline, but model.compression has no scorer (the "
                "full cache). Choose a method, e.g. `--config knorm` or `--config snapkv`."
            )
        if pipeline.route_rule is not None:
            raise ConfigError(
                f"{where}: routed pipelines (model.compression.route) are not supported at decode time; use "
                "one without `route`, or `model.protocol: query_aware`."
            )
        comparing = pipeline.capabilities.comparing_layers
        if comparing:
            raise ConfigError(
                f"{where}: {comparing[0].field} ({comparing[0].name}) "
                "compares every layer and needs model.compression.schedule: global, but decode-time "
                "compression compresses one layer at a time. Use a component that needs only its own layer "
                "(for PrefixKV: prefix_calibrated with model.compression.schedule: layerwise), or "
                "`model.protocol: query_aware`."
            )
        refused = {
            "allocate.head": (pipeline.head_allocator, "uniform", "per-head budgets make heads hold "
                              "different numbers of entries, which decode-time scoring does not support"),
            "allocate.modality": (pipeline.modality_allocator, "none", "the generated tokens have no "
                                  "modality groups"),
            "select": (pipeline.selector, "topk", "merged entries cannot be written back at decode time"),
            "decode": (pipeline.decode_policy, "none", "it evicts at every step itself (the per-step "
                       "alternative to decode_time)"),
        }  # fmt: skip
        for slot, (component, allowed, why) in refused.items():
            name = getattr(component, "registry_name", allowed)
            if name != allowed:
                raise ConfigError(
                    f"{where}: model.compression.{slot} = {name} is not supported ({why}); use `{allowed}` "
                    f"there, or `model.protocol: query_aware`."
                )
        if pipeline.quantizer is not None:
            raise ConfigError(
                f"{where}: model.compression.quantize ({pipeline.quantizer.registry_name}) stores the kept "
                "entries as packed codes, which decode-time compression cannot rescore and rewrite at every "
                "step. Use `model.protocol: query_aware` (or query_agnostic), or remove "
                "model.compression.quantize."
            )
        if pipeline.channel_pruner is not None:
            raise ConfigError(
                f"{where}: model.compression.channels ({pipeline.channel_pruner.registry_name}) stores the "
                "kept prompt keys with fewer channels than the generated tokens', which decode-time "
                "compression rescores and rewrites together at every step. Use `model.protocol: "
                "query_aware` (or query_agnostic), or remove model.compression.channels."
            )
        readers = pipeline.capabilities.model_facts
        if readers:
            fact, who = next(iter(readers.items()))
            raise ConfigError(
                f"{where}: {who} reads the model fact '{fact}', which decode-time compression does not "
                "provide (it scores the cache's entries, kept prompt and generated tokens alike, without the "
                "positions and inputs the prefill had). Use `model.protocol: query_aware`, or a component "
                "reading no model facts."
            )
        observers = []
        for role, scorer in [*pipeline.importance.items(), *pipeline.diversity.items()]:
            kind = "importance" if role in pipeline.importance else "diversity"
            name = getattr(scorer, "registry_name", type(scorer).__name__)
            if not scorer.capabilities.chunked_prefill:
                raise ConfigError(
                    f"{where}: model.compression.{kind}.{role} ({name}) needs the attention of queries older "
                    "than the recent window, which decode-time compression does not keep (it observes only "
                    "the last budget.window decoded tokens). Use scorers of keys, values, positions or the "
                    "window's attention (window_attention, key_norm, value_norm, recency, random, keydiff, "
                    "mean_key_diversity), or `model.protocol: query_aware`."
                )
            if "window" in scorer.budget_settings.values():
                observers.append(f"model.compression.{kind}.{role}")
        budget = pipeline.budget
        if observers and (budget.window_is_ratio or budget.max_window_share is not None):
            raise ConfigError(
                f"{where}: {observers[0]} observes model.compression.budget.window, which must be a fixed "
                "number of tokens without max_window_share at decode time (the observed queries are the last "
                "`window` decoded tokens). Write `budget.window` as an integer and drop max_window_share."
            )
        if observers and self.interval < int(budget.window):
            raise ConfigError(
                f"{WHERE}.interval = {self.interval} is below model.compression.budget.window = "
                f"{int(budget.window)}, which {observers[0]} observes: the observed queries must all be "
                f"decoded tokens. Raise {WHERE}.interval to at least {int(budget.window)}."
            )
        protected = int(budget.window) + budget.sinks if not budget.window_is_ratio else budget.sinks
        if self.target_size is not None and self.target_size < protected:
            raise ConfigError(
                f"{WHERE}.target_size = {self.target_size} is below the protected tokens of "
                f"model.compression.budget (window + sinks = {protected}), which are always kept. Raise "
                f"target_size to at least {protected}."
            )

    def observed_window(self, pipeline: Pipeline) -> int:
        """Decoded queries whose attention the compression observes (0 when no scorer observes any)."""
        observes = any(
            "window" in s.budget_settings.values()
            for s in [*pipeline.importance.values(), *pipeline.diversity.values()]
        )
        return int(pipeline.budget.window) if observes and pipeline.budget is not None else 0

    def targets(self, logical: torch.Tensor) -> torch.Tensor:
        """``[B]`` entries per head to keep for samples of ``logical`` prompt + generated tokens."""
        if self.target_size is not None:
            return torch.full_like(logical, self.target_size)
        return torch.floor(logical.double() * self.ratio).long()

    def run(self, loaded, pipeline, batch, options=DEFAULT_OPTIONS) -> ProtocolResult:
        limits = sample_limits(batch, options.max_new_tokens)
        steps = int(limits.max())
        state = prefill(loaded, pipeline, batch, min(steps, self.interval), options)
        prefill_kept = torch.stack([report.kept for report in state.session.reports])  # [L, B, Hkv]
        log = EvictionLog(state.session.reports, state.session.valid) if options.record_positions else None
        compressor = DecodeTimeCompressor(self, pipeline, state, log=log)
        compressor.start()
        teacher, step = options.teacher_tokens, compressor.after_step
        decoded = decode(state, steps, options.return_logits, teacher, limits=limits, on_step=step)
        compressor.finish()
        result = _decode_time_result(state, decoded, prefill_kept)
        result.tokens = cut_at_limits(result.tokens, limits, teacher)
        extras, produced = [], []
        for b, row in enumerate(result.tokens):
            produced.append(min(len(row) + 1, int(limits[b])))  # its tokens, the stop token included
            events = [(g, kept) for g, kept in compressor.events if g < produced[b] - 1]  # before its last
            extras.append(
                {
                    "decode_compressions": len(events),
                    "decode_kept_per_layer_head": events[-1][1][:, b].tolist() if events else None,
                    "decode_compression_seconds": compressor.seconds / len(result.tokens),
                }
            )
        positions = log.samples(produced) if log is not None else None
        return ProtocolResult(result, extras, decode_positions=positions)


def _decode_time_result(
    state: PrefillState, decoded: DecodeResult, prefill_kept: torch.Tensor
) -> GenerationResult:
    """:func:`generation_result` with the prefill's kept counts (the cache's prompt region now also holds
    generated entries kept by decode-time compression)."""
    result = generation_result(state, decoded)
    per_token = state.loaded.info.head_dim * 2 * state.cache.layers[0].prompt_keys.element_size()
    result.kept = prefill_kept.cpu()
    result.kv_bytes_kept = result.kept.sum(dim=(0, 2)) * per_token
    return result


@dataclass
class DecodeTimeCompressor:
    """The decode-time compression of one batch: hooked into :func:`decode` (``on_step``).

    After every fed step it adds the step's decode attention to each layer's window sums while the
    step is among the last ``window`` before a compression, and every ``interval`` fed tokens it
    compresses every layer (:meth:`compress_layer`). Positions never move: the cache keeps each
    entry's RoPE, and decoding continues from the logical length.
    """

    protocol: DecodeTime
    pipeline: Pipeline
    state: PrefillState
    #: one ``(fed tokens, entries [L, B, Hkv] kept per layer and head)`` per compression
    events: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    #: ``model.record_positions``: follows the positions each compression keeps and removes
    log: EvictionLog | None = None
    seconds: float = 0.0
    _fed: int = 0  # tokens fed since the last compression
    _generated: int = 0
    _sums: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def session(self) -> CompressionSession:
        return self.state.session

    @property
    def window(self) -> int:
        return self.protocol.observed_window(self.pipeline)

    def start(self) -> None:
        """Before the first decode step: capture its attention if it is already in a window."""
        self._capture_next()

    def _capture_next(self) -> None:
        """Ask the attention function for the next step's attention when that step is observed."""
        observed = self.window > 0 and self._fed + 1 > self.protocol.interval - self.window
        self.session.run.want_decode_attention(self, observed)

    def after_step(self, step: int) -> None:
        """One more token is in every layer: add its attention, compress when ``interval`` is reached."""
        self._fed += 1
        self._generated += 1
        if self.session.run.records_decode_attention:
            for layer_idx, probs in self.session.run.take_decode_attention().items():  # [B, Hkv, G, 1, S_t]
                step_sum = probs.sum(3)
                held = self._sums.get(layer_idx)
                if held is not None and held.shape[-1] < step_sum.shape[-1]:
                    held = torch.nn.functional.pad(held, (0, step_sum.shape[-1] - held.shape[-1]))
                self._sums[layer_idx] = (
                    step_sum
                    if held is None
                    else held + torch.nn.functional.pad(step_sum, (0, held.shape[-1] - step_sum.shape[-1]))
                )
        if self._fed == self.protocol.interval:
            start = time.perf_counter()
            for layer_idx in range(len(self.session.cache.layers)):
                self.compress_layer(layer_idx)
            self.seconds += time.perf_counter() - start
            self.events.append((self._generated, self.session.cache.kept_tokens().cpu()))
            if self.log is not None:
                self.log.event(self._generated)
            self._fed = 0
            self._sums.clear()
        self._capture_next()

    def finish(self) -> None:
        """After decoding: stop capturing attention."""
        self.session.run.want_decode_attention(self, False)

    def compress_layer(self, layer_idx: int) -> None:
        """Compress layer ``layer_idx``'s prompt and generated entries to the protocol's target."""
        layer = self.session.cache.layers[layer_idx]
        lengths = layer.lengths  # [B, Hkv]
        n = lengths[:, 0]
        if bool((lengths != n[:, None]).any()):
            raise RuntimeError(
                "decode_time needs every head of a sample to hold the same entries (uniform head allocation)"
            )
        K, dl = layer.prompt_slots, layer.decode_length
        S = K + dl
        B, Hkv = lengths.shape
        device = lengths.device
        j = torch.arange(S, device=device)[None, :]
        first = (K - n)[:, None]  # [B, 1] the sample's first real column (right-aligned prompt)
        valid = j >= first
        slot = torch.where(j < K, j - first, j)  # prompt column -> its prompt slot, decode columns stay
        slot = torch.where(valid, slot, S)  # padding -> a spare slot
        rows, _ = layer.slot_rows()
        keys = torch.cat([layer.prompt_keys[rows], layer.decode_keys[:, :, :dl]], 2)  # [B, Hkv, S, D]
        values = torch.cat([layer.prompt_values[rows], layer.decode_values[:, :, :dl]], 2)
        gather = slot.clamp(max=S - 1)[:, None, :, None]
        keys = keys.gather(2, gather.expand(-1, Hkv, -1, keys.shape[-1]))
        values = values.gather(2, gather.expand(-1, Hkv, -1, values.shape[-1]))
        observed = None
        window = self.window
        if window:
            sums = self._sums[layer_idx][..., :S]  # [B, Hkv, G, S] in the slot layout
            G = sums.shape[2]
            observed = sums.gather(3, slot.clamp(max=S - 1)[:, None, None, :].expand(-1, Hkv, G, -1))
            observed = (observed * valid[:, None, None, :]).reshape(B, Hkv * G, S)  # query head kv * G + g
        modality = torch.full((B, S), TEXT, dtype=torch.long, device=device).masked_fill(~valid, PAD)
        H = observed.shape[1] if observed is not None else Hkv
        ctx = DecodeLayerContext(
            layer_idx=layer_idx,
            num_layers=len(self.session.cache.layers),
            queries=keys.new_empty(B, H, 0, keys.shape[-1]),
            keys=keys,
            values=values,
            valid=valid,
            modality=modality,
            scaling=keys.shape[-1] ** -0.5,
            observed=observed,
            observed_window=window,
        )
        logical = self.state.session.valid.sum(-1).to(device) + self._generated
        budget = TargetBudget(
            tokens=None,
            ratio=None,
            window=self.pipeline.budget.window,
            sinks=self.pipeline.budget.sinks,
            max_window_share=self.pipeline.budget.max_window_share,
            targets=self.protocol.targets(logical),
        )
        selection, _ = dataclasses.replace(self.pipeline, budget=budget).compress(ctx)
        kept = selection.kept_mask(S)  # [B, Hkv, S] in the right-aligned layout
        keep = torch.zeros(B, Hkv, S + 1, dtype=torch.bool, device=device)
        keep.scatter_(2, slot[:, None, :].expand(-1, Hkv, -1), kept & valid[:, None, :])
        if self.log is not None:
            self.log.compressed(layer_idx, keep[..., :S], self._generated, dl)
        layer.keep_slots(keep[..., :S])

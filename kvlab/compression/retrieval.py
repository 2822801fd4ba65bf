"""Chunk retrieval: the ``retrieve`` selector and the store it leaves beside the compressed cache.

A retrieving (sample, KV head) keeps its prompt K/V off the accelerator and fetches, at every
decode step, the chunks its current query points at (HybridKV's dynamic heads, Zeng et al. 2026,
"HybridKV: Hybrid KV Cache Compression for Efficient Multimodal Large Language Model
Inference", Sec. 3.3 and Appendix A; the chunk-wise retrieval of Quest and ShadowKV):

- at prefill the head's tokens are split into contiguous ``chunk``-token chunks (in the
  sample's own order; the last chunk may be partial), each chunk is summarised by the selector's
  ``index`` (:mod:`kvlab.compression.retrieval_index`: by default ``mean_key``, the mean key of
  each chunk ``kbar_c = mean_{j in c} k_j``, post-RoPE keys, a partial chunk averaged over its
  tokens; ``key_bounds``, Quest's per-channel min and max) into an index kept on the layer's
  device, and the head's K/V go to host memory: pinned when the layer sits on CUDA, ordinary
  memory on a CPU-only machine (the same code path);
- at each decode step every retrieving head ranks its chunks by the index against the step's
  query (``qbar . kbar_c`` for ``mean_key``, ``qbar`` the mean of the GQA group's queries: one
  selection per KV head), takes the top ``budget // chunk`` chunks, fetches them from the host
  into a device buffer and attends over them together with the head's local entries (what the
  compressed cache holds for it: the tokens generated so far, and the protected prompt tokens
  with ``local: protected``), in one softmax.

Kernels: :mod:`kvlab.kernels.retrieval` (scoring + exact top-k, gather; Triton on CUDA). The
store implements :class:`~kvlab.cache.selection.OffloadedStore`: the layer hands it every
decode call, and it answers for all heads of the layer (a head that does not retrieve attends
to its local entries only). Budget semantics, accounting and choices: ``docs/methods/hybridkv.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext
from kvlab.compression.retrieval_index import RETRIEVAL_INDEXES, RetrievalIndex
from kvlab.compression.selectors import SELECTORS, Selector, topk_indices
from kvlab.config import papers
from kvlab.config.capabilities import Outcome, RecordField, Report
from kvlab.config.errors import ConfigError
from kvlab.kernels.decode_attention import SegmentRuns, ragged_decode_attention, reads_in_place
from kvlab.kernels.retrieval import gather_chunks

NEG_INF = float("-inf")


@SELECTORS.register("retrieve")
@dataclass
class RetrieveSelector(Selector):
    """Retrieve: K/V off the accelerator, the top ``count // chunk`` chunks fetched per decode step.

    Per (sample, KV head) with ``count`` tokens of budget (protected included) and ``n`` prompt
    tokens: ``count >= n`` keeps the head whole in the cache (nothing to retrieve, HybridKV's
    "b_dyn >= C"). Otherwise the head holds locally its protected tokens (``local: protected``:
    the +inf entries of the scores, i.e. ``budget.window`` and sinks) or nothing (``local: none``,
    HybridKV's dynamic heads: only the index is resident), and retrieves ``(count - local) //
    chunk`` whole chunks of the remaining tokens at every step (the rest of a budget that is not a
    multiple of ``chunk`` is not used; HybridKV's power-of-two budgets are multiples of 8). A budget
    that leaves less than one chunk beyond the local tokens (short prompts at small ratios: the
    ``retrieval`` preset's 20 local tokens and chunks of 8 below ~280 prompt tokens at 10%)
    retrieves nothing: the head attends to its local tokens alone, as an evicting method with that
    budget would; its ``retrieval_heads_per_layer`` entry still counts it and its fetched bytes are
    0, so the predictions show it. Scores
    are not read otherwise: retrieval ranks chunks by the decode query, not by prefill scores.
    Under a per-head route only the heads routed to this branch are offloaded
    (``ctx.routed_heads``); the other rows of this selection are discarded by the route.
    ``index``: the chunk summaries and their ranking, a :data:`RETRIEVAL_INDEXES
    <kvlab.compression.retrieval_index.RETRIEVAL_INDEXES>` node (``mean_key``, the default, or
    Quest's ``key_bounds``).
    """

    paper: ClassVar[str | None] = papers.HYBRIDKV
    offloads: ClassVar[bool] = True
    # a sliding-window layer's decode would need the window over retrieved positions
    compresses_sliding_layers: ClassVar[bool] = False
    record_fields: ClassVar[dict[str, RecordField]] = {
        "retrieval_heads_per_layer": RecordField("[L] KV heads that retrieve at decode"),
        "retrieval_bytes_per_step_per_layer": RecordField("[L] K/V bytes fetched per decode step"),
        "retrieval_bytes_per_step": RecordField("the same, summed over the layers"),
        "kv_bytes_device": RecordField("resident prompt K/V: kept, chunk index, fetch buffer"),
        "kv_bytes_offloaded": RecordField("K/V held in host memory"),
    }  # fmt: skip

    chunk: int = 8
    local: Literal["none", "protected"] = "none"
    index: dict[str, Any] = field(default_factory=lambda: {"name": "mean_key"})
    part_registries: ClassVar[dict[str, Any]] = {"index": RETRIEVAL_INDEXES}

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1 token, got {self.chunk}")
        self._index = RETRIEVAL_INDEXES.build(self.index, "model.compression.select.index")

    def parts(self) -> dict[str, Any]:
        return {"index": self._index}

    def report(self, outcome: Outcome) -> Report:
        """Each sample's retrieving heads and fetched bytes per layer, its device and host bytes
        (the figures of :meth:`ChunkStore.sample_figures`; 0 at a layer that offloaded nothing)."""
        stores = [r.selection.offloaded if r.selection is not None else None for r in outcome.layers]
        empty = {"heads": 0, "device_bytes": 0, "offloaded_bytes": 0, "moved_per_step": 0.0}
        samples = []
        for b, kept in enumerate(outcome.kv_bytes_kept.tolist()):
            figures = [empty if s is None else s.sample_figures(b) for s in stores]
            moved = [f["moved_per_step"] for f in figures]
            samples.append({
                "retrieval_heads_per_layer": [f["heads"] for f in figures],
                "retrieval_bytes_per_step_per_layer": moved,
                "retrieval_bytes_per_step": sum(moved),
                "kv_bytes_device": int(kept) + sum(f["device_bytes"] for f in figures),
                "kv_bytes_offloaded": sum(f["offloaded_bytes"] for f in figures),
            })  # fmt: skip
        return Report(samples)

    def select(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> Selection:
        valid = ctx.valid[:, None, :].expand_as(scores)  # [B, Hkv, T]
        lengths = ctx.lengths
        retrieve = counts < lengths[:, None]  # [B, Hkv]: the budget does not cover the prompt
        routed = ctx.routed_heads  # a per-head route keeps only its heads' rows of this selection
        if routed is not None:
            retrieve = retrieve & routed.to(retrieve.device)
        if ctx.sliding_window is not None and bool(retrieve.any()):
            raise ConfigError(
                "model.compression.select 'retrieve' cannot serve a sliding-window layer (its decode "
                "attention would need the window over retrieved positions): keep "
                "model.compression.sliding_layers: window (the default): those layers keep their window."
            )
        held = valid & (scores == float("inf")) if self.local == "protected" else torch.zeros_like(valid)
        keep_whole = counts >= lengths[:, None]
        local = torch.where(retrieve[..., None] | ~keep_whole[..., None], held, valid)
        local_counts = local.sum(-1)
        indices = topk_indices(torch.where(local, 0.0, NEG_INF), local_counts)
        rows = retrieve.nonzero()  # [R, 2]
        if rows.shape[0] == 0:
            return Selection(indices=indices, counts=local_counts)
        fetch = ((counts - local_counts)[rows[:, 0], rows[:, 1]] // self.chunk).clamp(min=0)
        region = (valid & ~local)[rows[:, 0], rows[:, 1]]  # [R, T]
        store = ChunkStore.build(ctx.keys, ctx.values, rows, region, fetch, self.chunk, self._index)
        return Selection(indices=indices, counts=local_counts, offloaded=store)


@dataclass
class ChunkStore:
    """Host K/V and device chunk index of the retrieving (sample, KV head) rows of one layer.

    Shapes: R retrieving rows, NC chunks, M = NC * chunk token slots, D head dim.

    Attributes:
        rows: ``[R, 2]`` long, (sample, KV head) of each row (device).
        index: ``[R, NC, ...]`` the chunk summaries of :attr:`ranker` (``mean_key``: ``[R, NC, D]``
            mean keys), in the keys' dtype (device).
        chunk_valid: ``[R, NC]`` bool, chunks holding at least one token (device).
        token_valid: ``[R, M]`` bool, real token slots (device).
        n_sel: ``[R]`` long, chunks fetched per step (device).
        host_keys / host_values: ``[R, M, D]`` the rows' tokens in chunk order (host memory;
            pinned when the layer is on CUDA). Slot ``j`` of row ``r`` is its ``j``-th token.
        chunk: tokens per chunk.
        batch_size / num_kv_heads: the layer's B and Hkv.
        ranker: the retrieval index that built :attr:`index` and ranks the chunks at decode.
        moved: ``[B]`` long, bytes fetched so far per sample (device, no sync per step).
        steps: decode calls served.
    """

    rows: torch.Tensor
    index: torch.Tensor
    chunk_valid: torch.Tensor
    token_valid: torch.Tensor
    n_sel: torch.Tensor
    host_keys: torch.Tensor
    host_values: torch.Tensor
    chunk: int
    batch_size: int
    num_kv_heads: int
    ranker: RetrievalIndex
    moved: torch.Tensor = field(default=None)  # type: ignore[assignment]
    steps: int = 0

    def __post_init__(self) -> None:
        if self.moved is None:
            self.moved = torch.zeros(self.batch_size, dtype=torch.long, device=self.rows.device)
        self._rows = [tuple(r) for r in self.rows.tolist()]
        self._fetch = self.n_sel.tolist()
        NC = self.index.shape[1]
        self.width = min(max(self._fetch, default=0), NC)
        retrieving = set(self._rows)
        others = [
            (b, h)
            for b in range(self.batch_size)
            for h in range(self.num_kv_heads)
            if (b, h) not in retrieving
        ]
        # [R', 2] the (sample, KV head) rows that attend to their cached entries alone
        self.local_rows = torch.tensor(others, dtype=torch.long, device=self.rows.device).view(-1, 2)
        self._local_runs: tuple[torch.Tensor, torch.Tensor, SegmentRuns] | None = None

    @classmethod
    def build(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
        region: torch.Tensor,
        n_sel: torch.Tensor,
        chunk: int,
        ranker: RetrievalIndex,
    ) -> ChunkStore:
        """Chunk the ``region [R, T]`` tokens of each row of ``keys/values [B, Hkv, T, D]`` in order
        and summarise the chunks with ``ranker``."""
        B, Hkv, T, D = keys.shape
        R = rows.shape[0]
        counts = region.sum(-1)  # [R]
        M = -(-max(int(counts.max()), 1) // chunk) * chunk
        positions = topk_indices(torch.where(region, 0.0, NEG_INF)[:, None], counts[:, None])[:, 0]
        positions = torch.nn.functional.pad(positions, (0, M - positions.shape[-1]))  # [R, M]
        token_valid = torch.arange(M, device=keys.device) < counts[:, None]
        gather = positions[..., None].expand(-1, -1, D)
        host = {}
        for name, source in (("keys", keys), ("values", values)):
            rows_kv = source[rows[:, 0], rows[:, 1]].gather(1, gather)  # [R, M, D]
            host[name] = rows_kv.masked_fill(~token_valid[..., None], 0)
        per_chunk = token_valid.view(R, M // chunk, chunk)
        index = ranker.summarise(host["keys"].view(R, M // chunk, chunk, D), per_chunk)
        pinned = keys.is_cuda
        return cls(
            rows=rows,
            index=index,
            chunk_valid=per_chunk.any(-1),
            token_valid=token_valid,
            n_sel=n_sel.to(torch.long),
            host_keys=_to_host(host["keys"], pinned),
            host_values=_to_host(host["values"], pinned),
            chunk=chunk,
            batch_size=B,
            num_kv_heads=Hkv,
            ranker=ranker,
        )

    # --- decode ----------------------------------------------------------------------------
    def decode_attention(self, layer: Any, query: torch.Tensor, scaling: float, options: Any) -> torch.Tensor:
        """Attention of ``query [B, H, q, D]`` over the layer's local entries, plus the fetched chunks
        of the retrieving heads -> ``[B, H, q, D]`` (see the module docstring)."""
        if options is not None and not options.plain:
            raise ConfigError(
                f"retrieval (model.compression.select 'retrieve') on a layer with {options.describe()}: "
                "soft-capping, sinks and sliding windows are not implemented for retrieved chunks. Use "
                "an eviction selector (e.g. topk) for this model."
            )
        out = self._local_attention(layer, query, scaling)  # the other rows are written below
        B, H, q, D = query.shape
        Hkv = self.num_kv_heads
        G = H // Hkv
        ids = self.ranker.topk(query, self.index, self.rows, self.chunk_valid, self.n_sel, Hkv, self.width)
        keys, values = gather_chunks(self.host_keys, self.host_values, ids, self.chunk, query.device)
        R, S = ids.shape[0], ids.shape[-1]
        tokens = ids.clamp(min=0)[..., None] * self.chunk + torch.arange(self.chunk, device=ids.device)
        fetched = self.token_valid.gather(1, tokens.reshape(R, -1)).view(R, q, S * self.chunk)
        fetched = fetched & (ids >= 0).repeat_interleave(self.chunk, -1)
        per_token = D * 2 * self.host_keys.element_size()
        self.moved.index_add_(0, self.rows[:, 0], fetched.sum((1, 2)) * per_token)
        self.steps += 1
        attended = self._attend(layer, query, scaling, keys, values, fetched)  # [R, G, q, D]
        out.view(B, Hkv, G, q, D)[self.rows[:, 0], self.rows[:, 1]] = attended.to(out.dtype)
        return out

    def _local_attention(self, layer: Any, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """``[B, H, q, D]``: the decode attention of the rows that do not retrieve (:attr:`local_rows`)
        over their cached entries; the retrieving rows are left unwritten (their attention, local
        entries included, is :meth:`_attend`'s). The local rows run as a batch of ``R'`` samples of
        one KV head each through :func:`~kvlab.kernels.decode_attention.ragged_decode_attention`
        (their segments read in place, their decode entries gathered): no attention is computed
        for a row that is then overwritten."""
        B, H, q, D = query.shape
        Hkv = self.num_kv_heads
        out = query.new_empty(B, H, q, D)
        if self.local_rows.shape[0] == 0:
            return out
        b, h = self.local_rows[:, 0], self.local_rows[:, 1]
        dl = layer.decode_length
        starts, lengths = layer.starts[b, h][:, None], layer.lengths[b, h][:, None]  # [R', 1]
        runs = None
        if reads_in_place(query):  # the in-place torch path's strided runs, kept per segment layout
            held = self._local_runs
            if held is None or held[0] is not layer.starts or held[1] is not layer.lengths:
                held = self._local_runs = (layer.starts, layer.lengths, SegmentRuns.of(starts, lengths))
            runs = held[2]
        local = ragged_decode_attention(
            query.view(B, Hkv, H // Hkv, q, D)[b, h],  # [R', G, q, D]: R' samples of one KV head
            layer.prompt_keys,
            layer.prompt_values,
            starts,
            lengths,
            layer.decode_keys[:, :, :dl][b, h][:, None],  # [R', 1, dl, D]
            layer.decode_values[:, :, :dl][b, h][:, None],
            dl,
            scaling,
            layer.max_prompt_length,
            decode_valid=layer.decode_valid[b] if layer.decode_valid is not None else None,
            runs=runs,
        )
        out.view(B, Hkv, H // Hkv, q, D)[b, h] = local
        return out

    def _attend(
        self,
        layer: Any,
        query: torch.Tensor,
        scaling: float,
        keys: torch.Tensor,
        values: torch.Tensor,
        fetched: torch.Tensor,
    ) -> torch.Tensor:
        """One softmax per retrieving row over its local and fetched entries, ``[R, G, q, D]`` fp32.

        Local entries: the row's kept prompt entries and its decode region (query ``i`` of ``q``
        sees decode slots up to its own, padding entries of a padded block hidden), read through
        the layer's ``slot_rows``, ``prompt_*``, ``decode_*`` and ``decode_valid``.
        """
        B, H, q, D = query.shape
        Hkv = self.num_kv_heads
        b, h = self.rows[:, 0], self.rows[:, 1]
        qr = query.float().view(B, Hkv, H // Hkv, q, D)[b, h]  # [R, G, q, D]
        slots, slot_ok = layer.slot_rows()  # [B, Hkv, K]
        width = self._local_width(layer)  # the retrieving rows' longest local prompt (often 0)
        slots, slot_ok = slots[b, h, :width], slot_ok[b, h, :width]
        prompt_k = layer.prompt_keys[slots].float()  # [R, K, D]
        prompt_v = layer.prompt_values[slots].float()
        dl = layer.decode_length
        decode_k = layer.decode_keys[b, h, :dl].float()  # [R, dl, D]
        decode_v = layer.decode_values[b, h, :dl].float()
        slot = torch.arange(dl, device=query.device)
        own = dl - q + torch.arange(q, device=query.device)  # [q]
        seen = (slot[None, :] <= own[:, None])[None]  # [1, q, dl]
        if layer.decode_valid is not None:
            seen = seen & (layer.decode_valid[b, None, :dl] | (slot[None, :] == own[:, None])[None])
        logits = [
            torch.einsum("rgqd,rkd->rgqk", qr, prompt_k).masked_fill(~slot_ok[:, None, None, :], NEG_INF),
            torch.einsum("rgqd,rtd->rgqt", qr, decode_k).masked_fill(~seen[:, None], NEG_INF),
            torch.einsum("rgqd,rqtd->rgqt", qr, keys.float()).masked_fill(~fetched[:, None], NEG_INF),
        ]
        K = prompt_k.shape[1]
        probs = torch.softmax(torch.cat(logits, -1) * scaling, -1)
        return (
            probs[..., :K] @ prompt_v[:, None]
            + probs[..., K : K + dl] @ decode_v[:, None]
            + torch.einsum("rgqt,rqtd->rgqd", probs[..., K + dl :], values.float())
        )

    def _local_width(self, layer: Any) -> int:
        """The longest local prompt segment among the retrieving rows (one host sync per layer
        buffer: recomputed only when the layer replaces its ``lengths``)."""
        if getattr(self, "_width_of", None) is not layer.lengths:
            lengths = layer.lengths[self.rows[:, 0], self.rows[:, 1]]
            self._width = int(lengths.max()) if lengths.numel() else 0
            self._width_of = layer.lengths
        return self._width

    # --- routing and accounting -------------------------------------------------------------
    def restrict(self, keep: torch.Tensor) -> ChunkStore | None:
        """The store of the rows whose (sample, head) ``keep [B, Hkv]`` marks (None when none is left).

        A route combining branches row by row keeps each branch's store for its own rows only.
        """
        mask = keep.to(self.rows.device)[self.rows[:, 0], self.rows[:, 1]]
        if bool(mask.all()):
            return self
        if not bool(mask.any()):
            return None
        return ChunkStore(
            rows=self.rows[mask],
            index=self.index[mask],
            chunk_valid=self.chunk_valid[mask],
            token_valid=self.token_valid[mask],
            n_sel=self.n_sel[mask],
            host_keys=_to_host(self.host_keys[mask.cpu()], self.host_keys.is_pinned()),
            host_values=_to_host(self.host_values[mask.cpu()], self.host_values.is_pinned()),
            chunk=self.chunk,
            batch_size=self.batch_size,
            num_kv_heads=self.num_kv_heads,
            ranker=self.ranker,
        )

    def retrieval_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (sample, KV head), ``[B, Hkv]`` long each (0 for heads that do not retrieve):

        - ``fetched``: token slots fetched per decode step, ``min(n_sel, chunks) * chunk`` (the
          step's device buffer; a partial last chunk counts whole). With the head's resident
          entries this is its on-device budget;
        - ``stored``: prompt tokens in the host store (with the resident ones: the whole prompt).
        """
        B, Hkv = self.batch_size, self.num_kv_heads
        chunks = self.chunk_valid.sum(-1)  # [R]
        fetched = torch.minimum(self.n_sel.to(chunks.device), chunks) * self.chunk
        out = []
        for per_row in (fetched, self.token_valid.sum(-1)):
            grid = torch.zeros(B, Hkv, dtype=torch.long, device=self.rows.device)
            grid[self.rows[:, 0], self.rows[:, 1]] = per_row.to(torch.long)
            out.append(grid)
        return out[0], out[1]

    def _device_row_bytes(self) -> list[int]:
        """Device bytes per row: its index, masks and fetch count, and the buffer one step fills."""
        NC, M, D = self.index.shape[1], self.token_valid.shape[1], self.host_keys.shape[2]
        fixed = math.prod(self.index.shape[1:]) * self.index.element_size() + NC + M + 8 + 16
        per_token = D * 2 * self.host_keys.element_size()
        return [fixed + min(n, NC) * self.chunk * per_token for n in self._fetch]

    def device_bytes(self) -> int:
        """Bytes on the layer's device: chunk index, masks, and the buffer of one step's fetched chunks."""
        return sum(self._device_row_bytes())

    def offloaded_bytes(self) -> int:
        """Bytes of the host store (keys and values of every retrieving row)."""
        return sum(t.numel() * t.element_size() for t in (self.host_keys, self.host_values))

    def for_samples(self, rows: torch.Tensor) -> SampleFigures:
        """The store's figures for a batch whose sample ``b`` was compressed as row ``rows[b]`` of
        this store's batch (the context protocols: a context compressed alone, for one or several
        questions); read by :meth:`RetrieveSelector.report`."""
        return SampleFigures(self, rows.tolist())

    def sample_figures(self, b: int) -> dict[str, float]:
        """Sample ``b``'s retrieving heads, device bytes, host bytes and bytes fetched per decode step."""
        mine = [i for i, (s, _) in enumerate(self._rows) if s == b]
        device = self._device_row_bytes()
        host_row = self.offloaded_bytes() // max(len(self._rows), 1)
        moved = float(self.moved[b]) / self.steps if self.steps else 0.0
        return {
            "heads": len(mine),
            "device_bytes": sum(device[i] for i in mine),
            "offloaded_bytes": host_row * len(mine),
            "moved_per_step": moved,
        }


@dataclass(frozen=True)
class SampleFigures:
    """A :class:`ChunkStore`'s figures as another batch's samples see them: sample ``b`` reads the
    store's row ``contexts[b]`` (a report's view: it serves no decode step)."""

    store: ChunkStore
    contexts: list[int]

    def sample_figures(self, b: int) -> dict[str, float]:
        """:meth:`ChunkStore.sample_figures` of sample ``b``'s context."""
        return self.store.sample_figures(self.contexts[b])

    def device_bytes(self) -> int:
        return self.store.device_bytes()

    def offloaded_bytes(self) -> int:
        return self.store.offloaded_bytes()

    def for_samples(self, rows: torch.Tensor) -> SampleFigures:
        return SampleFigures(self.store, [self.contexts[r] for r in rows.tolist()])

    def decode_attention(self, layer: Any, query: torch.Tensor, scaling: float, options: Any) -> torch.Tensor:
        raise TypeError("SampleFigures is a report's view of a chunk store; the store itself serves decode")


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A host copy of ``tensor`` (page-locked when ``pinned``, so the device can read it directly)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
    out.copy_(tensor)
    return out

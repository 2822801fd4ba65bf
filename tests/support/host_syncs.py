"""Count the device-to-host reads (host synchronisations on a GPU) a block of code makes, on CPU.

On CUDA a read of device data by the host (``.item()``, ``bool(tensor)``, ``.tolist()``,
``nonzero``, a boolean-mask index, ...) waits for every queued kernel: in the decode loop each
one stalls the GPU once per call. A CPU run has no such stall, so nothing shows it there; this
module counts the calls that *would* synchronise on a GPU, so a CPU test can bound them.

How (:class:`HostSyncs`): a ``TorchDispatchMode`` sees every aten op the block runs and counts
the ones whose result size or value the host must read (:data:`READ_OPS`, boolean-mask
``index`` / ``index_put_``, ``repeat_interleave`` without ``output_size``); the Python-level
methods that read data without an aten op (``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu``)
are wrapped for the block. ``bool()``, ``int()``, ``float()`` and ``.item()`` all reach
``_local_scalar_dense``. Not counted: ``.to(device)`` (on a CPU run every device is the CPU, so a
copy to the host cannot be told from a no-op) and host-to-device uploads of Python data
(``torch.tensor(list)`` lifts appear separately as ``upload`` events, not as reads). On a GPU
``torch.cuda.set_sync_debug_mode`` counts the real synchronisations (tests/gpu).

Each event records its origin: the innermost frame in kvlab's own source (``kvlab/``,
``kernels/``) or, when the read happens inside transformers, ``transformers/<file>:<line>``.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.paths import REPO

aten = torch.ops.aten
KVLAB_DIRS = (str(REPO / "kvlab"), str(REPO / "kernels"))

#: aten ops whose output the host must read (a scalar's value or a data-dependent size)
READ_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.equal.default,
    aten.bincount.default,
}
#: Python methods that hand tensor data to the host without an aten op on a CPU tensor
READ_METHODS = ("tolist", "numpy", "cpu")
#: decode policy -> host reads it needs per decode step, on top of greedy decoding's stop check
#: (PrefixKV's rule reads every layer's eviction decisions once: the decode region's new length;
#: a periodic eviction, R-KV's, reads the evicting layers' new prompt sizes once at an eviction step)
POLICY_READS = {"none": 0, "h2o": 0, "tova": 1, "fixed_index_evict": 1, "rkv": 1}


def _bool_index(indices) -> bool:
    return any(t is not None and torch.is_tensor(t) and t.dtype in (torch.bool, torch.uint8) for t in indices)


def read_kind(func, args, kwargs) -> str | None:
    """The kind of host read ``func(*args, **kwargs)`` makes (None: none)."""
    if func in READ_OPS:
        return func.__name__.split(".")[0]
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and _bool_index(args[1]):
        return "boolean mask index"
    repeats = (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
    if func in repeats and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    return None


def origin() -> str:
    """``path:line (function)`` of the innermost kvlab frame of the current stack, or of the
    transformers frame that did the read when it happened inside transformers' code."""
    frames = traceback.extract_stack()[:-2]
    for frame in reversed(frames):
        name = frame.filename
        if "/transformers/" in name:
            return "transformers/" + name.split("/transformers/", 1)[1] + f":{frame.lineno} ({frame.name})"
        if name.startswith(KVLAB_DIRS):
            return f"{Path(name).relative_to(REPO)}:{frame.lineno} ({frame.name})"
    return "elsewhere"


@dataclass
class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as syncs: ...``: ``syncs.reads`` lists ``(kind, origin)`` of every host
    read in the block, ``syncs.uploads`` every tensor built from Python data (see module docstring)."""

    reads: list[tuple[str, str]] = field(default_factory=list)
    uploads: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        self._patches = contextlib.ExitStack()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = read_kind(func, args, kwargs)
        if kind is not None:
            self.reads.append((kind, origin()))
        elif func is aten.lift_fresh.default and args[0].dim() > 0:
            self.uploads.append(origin())
        return func(*args, **kwargs)

    def _wrap(self, name: str) -> None:
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            self.reads.append((name, origin()))
            return original(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
        self._patches.callback(setattr, torch.Tensor, name, original)

    def __enter__(self) -> HostSyncs:
        for name in READ_METHODS:
            self._wrap(name)
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._patches.close()


@dataclass
class StepSyncs:
    """Host reads of one decode: ``start`` (the policy's start and step 0), then one Counter of
    origins per later step (the reads between two consecutive ``on_step`` calls), ``tail`` (the
    last, unfed step's stop check)."""

    start: Counter = field(default_factory=Counter)
    steps: list[Counter] = field(default_factory=list)
    tail: Counter = field(default_factory=Counter)
    uploads: Counter = field(default_factory=Counter)

    @property
    def per_step(self) -> int:
        """The most reads any one decode step made (0 with fewer than two fed steps)."""
        return max((sum(c.values()) for c in self.steps), default=0)

    def worst_step(self) -> Counter:
        return max(self.steps, key=lambda c: sum(c.values()), default=Counter())


@contextlib.contextmanager
def counting_steps() -> Iterator[tuple[StepSyncs, Callable[[int], None]]]:
    """``(result, on_step)``: pass ``on_step`` to :func:`kvlab.engine.generation.decode` inside
    the block; ``result`` is filled when the block ends."""
    result = StepSyncs()
    marks: list[int] = []
    with HostSyncs() as syncs:
        yield result, lambda step: marks.append(len(syncs.reads))
    origins = [f"{kind} at {where}" for kind, where in syncs.reads]
    bounds = [0, *marks, len(origins)]
    parts = [Counter(origins[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    result.start, result.steps, result.tail = parts[0], parts[1:-1], parts[-1]
    result.uploads = Counter(syncs.uploads)


def describe(counter: Counter) -> str:
    return "; ".join(f"{n} x {where}" for where, n in counter.most_common()) or "none"

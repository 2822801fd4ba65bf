"""Samples that share a context (``Sample.context_id``): batches of whole contexts, and the check
that such samples differ only in their question (``docs/protocols.md``, ``multi_question``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import BatchSampler, Sampler

from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample


def check_contexts(samples: list[Sample]) -> None:
    """Refuse samples of one ``context_id`` whose contexts differ (text before the question, system
    message, number of images): they could not share one compressed context."""
    first: dict[str, Sample] = {}

    def shared(s: Sample) -> tuple[str, str | None, int]:
        return s.context, s.system, len(s.images)

    for sample in samples:
        if sample.context_id is None:
            continue
        seen = first.setdefault(sample.context_id, sample)
        if shared(seen) != shared(sample):
            raise ConfigError(
                f"samples '{seen.id}' and '{sample.id}' share context_id '{sample.context_id}' but not their "
                "context (the prompt before the question, the system message or the images differ). Samples "
                "of one context_id must differ only in their question; fix the data or their context ids."
            )


def context_batches(context_ids: Sequence[str | None], batch_size: int) -> list[list[int]]:
    """Batches of positions in ``context_ids`` (one per sample) holding whole contexts: the samples
    of each context id (in order of first appearance; a sample without one is its own context),
    ``batch_size`` contexts per batch."""
    groups: dict[Any, list[int]] = {}
    for index, context_id in enumerate(context_ids):
        key = context_id if context_id is not None else ("sample", index)
        groups.setdefault(key, []).append(index)
    contexts = list(groups.values())
    return [
        [i for members in contexts[start : start + batch_size] for i in members]
        for start in range(0, len(contexts), batch_size)
    ]


class ContextBatchSampler(BatchSampler):
    """Batches of whole contexts (:func:`context_batches`) over the indices ``sampler`` yields.

    ``context_ids[i]``: the ``context_id`` of sample ``i``. A ``BatchSampler`` with a ``sampler``
    argument, so Lightning can put its own (distributed) sampler in; under data-parallel predict a
    context whose samples land on two ranks is compressed once on each.
    """

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int],
        batch_size: int,
        drop_last: bool = False,
        context_ids: Sequence[str | None] = (),
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.context_ids = list(context_ids)

    def _batches(self) -> list[list[int]]:
        indices = list(self.sampler)
        positions = context_batches([self.context_ids[i] for i in indices], self.batch_size)
        return [[indices[p] for p in batch] for batch in positions]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches()

    def __len__(self) -> int:
        return len(self._batches())

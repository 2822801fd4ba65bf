"""Data for kvlab: samples, dataset components and the Lightning data module.

``KVLabDataModule`` is imported lazily (it pulls in Lightning) so that ``kvlab.data.Sample``
stays cheap to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlab.data import benchmarks as _benchmarks  # noqa: F401  (registers the long-context suites)
from kvlab.data import kvpress as _kvpress  # noqa: F401  (registers the kvpress-schema dataset)
from kvlab.data import reader_tasks as _reader_tasks  # noqa: F401  (registers the reader tasks)
from kvlab.data.datasets import DATASETS, JsonlDataset, SampleSource, build_dataset
from kvlab.data.hf import HFDataset
from kvlab.data.sample import Sample
from kvlab.data.synthetic import PALETTE, REGIONS, SyntheticImageQA, SyntheticRetrieval
from kvlab.data.vlm_tasks import VLMTask  # registers docvqa, chartqa, textvqa, ocrbench, mmmu

if TYPE_CHECKING:
    from kvlab.data.datamodule import KVLabDataModule

__all__ = [
    "DATASETS",
    "HFDataset",
    "PALETTE",
    "REGIONS",
    "JsonlDataset",
    "KVLabDataModule",
    "Sample",
    "SampleSource",
    "SyntheticImageQA",
    "SyntheticRetrieval",
    "VLMTask",
    "build_dataset",
]


def __getattr__(name: str) -> Any:
    if name == "KVLabDataModule":
        from kvlab.data.datamodule import KVLabDataModule

        return KVLabDataModule
    raise AttributeError(f"module 'kvlab.data' has no attribute '{name}'")

"""Data for kvlab: samples, dataset components, benchmark loaders.

The Lightning data module that serves them to a run is :mod:`kvlab.runner.datamodule`.
"""

from __future__ import annotations

from kvlab.data import benchmarks as _benchmarks  # noqa: F401  (registers the long-context suites)
from kvlab.data import counting as _counting  # noqa: F401  (registers synthetic_counting)
from kvlab.data import kvpress as _kvpress  # noqa: F401  (registers the kvpress-schema dataset)
from kvlab.data import reader_tasks as _reader_tasks  # noqa: F401  (registers the reader tasks)
from kvlab.data import scene_tasks as _scene_tasks  # noqa: F401  (registers the scene tasks)
from kvlab.data.datasets import DATASETS, JsonlDataset, SampleSource, build_dataset
from kvlab.data.hf import HFDataset
from kvlab.data.sample import Sample
from kvlab.data.synthetic import PALETTE, REGIONS, SyntheticImageQA, SyntheticRetrieval
from kvlab.data.vlm_tasks import VLMTask  # registers docvqa, chartqa, textvqa, ocrbench, mmmu

__all__ = [
    "DATASETS",
    "HFDataset",
    "PALETTE",
    "REGIONS",
    "JsonlDataset",
    "Sample",
    "SampleSource",
    "SyntheticImageQA",
    "SyntheticRetrieval",
    "VLMTask",
    "build_dataset",
]

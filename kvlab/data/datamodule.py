"""The Lightning data module: builds the configured dataset and batches it with the model's processor."""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from kvlab.config.errors import ConfigError
from kvlab.config.registry import to_plain
from kvlab.data.datasets import build_dataset
from kvlab.data.sample import Sample

DEFAULT_DATASET: dict[str, Any] = {"name": "synthetic_retrieval", "num_samples": 8, "context_words": 400}


def _validate_model_name(name: str) -> None:
    """Check the model name with kvlab.models when that module provides a validator."""
    try:
        from kvlab.models import validate_model_name
    except ImportError:  # kvlab.models not available: the processor load will report problems
        return
    validate_model_name(name)


class KVLabDataModule(L.LightningDataModule):
    """Serves the prompts of one dataset to ``Trainer.predict``, batched by the model's processor.

    Args:
        dataset: the dataset node ``{name: <registered dataset>, <params>}`` (dict or omegaconf);
            default: 8 ``synthetic_retrieval`` samples of about 400 words.
        model: model name whose processor tokenizes and batches the samples.
        batch_size: samples per batch (>= 1).
        num_workers: DataLoader worker processes (0 = collate in the main process).
        limit: use only the first ``limit`` samples (applied before ``skip_ids``).

    The dataset is built (and validated) in ``__init__``, so data errors surface before a model
    loads. Set :attr:`skip_ids` before predicting to leave out samples already done (resume).
    """

    def __init__(
        self,
        dataset: dict[str, Any] | None = None,
        model: str = "smollm2-135m",
        batch_size: int = 1,
        num_workers: int = 0,
        limit: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"data.batch_size must be an integer >= 1, got {batch_size!r}. Fix the value.")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(
                f"data.num_workers must be an integer >= 0, got {num_workers!r}. Use 0 to collate "
                f"in the main process."
            )
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(
                f"data.limit must be an integer >= 1 or null (all samples), got {limit!r}. Fix the value."
            )
        self.save_hyperparameters()
        node = to_plain(dataset) if dataset is not None else dict(DEFAULT_DATASET)
        self.dataset_config: dict[str, Any] | str = node
        self.source = build_dataset(node, "data.dataset")
        self.model_name = model
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.limit = limit
        self.skip_ids: set[str] = set()
        self.processor: Any = None
        self._samples: list[Sample] | None = None
        _validate_model_name(model)

    @property
    def samples(self) -> list[Sample]:
        """Every sample of the dataset (generated or loaded on first access, then cached)."""
        if self._samples is None:
            self._samples = self.source.samples()
        return self._samples

    @property
    def selected_samples(self) -> list[Sample]:
        """The samples of this run: the first ``limit`` samples (all when ``limit`` is None)."""
        return self.samples if self.limit is None else self.samples[: self.limit]

    def pending_samples(self) -> list[Sample]:
        """The selected samples whose ids are not in :attr:`skip_ids`, in dataset order."""
        skip = {str(i) for i in self.skip_ids}
        return [s for s in self.selected_samples if s.id not in skip]

    def setup(self, stage: str | None = None) -> None:
        """Load the model's processor (once) and the samples."""
        if self.processor is None:
            from kvlab.models import load_processor

            self.processor = load_processor(self.model_name)
        _ = self.samples

    def predict_dataloader(self) -> DataLoader:
        """Batches of the pending samples, collated by ``processor.collate``."""
        if self.processor is None:
            self.setup("predict")
        return DataLoader(
            self.pending_samples(),  # type: ignore[arg-type]
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=self.processor.collate,
        )

"""The Lightning data module: builds the configured dataset and batches it with the model's processor.

It is where data meets the model: the run's model name gives the processor (loaded through
:mod:`kvlab.models`) that the data functions below it are handed (prompt lengths, truncation,
token-measured datasets), so :mod:`kvlab.data` never imports a model.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any, Literal

import lightning as L
from torch.utils.data import DataLoader, SequentialSampler

from kvlab.config.errors import ConfigError
from kvlab.config.registry import to_plain
from kvlab.data.contexts import ContextBatchSampler, check_contexts
from kvlab.data.datasets import build_dataset
from kvlab.data.long_prompts import LONG_PROMPTS, prompt_length, truncate_left
from kvlab.data.sample import Sample, require_questions
from kvlab.data.tokens import ProcessorSource
from kvlab.metrics.tasks import DEFAULT_TASK_METRICS, check_task_samples, validate_task_metrics
from kvlab.models import PROCESSORS, context_length
from kvlab.models.base import PromptProcessor
from kvlab.models.processors import read_chat_template

DEFAULT_DATASET: dict[str, Any] = {"name": "synthetic_retrieval", "num_samples": 8, "context_words": 400}


def check_encodable(sample: Sample) -> None:
    """Refuse a sample whose text is not valid Unicode (a lone surrogate such as JSON's ``"\\ud800"``
    decodes into a Python string that no tokenizer can encode), naming the sample and the field."""
    texts = {"prompt": sample.prompt, "system": sample.system or "", "question": sample.question or ""}
    for field_name, text in texts.items():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(
                f"sample '{sample.id}': its {field_name} holds {text[exc.start]!r} at character {exc.start}, "
                "which is not a character (a lone UTF-16 surrogate, as written by a broken JSON escape), so "
                "no tokenizer can encode it. Fix the text of this sample."
            ) from None


class KVLabDataModule(L.LightningDataModule):
    """Serves the prompts of one dataset to ``Trainer.predict``, batched by the model's processor.

    Args:
        dataset: the dataset node ``{name: <registered dataset>, <params>}`` (dict or omegaconf);
            default: 8 ``synthetic_retrieval`` samples of about 400 words.
        model: model name whose processor tokenizes and batches the samples.
        batch_size: samples per batch (>= 1).
        num_workers: DataLoader worker processes (0 = collate in the main process).
        limit: use only the first ``limit`` samples (a resumed run then skips those already written).
        long_prompts: what to do with a prompt longer than the model's context
            (``max_position_embeddings`` of its config): ``refuse`` (default: stop with an error
            naming the sample, before the model loads) or ``truncate_left`` (drop the prompt's
            first words until it fits; the sample's ``meta`` records ``truncated_words`` and a
            note is printed).
        chat_template: how a prompt is formatted for the model: ``auto`` (default: the model's own
            chat template, or the raw prompt with the tokenizer's special tokens when it has none),
            ``none`` (always the raw prompt) or the path of a Jinja chat template file. A
            vision-language model without a template is refused. Part of the run's fingerprint.

    Keyword-only, wired by the run's driver (:mod:`kvlab.cli.predict`), never config fields:

    Args:
        skip_ids: ids of samples already written (a resumed run): left out of the batches.
        group_by_context: the run's protocol answers several questions from one compressed
            context (``multi_question``): each batch holds whole contexts, every pending sample
            of a ``context_id``, ``batch_size`` contexts per batch (docs/protocols.md); the
            samples of one ``context_id`` must share their context.
        question_split: what in the run compresses each context apart from its question
            (:attr:`kvlab.runner.plan.RunPlan.question_split`): every selected sample must then
            mark its question, or the run is refused before the model loads.

    The dataset is built (and validated) in ``__init__``, with its task metric names checked
    against the registry (:attr:`task_metrics`), so data errors surface before a model loads.
    The model's name is checked and its processor loaded through :attr:`processors`, which the
    token-measured datasets are given too.
    """

    #: where model names are checked and processors loaded (a class attribute, not a config field)
    processors: ProcessorSource = PROCESSORS

    def __init__(
        self,
        dataset: dict[str, Any] | None = None,
        model: str = "smollm2-135m",
        batch_size: int = 1,
        num_workers: int = 0,
        limit: int | None = None,
        long_prompts: Literal["refuse", "truncate_left"] = "refuse",
        chat_template: str = "auto",
        *,
        skip_ids: frozenset[str] = frozenset(),
        group_by_context: bool = False,
        question_split: str | None = None,
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
        if long_prompts not in LONG_PROMPTS:
            raise ConfigError(
                f"data.long_prompts must be one of {', '.join(LONG_PROMPTS)}, got {long_prompts!r}. "
                "`refuse` stops on a prompt longer than the model's context, `truncate_left` drops its "
                "first words until it fits."
            )
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise ConfigError(
                f"data.chat_template must be auto, none or the path of a Jinja chat template file, got "
                f"{chat_template!r}. Use `auto` (the model's own template, or the raw prompt when it has "
                "none), `none` (always the raw prompt) or a file path."
            )
        read_chat_template(chat_template)  # a missing file surfaces before anything loads
        self.save_hyperparameters(ignore=["skip_ids", "group_by_context", "question_split"])
        node = to_plain(dataset) if dataset is not None else dict(DEFAULT_DATASET)
        self.dataset_config: dict[str, Any] | str = node
        self.processors.check(model)  # before the dataset, which may load the model's tokenizer
        self.source = build_dataset(node, "data.dataset", tokenizer=model, processors=self.processors)
        #: the task metrics every sample is scored with (the dataset's, else the default ones)
        declared = getattr(self.source, "metrics", None)  # optional on a dataset (SampleSource)
        self.task_metrics = validate_task_metrics(declared or DEFAULT_TASK_METRICS)
        self.model_name = model
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.limit = limit
        self.long_prompts = long_prompts
        self.chat_template = chat_template
        self._checked = False
        self.skip_ids = frozenset(str(i) for i in skip_ids)
        self.group_by_context = group_by_context
        self.question_split = question_split
        self.processor: Any = None
        self._samples: list[Sample] | None = None

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
        return [s for s in self.selected_samples if s.id not in self.skip_ids]

    def setup(self, stage: str | None = None) -> None:
        """Load the model's processor (once) and the samples, and check the selected samples
        against the model (images for a text-only model, prompts longer than its context): the
        trainer calls this before the model's weights load."""
        if self.processor is None:
            processor = self.processors.load(self.model_name)
            if isinstance(processor, PromptProcessor):  # a copy: the load is cached
                processor = processor.with_chat_template(self.chat_template)
                processor.check_template()
            self.processor = processor
        _ = self.samples
        if not self._checked:
            self.check_samples()
            self._checked = True

    def check_samples(self) -> None:
        """Refuse images for a text-only model; refuse or left-truncate prompts longer than the
        model's context (``long_prompts``). Truncated samples replace the originals. Refuse a
        sample whose benchmark prompts without a chat template (``meta["reference_chat_template"]``
        ``none``: LongBench's few-shot and code tasks) in a run that applies one."""
        selected = self.selected_samples
        check_task_samples(self.task_metrics, selected)
        if self.question_split is not None:
            require_questions(selected, self.question_split)
        for sample in selected:
            check_encodable(sample)
        raw = [s.id for s in selected if (s.meta or {}).get("reference_chat_template") == "none"]
        if raw and self.chat_template != "none":
            raise ConfigError(
                f"sample '{raw[0]}' ({len(raw)} samples in all) comes from a task its benchmark prompts "
                f"without a chat template (LongBench's pred.py: trec, triviaqa, samsum, lsht, lcc, "
                f"repobench-p), but data.chat_template is {self.chat_template!r}, so its score would not be "
                "comparable. Set data.chat_template: none (`--config benchmarks/longbench_fewshot` does), "
                "or choose the other tasks."
            )
        if isinstance(self.processor, PromptProcessor) and self.processor.images is None:
            with_images = [s.id for s in selected if s.images]
            if with_images:
                raise ConfigError(
                    f"sample '{with_images[0]}' ({len(with_images)} samples in all) has images, but "
                    f"model.model '{self.model_name}' is text-only. Use a vision-language model (e.g. "
                    "tiny-qwen2-vl, smollm2-qwen2-vl) or a dataset without images."
                )
        limit = context_length(self.model_name)
        if limit is None or not isinstance(self.processor, PromptProcessor):  # a custom one: not checked
            return
        check_contexts(selected)
        truncated: list[str] = []
        for index, sample in enumerate(selected):
            try:
                length = prompt_length(self.processor, sample)
            except Exception as exc:  # tokenizers raise TypeError/ValueError/their own on odd input
                raise ConfigError(
                    f"sample '{sample.id}': the tokenizer of model.model '{self.model_name}' cannot encode "
                    f"its prompt ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}). Fix or remove "
                    "the sample."
                ) from None
            if length <= limit:
                continue
            if self.long_prompts == "refuse":
                raise ConfigError(
                    f"sample '{sample.id}': its prompt is {length} tokens, longer than the context of "
                    f"model.model '{self.model_name}' ({limit} tokens, max_position_embeddings). "
                    "Shorten or remove the sample, use a model with a longer context, or set "
                    "`data.long_prompts: truncate_left` to drop the prompt's first words until it fits."
                )
            short, dropped = truncate_left(self.processor, sample, limit)
            self.samples[index] = replace(short, meta={**short.meta, "truncated_words": dropped})
            truncated.append(f"'{sample.id}' ({length} tokens, {dropped} words dropped)")
        if truncated:
            self._align_truncated_contexts(len(selected))
            print(
                f"kvlab: data.long_prompts = truncate_left: {len(truncated)} prompts longer than the "
                f"context of {self.model_name} ({limit} tokens) lost their first words: "
                f"{', '.join(truncated[:5])}{' ...' if len(truncated) > 5 else ''}",
                file=sys.stderr,
            )

    def _align_truncated_contexts(self, count: int) -> None:
        """After ``truncate_left``: the samples of one ``context_id`` lose as many context words as
        the one that lost the most, so they still share their context."""
        by_context: dict[str, list[int]] = {}
        for index, sample in enumerate(self.samples[:count]):
            if sample.context_id is not None:
                by_context.setdefault(sample.context_id, []).append(index)
        for members in by_context.values():
            dropped = max(self.samples[i].meta.get("truncated_words", 0) for i in members)
            for i in members:
                sample = self.samples[i]
                already = sample.meta.get("truncated_words", 0)
                if already == dropped:
                    continue
                words = sample.context.split(" ")[dropped - already :]
                meta = {**sample.meta, "truncated_words": dropped}
                self.samples[i] = replace(sample, prompt=" ".join(words) + (sample.question or ""), meta=meta)

    def predict_dataloader(self) -> DataLoader:
        """Batches of the pending samples, collated by ``processor.collate`` (whole contexts per
        batch under :attr:`group_by_context`)."""
        if self.processor is None:
            self.setup("predict")
        pending = self.pending_samples()
        if not self.group_by_context:
            return DataLoader(
                pending,  # type: ignore[arg-type]
                batch_size=self.batch_size,
                shuffle=False,
                num_workers=self.num_workers,
                collate_fn=self.processor.collate,
            )
        sampler = ContextBatchSampler(
            SequentialSampler(pending), self.batch_size, context_ids=[s.context_id for s in pending]
        )
        return DataLoader(
            pending,  # type: ignore[arg-type]
            batch_sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=self.processor.collate,
        )

"""``loogle``: LooGLE with its prompts, output lengths and automatic metrics.

LooGLE (Li et al. 2024, "LooGLE: Can Long-Context Language Models Understand Long Contexts?")
ships four tasks (bigai-nlco/LooGLE ``LooGLE-testdata/<task>.jsonl``, or the Hub dataset
``bigainlco/LooGLE``). Each row is one long document: ``input`` (the text), ``title``,
``qa_pairs`` (a Python literal list of ``{"Q", "A", "S"}``; "none" for summarisation; a cloze
``A`` maps ``<mask-i>`` to the entity) and ``output`` (the summary).

Prompts are ``config/task2prompt.json`` (its document field, ``{input}``, is kvlab's context),
output lengths ``config/task2maxlen.json``. Every question of a document is one sample, all with
the document's ``context_id`` (the ``multi_question`` protocol compresses a document once);
``Sample.question`` is the template's text after the document. Metrics
(``Evaluation/automatic_metrics.py``, :mod:`kvlab.metrics.suites.loogle`): BLEU-1/4 and ROUGE-1/2/L
recall for QA and summarisation, exact and partial mask matches for the cloze task. The
reference's ``pred_opensource_models.py`` also decodes with ``repetition_penalty=2``, which kvlab's
greedy decoding does not apply. ``max_length`` cuts each document in its middle so that its
longest question's prompt fits (the reference cuts each prompt's middle; kvlab cuts the shared
document once, keeping one context per document).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.config.registry import context_field
from kvlab.data.benchmarks.common import check_count, check_tasks, fill, read_task_rows, split_at_context
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample
from kvlab.data.tokens import (
    ProcessorSource,
    check_tokenizer_name,
    require_tokenizer,
    truncate_middle,
)

__all__ = ["LOOGLE_MAX_NEW_TOKENS", "LOOGLE_PROMPTS", "LooGLEDataset"]

_QA = "Please answer the question based on the long texts below. \n{context}\nQuestion: {Q}\nAnswer: "
#: ``config/task2prompt.json`` (the document field renamed ``{context}``)
LOOGLE_PROMPTS: dict[str, str] = {
    "shortdep_qa": _QA,
    "longdep_qa": _QA,
    "longdep_summarization": "Please generate a summary of the below paper. \n{context}\n Summarization: ",
    "shortdep_cloze": "Please fill in the clozes based on the given long texts below. Each of the placeholder '<mask-n>' in the question could be an entity of Person, Location or Organiocation. The same masks represent the same entity. Output a json format answer, for example: {{'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion Magazine','<mask-2>': 'Bethel Horizon'}}\n{context}\n Question: {Q} What are the masked entities? \nAnswer:",  # noqa: E501
}
#: ``config/task2maxlen.json``
LOOGLE_MAX_NEW_TOKENS = {
    "shortdep_qa": 300,
    "longdep_qa": 500,
    "longdep_summarization": 500,
    "shortdep_cloze": 50,
}
#: where each task is: local file names, Hub subset
_SOURCES = {
    "shortdep_qa": (["shortdep_qa.jsonl"], "shortdep_qa"),
    "longdep_qa": (["longdep_qa.jsonl"], "longdep_qa"),
    "shortdep_cloze": (["shortdep_cloze.jsonl"], "shortdep_cloze"),
    "longdep_summarization": (["longdep_summarization.jsonl", "summarization.jsonl"], "summarization"),
}
QA_METRICS = ("loogle_bleu1", "loogle_bleu4", "loogle_rouge1", "loogle_rouge2", "loogle_rouge_l")
CLOZE_METRICS = ("loogle_cloze_exact", "loogle_cloze_partial")


@DATASETS.register("loogle")
@dataclass
class LooGLEDataset:
    """LooGLE tasks read from ``path`` (a directory of ``<task>.jsonl`` or ``bigainlco/LooGLE``).

    ``samples_per_task``: the first N questions of each task (null: all); ``max_length``: middle
    truncation in tokens of the ``tokenizer`` model (null: none; tokenizer null: the run's model).
    ``metrics`` default: the metrics of the chosen tasks (BLEU/ROUGE for QA and summarisation,
    mask matches for the cloze task).
    """

    path: str
    tasks: list[str] = field(default_factory=lambda: ["shortdep_qa"])
    samples_per_task: int | None = None
    max_length: int | None = None
    tokenizer: str | None = None
    processors: ProcessorSource | None = context_field()  # loads the tokenizer's processor (kvlab's)
    split: str = "test"
    metrics: tuple[str, ...] | None = None
    _items: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tasks = list(check_tasks(self.tasks, LOOGLE_PROMPTS, "LooGLE"))
        check_count(self.samples_per_task, "samples_per_task", allow_none=True)
        check_count(self.max_length, "max_length", least=64, allow_none=True)
        check_tokenizer_name(self.tokenizer, self.processors)
        if self.max_length is not None and self.tokenizer is None:
            require_tokenizer(None, self.processors, "loogle", "max_length")
        if self.metrics is None:
            cloze = "shortdep_cloze" in self.tasks
            text = any(t != "shortdep_cloze" for t in self.tasks)
            self.metrics = (*(QA_METRICS if text else ()), *(CLOZE_METRICS if cloze else ()))
        self.metrics = check_metrics(self.metrics)
        for task in self.tasks:
            files, subset = _SOURCES[task]
            rows = read_task_rows(self.path, task, files, subset, self.split)
            self._items[task] = self._expand(task, rows)

    def _expand(self, task: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One item per question (per document for summarisation), up to ``samples_per_task``."""
        items: list[dict[str, Any]] = []
        for doc, row in enumerate(rows):
            where = f"data.dataset.path: LooGLE task '{task}' row {doc}"
            if not isinstance(row.get("input"), str):
                raise ConfigError(f"{where} has no string 'input' field (fields: {', '.join(row)}).")
            base = {"doc": doc, "context": row["input"], "title": row.get("title")}
            if task == "longdep_summarization":
                if not isinstance(row.get("output"), str):
                    raise ConfigError(f"{where} has no string 'output' (the reference summary).")
                items.append({**base, "Q": "", "answer": row["output"], "qa_index": 0})
            else:
                for k, pair in enumerate(self._pairs(row.get("qa_pairs"), where)):
                    items.append({**base, "Q": pair["Q"], "answer": pair["A"], "qa_index": k})
            if self.samples_per_task is not None and len(items) >= self.samples_per_task:
                return items[: self.samples_per_task]
        return items

    @staticmethod
    def _pairs(raw: Any, where: str) -> list[dict[str, Any]]:
        """``qa_pairs`` parsed as a Python literal (the reference ``eval``s it)."""
        try:
            pairs = ast.literal_eval(raw) if isinstance(raw, str) else raw
        except (ValueError, SyntaxError):
            pairs = None
        if not isinstance(pairs, list) or not all(
            isinstance(p, dict) and "Q" in p and "A" in p for p in pairs
        ):
            raise ConfigError(
                f"{where}: 'qa_pairs' must be a list of {{'Q': ..., 'A': ...}} (a Python literal)."
            )
        return pairs

    def samples(self) -> list[Sample]:
        """One sample per question, tasks in order; a document's questions share its ``context_id``."""
        counter = (
            require_tokenizer(self.tokenizer, self.processors, "loogle", "max_length")
            if self.max_length
            else None
        )
        out = []
        for task in self.tasks:
            before, after = split_at_context(LOOGLE_PROMPTS[task])
            head = fill(before)
            documents = self._documents(task, head, after, counter)
            for index, item in enumerate(self._items[task]):
                question = fill(after, Q=item["Q"])
                document, dropped = documents[item["doc"]]
                meta: dict[str, Any] = {"suite": "loogle", "task": task, "title": item["title"]}
                meta.update(document=item["doc"], qa_index=item["qa_index"])
                if dropped:
                    meta["truncated_tokens"] = dropped
                answer = item["answer"]
                if isinstance(answer, dict):
                    meta["cloze_answer"] = {str(k): str(v) for k, v in answer.items()}
                    answers = [json.dumps(meta["cloze_answer"], ensure_ascii=False)]
                else:
                    answers = [str(answer)]
                out.append(
                    Sample(
                        id=f"loogle-{task}-{index:04d}",
                        prompt=head + document + question,
                        question=question,
                        answers=answers,
                        max_new_tokens=LOOGLE_MAX_NEW_TOKENS[task],
                        context_id=f"loogle-{task}-doc{item['doc']:04d}",
                        meta=meta,
                    )
                )
        return out

    def _documents(self, task: str, head: str, after: str, counter: Any) -> dict[int, tuple[str, int]]:
        """Each document, cut in its middle when ``max_length`` is set so that the prompt of its
        longest question fits (once per document: its questions keep one shared context; the
        reference cuts each prompt instead). Returns ``{document: (text, tokens dropped)}``."""
        docs: dict[int, tuple[str, int]] = {}
        questions: dict[int, list[str]] = {}
        for item in self._items[task]:
            docs.setdefault(item["doc"], (item["context"], 0))
            questions.setdefault(item["doc"], []).append(fill(after, Q=item["Q"]))
        if counter is None:
            return docs
        for doc, (text, _) in docs.items():
            overhead = max(counter.count_text(head + q) for q in questions[doc])
            budget = int(self.max_length) - overhead  # type: ignore[arg-type]
            if budget < 16:
                raise ConfigError(
                    f"data.dataset.max_length: {self.max_length} tokens leave no room for LooGLE task "
                    f"'{task}' document {doc} (its instructions and question take {overhead}); raise it."
                )
            docs[doc] = truncate_middle(counter, text, budget)
        return docs

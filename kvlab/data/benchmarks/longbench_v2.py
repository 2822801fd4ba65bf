"""``longbench_v2``: LongBench v2 (multiple choice over long contexts) with its official prompt.

LongBench v2 (Bai et al. 2025, "LongBench v2: Towards Deeper Understanding and Reasoning on
Realistic Long-context Multitasks") has 503 four-choice questions over contexts of 8k to 2M
words, released as ``data.json`` (a JSON list) and ``THUDM/LongBench-v2`` on the Hub (split
``train``). Each row: ``_id``, ``domain``, ``sub_domain``, ``difficulty`` (easy | hard),
``length`` (short | medium | long), ``question``, ``choice_A`` to ``choice_D``, ``answer`` (the
letter) and ``context``.

The prompt is THUDM/LongBench ``prompts/0shot.txt`` (commit 2e00731) filled as ``pred.py`` fills
it (the context, question and choices stripped); the output length is ``pred.py``'s 128 tokens
for the answer without chain of thought. ``max_length`` reproduces its middle truncation
(``query_llm``: the first and last ``max_length / 2`` tokens; 120000 for most models there) and
must leave the question whole. Scored by ``longbench_v2_accuracy``
(:mod:`kvlab.metrics.suites.longbench_v2`: ``pred.py``'s ``extract_answer``); the easy/hard and
short/medium/long splits of ``result.py`` come from
:func:`kvlab.data.benchmarks.report.longbench_v2_scores`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.config.registry import context_field
from kvlab.data.benchmarks.common import check_count, read_task_rows
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample
from kvlab.data.tokens import (
    ProcessorSource,
    check_tokenizer_name,
    require_tokenizer,
    truncate_before_question,
)

__all__ = ["LONGBENCH_V2_MAX_NEW_TOKENS", "LONGBENCH_V2_PROMPT", "LongBenchV2Dataset"]

#: ``prompts/0shot.txt``; ``$DOC$`` is the context
LONGBENCH_V2_PROMPT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n"
    '(D) $C_D$\n\nFormat your response as follows: "The correct answer is (insert answer here)".'
)
#: ``pred.py``: ``max_new_tokens=128`` without chain of thought
LONGBENCH_V2_MAX_NEW_TOKENS = 128
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
_FIELDS = ("question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")


def _read_rows(path: str) -> list[dict[str, Any]]:
    """``data.json`` (a JSON list, or a directory holding it), a JSON-lines file, a ``save_to_disk``
    directory or the Hub id (split ``train``)."""
    local = Path(path).expanduser()
    file = local / "data.json" if local.is_dir() and (local / "data.json").is_file() else local
    if file.is_file() and file.suffix == ".json":
        try:
            rows = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"data.dataset.path: {file} is not valid JSON ({exc}). Re-download data.json."
            ) from None
        if not isinstance(rows, list):
            raise ConfigError(
                f"data.dataset.path: {file} must hold a JSON list of questions (LongBench v2's data.json)."
            )
        return rows
    if file.is_file():
        return read_task_rows(str(file.parent), "train", [file.name], None, "train")
    return read_task_rows(path, "train", ["data.jsonl"], None, "train")


def _choose(values: Any, allowed: tuple[str, ...], name: str) -> tuple[str, ...]:
    values = [values] if isinstance(values, str) else values
    if not isinstance(values, list | tuple) or not values or any(v not in allowed for v in values):
        raise ConfigError(
            f"data.dataset.{name} must be a non-empty list of {', '.join(allowed)}, got {values!r}."
        )
    return tuple(values)


@DATASETS.register("longbench_v2")
@dataclass
class LongBenchV2Dataset:
    """LongBench v2's questions read from ``path``, scored by ``longbench_v2_accuracy``.

    ``difficulties`` / ``lengths``: keep the questions of these splits (default: all);
    ``limit``: the first N questions kept (null: all); ``max_length``: middle truncation in tokens
    of the ``tokenizer`` model (null: none; tokenizer null: the run's model).
    """

    path: str
    difficulties: list[str] = field(default_factory=lambda: list(DIFFICULTIES))
    lengths: list[str] = field(default_factory=lambda: list(LENGTHS))
    limit: int | None = None
    max_length: int | None = None
    tokenizer: str | None = None
    processors: ProcessorSource | None = context_field()  # loads the tokenizer's processor (kvlab's)
    metrics: tuple[str, ...] = ("longbench_v2_accuracy",)
    _rows: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.difficulties = list(_choose(self.difficulties, DIFFICULTIES, "difficulties"))
        self.lengths = list(_choose(self.lengths, LENGTHS, "lengths"))
        check_count(self.limit, "limit", allow_none=True)
        check_count(self.max_length, "max_length", least=64, allow_none=True)
        check_tokenizer_name(self.tokenizer, self.processors)
        if self.max_length is not None and self.tokenizer is None:
            require_tokenizer(None, self.processors, "longbench_v2", "max_length")
        self.metrics = check_metrics(self.metrics)
        rows = []
        for index, row in enumerate(_read_rows(self.path)):
            where = f"data.dataset.path: LongBench v2 row {index} ({row.get('_id', 'no _id')})"
            missing = [k for k in _FIELDS if not isinstance(row.get(k), str)]
            if missing:
                raise ConfigError(
                    f"{where} has no string field {', '.join(missing)} (fields: {', '.join(row)})."
                )
            if row["answer"] not in "ABCD" or len(row["answer"]) != 1:
                raise ConfigError(f"{where}: 'answer' must be a letter A-D, got {row['answer']!r}.")
            if row.get("difficulty") in self.difficulties and row.get("length") in self.lengths:
                rows.append(row)
        self._rows = rows[: self.limit] if self.limit is not None else rows
        if not self._rows:
            raise ConfigError(
                f"data.dataset: no LongBench v2 question in {self.path} is of difficulties "
                f"{self.difficulties} and lengths {self.lengths}."
            )

    def samples(self) -> list[Sample]:
        """One sample per question, in file order."""
        counter = (
            require_tokenizer(self.tokenizer, self.processors, "longbench_v2", "max_length")
            if self.max_length
            else None
        )
        before, after = LONGBENCH_V2_PROMPT.split("$DOC$")
        out = []
        for index, row in enumerate(self._rows):
            question = after.replace("$Q$", row["question"].strip())
            for letter in "ABCD":
                question = question.replace(f"$C_{letter}$", row[f"choice_{letter}"].strip())
            prompt = before + row["context"].strip() + question
            meta: dict[str, Any] = {
                "suite": "longbench_v2",
                "task": "longbench_v2",
                "difficulty": row["difficulty"],
                "length": row["length"],
                "domain": row.get("domain"),
                "sub_domain": row.get("sub_domain"),
                "source_id": row.get("_id"),
            }
            if counter is not None:
                prompt, dropped = truncate_before_question(
                    counter, prompt, question, self.max_length, f"LongBench v2 row {index}"
                )
                if dropped:
                    meta["truncated_tokens"] = dropped
            out.append(
                Sample(
                    id=f"longbench_v2-{row.get('_id', index)}",
                    prompt=prompt,
                    question=question,
                    answers=[row["answer"]],
                    choices=[row[f"choice_{letter}"] for letter in "ABCD"],
                    max_new_tokens=LONGBENCH_V2_MAX_NEW_TOKENS,
                    meta=meta,
                )
            )
        return out

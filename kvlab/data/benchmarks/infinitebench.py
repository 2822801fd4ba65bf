"""``infinitebench``: InfiniteBench (∞Bench) with its prompts, output lengths and scorers.

InfiniteBench (Zhang et al. 2024, "∞Bench: Extending Long Context Evaluation Beyond 100K
Tokens") ships 12 tasks as ``<task>.jsonl`` (``scripts/download_dataset.sh``) or the Hub dataset
``xinrongzhang2022/InfiniteBench`` (one split per task). Each row: ``id``, ``context``, ``input``,
``answer`` (a list, or a string) and ``options`` (the four choices of longbook_choice_eng and
code_debug, else empty).

Prompts are the open-model templates of ``src/prompt.py`` (``yarn_mistral_templates``, the ones
``src/eval_yarn_mistral.py`` uses), filled as ``src/eval_utils.py``'s ``create_prompt`` fills them
(code_run's function call and math_find's target read from ``input``); output lengths are
``DATA_NAME_TO_MAX_NEW_TOKENS``; scores are ``src/compute_scores.py``'s ``get_score_one_<task>``
(:func:`kvlab.metrics.suites.infinitebench.infinitebench_score`), against ``get_answer``'s labels (the
option text and its letter for the two multiple-choice tasks). The templates end with the start of
the answer ("The pass key is"), inside the prompt as in the reference: no answer prefix.
``max_length`` reproduces ``truncate_input``'s middle truncation (128k - 1000 for GPT-4 there).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
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
    truncate_before_question,
)

__all__ = ["INFINITEBENCH_MAX_NEW_TOKENS", "INFINITEBENCH_PROMPTS", "InfiniteBenchDataset", "official_labels"]

#: ``src/prompt.py``'s ``yarn_mistral_templates``
INFINITEBENCH_PROMPTS: dict[str, str] = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe pass key is",  # noqa: E501
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",  # noqa: E501
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",  # noqa: E501
    "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",  # noqa: E501
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\nQuestion: {question}\nAnswer:",  # noqa: E501
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",  # noqa: E501
    "code_run": "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the exact value of {func_call}. The value of {func_call} is",  # noqa: E501
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a deliberate error that makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe correct option is:",  # noqa: E501
    "longdialogue_qa_eng": 'Below is a dialogue script where one random occurrence of a character name is replaced with "$$MASK$$", and you should try to guess who that character is.\n\n{context}\n\nThe name that has been replaced with $$MASK$$ is likely',  # noqa: E501
}
#: ``src/eval_utils.py``'s ``DATA_NAME_TO_MAX_NEW_TOKENS``
INFINITEBENCH_MAX_NEW_TOKENS: dict[str, int] = {
    "passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_sum_eng": 1200,
    "longbook_choice_eng": 40, "longbook_qa_eng": 40, "longbook_qa_chn": 40, "longdialogue_qa_eng": 40,
    "math_find": 3, "math_calc": 30000, "code_run": 5, "code_debug": 5,
}  # fmt: skip
CHOICE_TASKS = ("longbook_choice_eng", "code_debug")
OPTIONS = "ABCD"


def _hub_features() -> Any:
    """The schema the Hub files are read with (their ``answer`` types differ between tasks)."""
    from datasets import Features, Sequence, Value  # datasets: 1.7 s to import, Hub files only

    return Features(
        {
            "id": Value("int64"),
            "context": Value("string"),
            "input": Value("string"),
            "answer": Sequence(Value("string")),
            "options": Sequence(Value("string")),
        }
    )


def official_labels(task: str, answer: Any) -> list[str]:
    """A row's ``answer`` as the official scorers read it, as strings (``Sample.answers``).

    A list stays a list (the getters take ``label[0]`` where they want one value); math_calc's
    nested ``[[1, 3, 6, 7]]`` is unwrapped to its inner list as ``get_score_one_math_calc`` does
    (commit 88b3daa), and a string holding such a list (a copy whose ``answer`` column is cast
    to strings) is read back as that list; any other scalar is a label of one.
    """
    if task == "math_calc":
        if isinstance(answer, list) and len(answer) == 1 and isinstance(answer[0], str | list):
            answer = answer[0]
        if isinstance(answer, str) and answer.strip().startswith("["):
            with contextlib.suppress(json.JSONDecodeError):  # not a list: checked as a label later
                answer = json.loads(answer)
        if isinstance(answer, list) and answer and isinstance(answer[0], list):
            answer = answer[0]
    if isinstance(answer, list):
        return [str(a) for a in answer]
    return [] if answer is None else [str(answer)]


@DATASETS.register("infinitebench")
@dataclass
class InfiniteBenchDataset:
    """InfiniteBench tasks read from ``path`` (a directory of ``<task>.jsonl`` or
    ``xinrongzhang2022/InfiniteBench``), scored by ``infinitebench_score``.

    ``samples_per_task``: the first N rows of each task (null: all); ``max_length``: middle
    truncation in tokens of the ``tokenizer`` model (null: none; tokenizer null: the run's model).
    """

    path: str
    tasks: list[str] = field(default_factory=lambda: ["passkey"])
    samples_per_task: int | None = None
    max_length: int | None = None
    tokenizer: str | None = None
    processors: ProcessorSource | None = context_field()  # loads the tokenizer's processor (kvlab's)
    metrics: tuple[str, ...] = ("infinitebench_score",)
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tasks = list(check_tasks(self.tasks, INFINITEBENCH_PROMPTS, "InfiniteBench"))
        check_count(self.samples_per_task, "samples_per_task", allow_none=True)
        check_count(self.max_length, "max_length", least=64, allow_none=True)
        check_tokenizer_name(self.tokenizer, self.processors)
        if self.max_length is not None and self.tokenizer is None:
            require_tokenizer(None, self.processors, "infinitebench", "max_length")
        self.metrics = check_metrics(self.metrics)
        features = None if Path(self.path).expanduser().exists() else _hub_features()
        for task in self.tasks:
            rows = read_task_rows(self.path, task, [f"{task}.jsonl"], None, task, features)
            rows = rows[: self.samples_per_task] if self.samples_per_task is not None else rows
            self._rows[task] = [self._parse(task, i, row) for i, row in enumerate(rows)]

    @staticmethod
    def _parse(task: str, index: int, row: dict[str, Any]) -> dict[str, Any]:
        """The template fields and labels of one row (``create_prompt`` and ``get_answer``)."""
        where = f"data.dataset.path: InfiniteBench task '{task}' row {index}"
        for key in ("context", "input"):
            if not isinstance(row.get(key), str):
                raise ConfigError(f"{where} has no string '{key}' field (fields: {', '.join(row)}).")
        answer = row.get("answer")
        answers = official_labels(task, answer)
        if answer is None or not answers:
            raise ConfigError(f"{where} has no 'answer'.")
        fields: dict[str, Any] = {"context": row["context"], "input": row["input"]}
        fields["question"] = row.get("question", row["input"])
        if task in CHOICE_TASKS:
            options = row.get("options")
            if not isinstance(options, list) or len(options) != 4:
                raise ConfigError(f"{where}: 'options' must list the four choices, got {options!r}.")
            fields.update({f"OPTION_{letter}": str(o) for letter, o in zip(OPTIONS, options, strict=True)})
            # get_answer: a string or a list of one -> [text, its letter]; [text, letter] kept
            if isinstance(answer, list) and len(answer) == 2 and answers[1] in OPTIONS:
                pass
            elif (isinstance(answer, str) or len(answers) == 1) and answers[0] in [str(o) for o in options]:
                answers = [answers[0], OPTIONS[[str(o) for o in options].index(answers[0])]]
            else:
                raise ConfigError(
                    f"{where}: the answer {answer!r} is neither one of the options {options!r} nor "
                    "[option text, letter] (src/eval_utils.py's get_answer accepts only these)."
                )
        if task == "code_run":
            calls = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", row["input"])
            call = row.get("func_call") or (calls[0] if calls else None)
            if call is None:
                raise ConfigError(f"{where}: 'input' names no function call func_<n>(<int>).")
            fields.update(func_call=call, func=row.get("func") or call.split("(")[0])
        if task == "math_find":
            target = re.findall(r"The \w+ number", row["input"])
            if not target:
                raise ConfigError(f"{where}: 'input' names no target ('The <which> number').")
            fields["prefix"] = f"What is {target[0].lower()} in the following list?"
        return {"fields": fields, "answers": answers, "id": row.get("id", index)}

    def samples(self) -> list[Sample]:
        """One sample per row, tasks in order."""
        counter = (
            require_tokenizer(self.tokenizer, self.processors, "infinitebench", "max_length")
            if self.max_length
            else None
        )
        out = []
        for task in self.tasks:
            before, after = split_at_context(INFINITEBENCH_PROMPTS[task])
            for index, row in enumerate(self._rows[task]):
                fields = row["fields"]
                question = fill(after, **fields)
                prompt = fill(before, **fields) + fields["context"] + question
                meta: dict[str, Any] = {"suite": "infinitebench", "task": task, "source_id": row["id"]}
                if counter is not None:
                    row_name = f"InfiniteBench task '{task}' row {index}"
                    prompt, dropped = truncate_before_question(
                        counter, prompt, question, self.max_length, row_name
                    )
                    if dropped:
                        meta["truncated_tokens"] = dropped
                out.append(
                    Sample(
                        id=f"infinitebench-{task}-{index:04d}",
                        prompt=prompt,
                        question=question,
                        answers=row["answers"],
                        max_new_tokens=INFINITEBENCH_MAX_NEW_TOKENS[task],
                        meta=meta,
                    )
                )
        return out

"""``scbench``: SCBench's shared-context tasks, one compression of the context for all its queries.

SCBench (Li et al. 2025, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods") ships
each task as ``<task>.jsonl`` (``microsoft/SCBench`` on the Hub, one subset per task, split
``test``). Each row: ``id``, ``context`` (the shared long context) and ``multi_turns``, a list of
``{"input", "answer"}`` (``options`` for scbench_choice_eng) asked about that context. The
context is a string, except scbench_mf's: a list of integers (the dataset card's ``sequence:
int64``), which ``create_scdq_prompt`` formats into its template as Python writes a list
(``"{context}".format(context=[3, 88, 14])`` is ``[3, 88, 14]``); kvlab writes it the same way.

kvlab runs SCBench's "same context, different queries" mode (``create_scdq_prompt`` of
microsoft/MInference ``scbench/eval_utils.py``, commit 0ff346d) under the ``multi_question``
protocol: the context is compressed once and every query is answered on the compressed cache
(``docs/protocols.md``). Each turn is one sample: ``prompt`` = the task's context prompt
(``multiturn_templates_scdq``) followed by the turn's query (``multiturn_follow_up_templates_
in_chat_tempate``), concatenated as the chat-template mode joins them; ``question`` = the query;
``context_id`` shared by the turns of a row; ``max_new_tokens`` = the task's ``max_new_tokens``
there. The reference label of each turn is ``get_ground_truth``'s (``[answer, letter]`` for
scbench_choice_eng, ``[answer]`` for scbench_qa_eng, the answer as stored otherwise), kept
unchanged in ``meta["label"]``: ``scbench_score`` (:mod:`kvlab.metrics.suites.scbench`) reads it
as ``scbench/compute_scores.py`` does. ``Sample.answers`` holds the same label as strings.

Not run: scbench_repoqa and scbench_repoqa_and_kv (scored by executing and matching code),
scbench_summary_with_needles and scbench_kv_compressible (mixed sub-tasks). SCBench's context
truncation (to the model's length less the turns' output) is not reproduced: contexts are used
whole (``data.long_prompts`` handles a context longer than the model's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.data.benchmarks.common import check_count, check_tasks, read_task_rows
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample

__all__ = ["SCBENCH_MAX_NEW_TOKENS", "SCBENCH_PROMPTS", "SCBenchDataset"]

_KV = "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}"
#: ``multiturn_templates_scdq`` (context prompt) and ``multiturn_follow_up_templates_in_chat_tempate``
#: (query) per task
SCBENCH_PROMPTS: dict[str, tuple[str, str]] = {
    "scbench_kv": (_KV, "{input}"),
    "scbench_kv_hard": (_KV, "{input}"),
    "scbench_hashhop": ("{context}", "{input}"),
    "scbench_prefix_suffix": ("{context}", "{input}"),
    "scbench_passkey": (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information.\n\n{context}",
        "{input}",
    ),
    "scbench_choice_eng": (
        "Read the book and answer the question.\n\n{context}",
        "Question: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
        "The the correct answer is",  # sic
    ),
    "scbench_qa_eng": (
        "Read the book and answer the question. Be very concise in your answer.\n\n{context}",
        "Question: {question}\nAnswer:",
    ),
    "scbench_qa_chn": ("阅读以下书籍然后回答问题。\n\n{context}", "问题：{question}\n答案："),
    "scbench_mf": ("{prefix}\n\n{context}", "{prefix}\n\n{input}"),
    "scbench_summary": ("{context}", "{input}"),
    "scbench_vt": ("{context}", "{input}"),
    "scbench_many_shot": ("{context}", "{input}"),
}
#: ``eval_utils.py``'s ``DATA_NAME_TO_MAX_NEW_TOKENS``
SCBENCH_MAX_NEW_TOKENS: dict[str, int] = {
    "scbench_kv": 150, "scbench_kv_hard": 150, "scbench_hashhop": 150, "scbench_prefix_suffix": 150,
    "scbench_passkey": 15, "scbench_choice_eng": 40, "scbench_qa_eng": 40, "scbench_qa_chn": 40,
    "scbench_mf": 5, "scbench_summary": 200, "scbench_vt": 30, "scbench_many_shot": 10,
}  # fmt: skip
OPTIONS = "ABCD"


def _label(task: str, turn: dict[str, Any], where: str) -> Any:
    """``get_ground_truth``'s label of one turn."""
    answer = turn.get("answer")
    if answer is None:
        raise ConfigError(f"{where} has no 'answer'.")
    if task == "scbench_choice_eng":
        options = turn.get("options")
        if not isinstance(options, list) or len(options) != 4 or answer not in options:
            raise ConfigError(f"{where}: 'options' must list four choices holding the answer {answer!r}.")
        return [answer, OPTIONS[options.index(answer)]]
    return [answer] if task == "scbench_qa_eng" else answer


def _context_text(task: str, context: Any, where: str) -> str:
    """The row's context as the task's template receives it: a string as it is; scbench_mf's list
    of integers as ``str.format`` writes a list (``str(context)``)."""
    if isinstance(context, str):
        return context
    if task == "scbench_mf" and isinstance(context, list):
        others = sorted({type(v).__name__ for v in context if type(v) is not int})
        if not others:
            return str(context)
        got = f"a list holding {', '.join(others)}"
    else:
        got = "nothing" if context is None else f"a {type(context).__name__}"
    shape = "a string or a list of integers" if task == "scbench_mf" else "a string"
    raise ConfigError(f"{where}: 'context' must be {shape}, got {got}.")


def _strings(label: Any) -> list[str]:
    return [str(v) for v in label] if isinstance(label, list) else [str(label)]


@DATASETS.register("scbench")
@dataclass
class SCBenchDataset:
    """SCBench tasks read from ``path`` (a directory of ``<task>.jsonl`` or ``microsoft/SCBench``),
    one sample per turn, the turns of a row sharing a ``context_id`` (run with
    ``model.protocol: multi_question``). ``samples_per_task``: the first N rows (contexts) of each
    task (null: all). Scored by ``scbench_score``.
    """

    path: str
    tasks: list[str] = field(default_factory=lambda: ["scbench_kv"])
    samples_per_task: int | None = None
    metrics: tuple[str, ...] = ("scbench_score",)
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tasks = list(check_tasks(self.tasks, SCBENCH_PROMPTS, "SCBench"))
        check_count(self.samples_per_task, "samples_per_task", allow_none=True)
        self.metrics = check_metrics(self.metrics)
        for task in self.tasks:
            rows = read_task_rows(self.path, task, [f"{task}.jsonl"], task, "test")
            rows = rows[: self.samples_per_task] if self.samples_per_task is not None else rows
            for index, row in enumerate(rows):
                where = f"data.dataset.path: SCBench task '{task}' row {index}"
                _context_text(task, row.get("context"), where)
                turns = row.get("multi_turns")
                if not isinstance(turns, list) or not turns:
                    raise ConfigError(f"{where} needs a non-empty 'multi_turns' list.")
                for t, turn in enumerate(turns):
                    if not isinstance(turn, dict) or not isinstance(turn.get("input"), str):
                        raise ConfigError(f"{where} turn {t} needs a string 'input'.")
                    _label(task, turn, f"{where} turn {t}")
            self._rows[task] = rows

    @staticmethod
    def _prompts(task: str, row: dict[str, Any]) -> tuple[str, list[str]]:
        """``create_scdq_prompt``: the context prompt and one query per turn."""
        context_template, query_template = SCBENCH_PROMPTS[task]
        turns = row["multi_turns"]
        text = _context_text(task, row["context"], f"SCBench task '{task}'")
        if task == "scbench_mf":
            context = context_template.format(prefix=turns[0]["input"], context=text)
            queries = []
            for turn in turns:
                found = re.findall(r"The .+ is", turn["input"])
                if not found:
                    raise ConfigError(
                        f"SCBench scbench_mf turn {turn['input']!r} names no target ('The <which> is')."
                    )
                target = found[0].lower()[:-3]
                queries.append(query_template.format(prefix=f"What is {target}?", input=turn["input"]))
            return context, queries
        context = context_template.format(context=text)
        if task == "scbench_choice_eng":
            queries = [
                query_template.format(
                    question=t["input"],
                    **{f"OPTION_{o}": v for o, v in zip(OPTIONS, t["options"], strict=True)},
                )
                for t in turns
            ]
        else:
            queries = [query_template.format(question=t["input"], input=t["input"]) for t in turns]
        return context, queries

    def samples(self) -> list[Sample]:
        """One sample per turn, rows and turns in order."""
        out = []
        for task in self.tasks:
            for index, row in enumerate(self._rows[task]):
                context, queries = self._prompts(task, row)
                for turn_index, (turn, query) in enumerate(zip(row["multi_turns"], queries, strict=True)):
                    label = _label(task, turn, "")
                    out.append(
                        Sample(
                            id=f"scbench-{task}-{index:04d}-{turn_index:02d}",
                            prompt=context + query,
                            question=query,
                            answers=_strings(label),
                            max_new_tokens=SCBENCH_MAX_NEW_TOKENS[task],
                            context_id=f"scbench-{task}-{index:04d}",
                            meta={
                                "suite": "scbench",
                                "task": task,
                                "turn": turn_index,
                                "label": label,
                                "source_id": row.get("id", index),
                            },  # fmt: skip
                        )
                    )
        return out

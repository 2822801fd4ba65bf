"""``longbench``: LongBench v1 with its official prompts, output lengths and metrics.

LongBench (Bai et al. 2024, "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding") ships 21 tasks (``THUDM/LongBench`` on the Hub, or ``data.zip`` holding
``data/<task>.jsonl``; LongBench-E's ``<task>_e`` files too). Each row: ``input`` (the question),
``context``, ``answers`` (list), ``length``, ``dataset``, ``language``, ``all_classes`` (class
names of trec and lsht, else null) and ``_id``.

Prompts are ``config/dataset2prompt.json``, output lengths ``config/dataset2maxlen.json``, metrics
``eval.py``'s ``dataset2metric`` (:func:`kvlab.metrics.suites.longbench.longbench_score`). The prompt is
the template filled; ``Sample.question`` is the template's text after ``{context}`` (with the
input), so a query-agnostic run compresses the context alone. LongBench uses no answer prefix.

What ``pred.py`` does that a dataset cannot: it sends trec, triviaqa, samsum, lsht, lcc and
repobench-p *without* the chat template (run those with ``data.chat_template: none``; the
shipped ``benchmarks/longbench_fewshot`` config does) and stops samsum at a newline (its score
keeps the first line anyway). ``max_length`` reproduces its truncation: a prompt longer than that
many tokens keeps its first and last ``max_length / 2`` (``model2maxlen.json``: 31500 for 32k
models, 3500 for 4k ones).
"""

from __future__ import annotations

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
    truncate_before_question,
)

__all__ = ["LONGBENCH_MAXLEN", "LONGBENCH_PROMPTS", "LongBenchDataset"]

#: ``config/dataset2prompt.json`` (THUDM/LongBench v1)
LONGBENCH_PROMPTS: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",  # noqa: E501
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",  # noqa: E501
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",  # noqa: E501
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',  # noqa: E501
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',  # noqa: E501
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
#: ``config/dataset2maxlen.json``: each task's output length
LONGBENCH_MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}  # fmt: skip
#: tasks ``pred.py`` prompts without the chat template
NO_CHAT_TEMPLATE = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
#: LongBench-E's 13 tasks (``<task>_e``)
LONGBENCH_E = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
    "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
TASKS = [*LONGBENCH_PROMPTS, *(f"{t}_e" for t in LONGBENCH_E)]


def _base(task: str) -> str:
    return task[:-2] if task.endswith("_e") else task


@DATASETS.register("longbench")
@dataclass
class LongBenchDataset:
    """LongBench v1 tasks read from ``path`` (a directory of ``<task>.jsonl`` or ``THUDM/LongBench``).

    ``tasks``: LongBench task names (``<task>_e`` for LongBench-E); ``samples_per_task``: the
    first N rows of each (null: all); ``max_length``: LongBench's middle truncation in tokens of
    the ``tokenizer`` model (null: none; tokenizer null: the run's ``model.model``). Scored by
    ``longbench_score`` (each task's official metric).
    """

    path: str
    tasks: list[str] = field(default_factory=lambda: ["hotpotqa"])
    samples_per_task: int | None = None
    max_length: int | None = None
    tokenizer: str | None = None
    processors: ProcessorSource | None = context_field()  # loads the tokenizer's processor (kvlab's)
    split: str = "test"
    metrics: tuple[str, ...] = ("longbench_score",)
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tasks = list(check_tasks(self.tasks, TASKS, "LongBench"))
        check_count(self.samples_per_task, "samples_per_task", allow_none=True)
        check_count(self.max_length, "max_length", least=64, allow_none=True)
        check_tokenizer_name(self.tokenizer, self.processors)
        if self.max_length is not None and self.tokenizer is None:
            require_tokenizer(None, self.processors, "longbench", "max_length")
        self.metrics = check_metrics(self.metrics)
        for task in self.tasks:
            rows = read_task_rows(self.path, task, [f"{task}.jsonl"], task, self.split)
            rows = rows[: self.samples_per_task] if self.samples_per_task is not None else rows
            for index, row in enumerate(rows):
                self._check_row(task, index, row)
            self._rows[task] = rows

    @staticmethod
    def _check_row(task: str, index: int, row: dict[str, Any]) -> None:
        where = f"data.dataset.path: LongBench task '{task}' row {index}"
        for key in ("context", "input"):
            if not isinstance(row.get(key), str):
                raise ConfigError(f"{where} has no string '{key}' field (fields: {', '.join(row)}).")
        answers = row.get("answers")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise ConfigError(f"{where}: 'answers' must be a non-empty list of strings, got {answers!r}.")
        if _base(task) in ("trec", "lsht") and not isinstance(row.get("all_classes"), list):
            raise ConfigError(f"{where}: 'all_classes' must list the class names (classification task).")

    def samples(self) -> list[Sample]:
        """One sample per row, tasks in order."""
        counter = (
            require_tokenizer(self.tokenizer, self.processors, "longbench", "max_length")
            if self.max_length
            else None
        )
        out = []
        for task in self.tasks:
            base = _base(task)
            before, after = split_at_context(LONGBENCH_PROMPTS[base])
            for index, row in enumerate(self._rows[task]):
                question = fill(after, input=row["input"])
                prompt = fill(before, input=row["input"]) + row["context"] + question
                dropped = 0
                if counter is not None:
                    row_name = f"LongBench task '{task}' row {index}"
                    prompt, dropped = truncate_before_question(
                        counter, prompt, question, self.max_length, row_name
                    )
                meta = {
                    "suite": "longbench",
                    "task": task,
                    "length": row.get("length"),
                    "language": row.get("language"),
                    "all_classes": row.get("all_classes"),
                    "source_id": row.get("_id"),
                    "reference_chat_template": "none" if base in NO_CHAT_TEMPLATE else "model",
                }
                if dropped:
                    meta["truncated_tokens"] = dropped
                out.append(
                    Sample(
                        id=f"longbench-{task}-{index:04d}",
                        prompt=prompt,
                        question=question,
                        answers=list(row["answers"]),
                        max_new_tokens=LONGBENCH_MAXLEN[base],
                        meta=meta,
                    )
                )
        return out

"""The long-context benchmark datasets (kvlab.data.benchmarks): token-measured lengths on two
tokenizers, the loaders on small fixtures in each suite's real schema (tests/fixtures/benchmarks, no
download), the needle grid and heatmap, and the shipped benchmark configs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support.paths import FIXTURES

from kvlab.config.errors import ConfigError
from kvlab.config.loader import check_fields, load_config, presets_dir, resolve
from kvlab.data import DATASETS
from kvlab.data.benchmarks import (
    InfiniteBenchDataset,
    LongBenchDataset,
    LooGLEDataset,
    NeedleHaystack,
    RulerDataset,
    needle_grid,
    needle_heatmap,
    task_table,
)
from kvlab.data.benchmarks.infinitebench import official_labels
from kvlab.data.benchmarks.longbench import LONGBENCH_PROMPTS
from kvlab.data.sample import Sample
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.data.tokens import fit_units, token_counter
from kvlab.metrics.tasks import check_task_samples, score_output
from kvlab.models import PROCESSORS

BENCHMARKS = FIXTURES / "benchmarks"


# ---- token-measured lengths --------------------------------------------------------------------
def test_fit_units_finds_the_largest_fitting_count() -> None:
    def length(n: int) -> int:
        return 40 + 7 * n + (n % 3)  # a non-uniform, non-decreasing cost

    for limit in (48, 100, 1000, 5000):
        for start in (1, 5, 500):
            n, used = fit_units(length, limit, start)  # type: ignore[misc]
            assert used == length(n) <= limit < length(n + 1)
    assert fit_units(length, 30, 10) is None


@pytest.mark.parametrize("tokenizer", ["tiny-qwen2", "smollm2-135m"])
def test_retrieval_context_tokens_measured_with_the_tokenizer(tokenizer: str) -> None:
    counter = token_counter(tokenizer, PROCESSORS)
    for target, pairs in ((512, 1), (2048, 4)):
        data = SyntheticRetrieval(
            num_samples=1,
            context_tokens=target,
            num_pairs=pairs,
            seed=3,
            tokenizer=tokenizer,
            processors=PROCESSORS,
        )
        for index, sample in enumerate(data.samples()):
            n_tokens = counter.count_prompt(sample)
            assert n_tokens == sample.meta["prompt_tokens"] and target - 48 <= n_tokens <= target
            sentences = sample.prompt.count(".") - pairs  # one period per filler sentence and fact
            longer = data._sample(index, sample.meta["needle_depth"], sentences + 1)
            assert counter.count_prompt(longer) > target  # one more sentence would not fit
    # tiny-qwen2's 1k-token vocabulary needs ~2.5x SmolLM2's tokens for the same text
    if tokenizer == "tiny-qwen2":
        words = len(
            SyntheticRetrieval(num_samples=1, context_tokens=4096, tokenizer=tokenizer, processors=PROCESSORS)
            .samples()[0]
            .prompt.split()
        )
        assert words < 2000


def test_retrieval_context_tokens_needs_a_tokenizer_and_a_processor_source() -> None:
    with pytest.raises(ConfigError, match="data.dataset.tokenizer"):
        SyntheticRetrieval(context_tokens=1024)
    with pytest.raises(ConfigError, match="data.dataset.tokenizer"):
        SyntheticRetrieval(context_tokens=1024, tokenizer="no-such-model", processors=PROCESSORS)
    built = DATASETS.build(
        {"name": "synthetic_retrieval", "context_tokens": 600},
        "data.dataset",
        tokenizer="tiny-qwen2",
        processors=PROCESSORS,
    )
    assert built.tokenizer == "tiny-qwen2"  # what kvlab predict passes: the run's model
    assert built.processors is PROCESSORS  # and how that model's processor loads
    with pytest.raises(ConfigError, match="processors=kvlab.models.PROCESSORS"):  # data loads no model
        SyntheticRetrieval(context_tokens=600, tokenizer="tiny-qwen2").samples()
    assert SyntheticRetrieval(context_words=50).samples()  # words need no tokenizer


# ---- RULER ------------------------------------------------------------------------------------
TINY_TASKS = [
    "niah_single_1",
    "niah_single_2",
    "niah_multikey_2",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "fwe",
]


@pytest.mark.parametrize(
    ("tokenizer", "tasks"), [("tiny-qwen2", TINY_TASKS), ("smollm2-135m", ["niah_single_3", "cwe"])]
)
def test_ruler_lengths_fit_the_run_tokenizer(tokenizer: str, tasks: list[str]) -> None:
    data = RulerDataset(
        tasks=tasks, lengths=[1024, 2048], samples_per_task=1, tokenizer=tokenizer, processors=PROCESSORS
    )
    counter = token_counter(tokenizer, PROCESSORS)
    samples = data.samples()
    assert [s.id for s in samples] == [f"ruler-{t}-{n}-0000" for t in tasks for n in (1024, 2048)]
    for s in samples:
        total = counter.count_prompt(s) + s.max_new_tokens
        length, units = s.meta["length"], s.meta["haystack_units"]
        assert total == s.meta["prompt_tokens"] + s.max_new_tokens <= length
        assert total > 0.85 * length  # within one haystack unit (a noise paragraph, a needle line)
        longer = data.prompt(s.meta["task"], length, 0, units + 1)
        assert counter.count_prompt(longer) + s.max_new_tokens > length  # one more unit would not fit
        assert s.prompt.endswith(s.question) and s.context + s.question == s.prompt
        assert s.answers and score_output(" ".join(s.answers), s, data.metrics) == {"string_match_all": 1.0}
        if s.meta["task"].startswith("niah"):
            assert all(a in s.context for a in s.answers) and all(k in s.question for k in s.meta["keys"])
    assert [s.prompt for s in data.samples()] == [s.prompt for s in samples]  # deterministic


def test_ruler_templates_and_answers() -> None:
    data = RulerDataset(
        tasks=["niah_single_1", "vt", "fwe"],
        lengths=[1024],
        samples_per_task=1,
        tokenizer="tiny-qwen2",
        processors=PROCESSORS,
    )
    niah, vt, fwe = data.samples()
    assert niah.prompt.startswith("A special magic number is hidden within the following text.")
    assert (
        niah.answer_prefix
        == f" The special magic number for {niah.meta['keys'][0]} mentioned in the provided text is"
    )
    assert (
        f"One of the special magic numbers for {niah.meta['keys'][0]} is: {niah.answers[0]}." in niah.prompt
    )
    assert (niah.max_new_tokens, vt.max_new_tokens, fwe.max_new_tokens) == (128, 30, 50)
    # vt: a worked example, then the chain VAR A = <value>, VAR B = VAR A, ... to name in full
    assert vt.prompt.count("Memorize and track the chain(s)") == 2 and len(vt.answers) == 5
    assert f"VAR {vt.answers[0]} = {vt.meta['value']}" in vt.context
    assert all(f"VAR {b} = VAR {a} " in vt.context for a, b in zip(vt.answers, vt.answers[1:], strict=False))
    # fwe: the three answers are the most frequent coded words after the "..." noise
    counts = {w: fwe.context.split().count(w) for w in set(fwe.context.split())}
    top = sorted((c, w) for w, c in counts.items() if w != "..." and len(w) == 6)[-3:]
    assert sorted(fwe.answers) == sorted(w for _, w in top)


def test_ruler_validation() -> None:
    for bad, field in (({"tasks": ["qa_1"]}, "SQuAD"), ({"tasks": ["niah_singel_1"]}, "niah_single_1"),
                       ({"lengths": [100]}, "lengths"), ({"lengths": 4096}, "lengths"),
                       ({"samples_per_task": 0}, "samples_per_task")):  # fmt: skip
        with pytest.raises(ConfigError, match=field):
            DATASETS.build({"name": "ruler", **bad}, "data.dataset")
    with pytest.raises(ConfigError, match="data.dataset.tokenizer"):
        RulerDataset(tasks=["fwe"], lengths=[1024]).samples()
    with pytest.raises(ConfigError, match="too short"):
        RulerDataset(
            tasks=["cwe"], lengths=[512], samples_per_task=1, tokenizer="tiny-qwen2", processors=PROCESSORS
        ).samples()


# ---- LongBench ----------------------------------------------------------------------------------
def _rows(task: str, suite: str = "longbench") -> list[dict[str, Any]]:
    lines = (BENCHMARKS / suite / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def test_longbench_prompts_lengths_and_scores() -> None:
    tasks = ["hotpotqa", "trec", "samsum", "lcc", "passage_retrieval_en"]
    data = LongBenchDataset(path=str(BENCHMARKS / "longbench"), tasks=tasks)
    samples = data.samples()
    assert [s.meta["task"] for s in samples] == ["hotpotqa", "hotpotqa", *tasks[1:]]
    for s in samples:
        row = _rows(s.meta["task"])[int(s.id[-4:])]
        assert s.prompt == LONGBENCH_PROMPTS[s.meta["task"]].format(
            context=row["context"], input=row["input"]
        )
        assert s.context.endswith(row["context"]) and s.question and s.answer_prefix == ""
        assert score_output(s.answers[0], s, data.metrics) == {"longbench_score": pytest.approx(1.0)}
    hotpot, _, trec, samsum, lcc, retrieval = samples
    assert hotpot.question == (
        "\n\nAnswer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nQuestion: Which city is the Eiffel Tower in?\nAnswer:"
    )
    assert [s.max_new_tokens for s in samples] == [32, 32, 64, 128, 64, 32]  # dataset2maxlen.json
    assert (trec.meta["reference_chat_template"], hotpot.meta["reference_chat_template"]) == ("none", "model")
    assert score_output("City\nIndividual", trec, ["longbench_score"]) == {"longbench_score": 1.0}  # 1st line
    assert score_output("Paragraph 2", retrieval, ["longbench_score"]) == {"longbench_score": 1.0}
    assert lcc.question == "Next line of code:\n" and samsum.question.endswith("Summary: ")


def test_longbench_truncation_keeps_head_and_question() -> None:
    data = LongBenchDataset(
        path=str(BENCHMARKS / "longbench"),
        tasks=["hotpotqa"],
        max_length=170,
        tokenizer="tiny-qwen2",
        processors=PROCESSORS,
    )
    full = LongBenchDataset(path=str(BENCHMARKS / "longbench"), tasks=["hotpotqa"]).samples()
    counter = token_counter("tiny-qwen2", PROCESSORS)
    for short, long in zip(data.samples(), full, strict=True):
        assert counter.count_text(short.prompt) <= 170 < counter.count_text(long.prompt)
        assert short.meta["truncated_tokens"] > 0 and short.prompt.endswith(long.question)
        assert short.prompt.startswith("Answer the question based on the given passages.")
    with pytest.raises(ConfigError, match="'hotpotqa' row 0 to 64 tokens cuts into its question"):
        LongBenchDataset(
            path=str(BENCHMARKS / "longbench"),
            tasks=["hotpotqa"],
            max_length=64,
            tokenizer="tiny-qwen2",
            processors=PROCESSORS,
        ).samples()


def test_longbench_refusals_and_schema(tmp_path: Path) -> None:
    path = str(BENCHMARKS / "longbench")
    with pytest.raises(ConfigError, match="no file for task 'qasper'"):
        LongBenchDataset(path=path, tasks=["qasper"])
    with pytest.raises(ConfigError, match="not a directory"):
        LongBenchDataset(path=str(tmp_path / "missing"), tasks=["hotpotqa"])
    with pytest.raises(ConfigError, match="data.dataset.tokenizer"):
        LongBenchDataset(path=path, tasks=["hotpotqa"], max_length=100)
    (tmp_path / "hotpotqa.jsonl").write_text(
        json.dumps({"input": "q", "context": "c", "answers": "x"}) + "\n"
    )
    with pytest.raises(ConfigError, match="'answers' must be a non-empty list"):
        LongBenchDataset(path=str(tmp_path), tasks=["hotpotqa"])


def test_chinese_longbench_needs_jieba_and_whitespace_metrics_refuse_chinese(monkeypatch) -> None:
    """multifieldqa_zh, dureader and vcsum are scored on jieba's words; without jieba the run is
    refused before the model loads, naming the install command (never a whitespace fallback)."""
    zh = Sample("longbench-vcsum-0000", "p", answers=["会议讨论项目进度。"], meta={"task": "vcsum"})
    check_task_samples(["longbench_score"], [zh])
    assert score_output("项目。进度。", zh, ["longbench_score"])["longbench_score"] > 0
    with pytest.raises(ConfigError, match=r"longbench_qa_f1'.*Chinese.*use longbench_score"):
        check_task_samples(["longbench_qa_f1"], [Sample("q", "p", answers=["北京"])])
    with pytest.raises(ConfigError, match="longbench_rouge_l'.*Chinese"):
        check_task_samples(["longbench_rouge_l"], [zh])
    monkeypatch.setitem(sys.modules, "jieba", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"sample 'longbench-vcsum-0000'.*jieba.*pip install 'kvlab\[zh\]'"):
        check_task_samples(["longbench_score"], [zh])
    with pytest.raises(ConfigError, match="needs jieba"):
        score_output("项目", zh, ["longbench_score"])


def test_longbench_reads_a_saved_hf_dataset(tmp_path: Path) -> None:
    import datasets

    rows = _rows("hotpotqa")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    data = LongBenchDataset(path=str(tmp_path / "saved"), tasks=["hotpotqa"], samples_per_task=1)
    assert [s.answers for s in data.samples()] == [rows[0]["answers"]]


# ---- InfiniteBench -------------------------------------------------------------------------------
def test_infinitebench_prompts_and_labels() -> None:
    tasks = ["passkey", "kv_retrieval", "longbook_choice_eng", "code_run", "math_find", "code_debug"]
    data = InfiniteBenchDataset(path=str(BENCHMARKS / "infinitebench"), tasks=tasks)
    passkey, kv, choice, code_run, math_find, debug = data.samples()
    assert passkey.question == "\n\nWhat is the pass key?\n\nThe pass key is" and passkey.max_new_tokens == 6
    assert choice.answers == ["Light housework", "C"]  # get_answer: option text and letter
    assert choice.question.endswith("D. Taking care of Totty\n\nThe letter of the correct answer is")
    assert code_run.prompt.startswith("There is a function called func_2 in the following Python code.")
    assert code_run.question.endswith(
        "Please compute the exact value of func_2(-4). The value of func_2(-4) is"
    )
    assert math_find.prompt.startswith("What is the largest number in the following list?\n\n[3, 88, 14, 7]")
    assert debug.answers == ["broken", "B"]
    outputs = [" 71432.", "beef-2", "C", " -6", " 88", "B. broken"]
    for sample, output in zip(data.samples(), outputs, strict=True):
        assert sample.prompt.endswith(sample.question)
        assert score_output(output, sample, data.metrics) == {"infinitebench_score": 1.0}
    assert score_output("12345", passkey, data.metrics) == {"infinitebench_score": 0.0}


def test_infinitebench_math_calc_nested_labels_are_unwrapped_and_every_sample_scored() -> None:
    """The official data nests math_calc's label ([[1, 3, 6, 7]]); get_score_one_math_calc takes
    label[0] (commit 88b3daa). Every sample gets a score: none drops out of the mean."""
    data = InfiniteBenchDataset(path=str(BENCHMARKS / "infinitebench"), tasks=["math_calc"])
    first, negative = data.samples()
    assert first.answers == ["1", "3", "6", "7"] and negative.answers == ["4", "-1", "-3"]
    assert score_output("[1, 3, 6, 7]", first, data.metrics) == {"infinitebench_score": 1.0}
    assert score_output("[1, 3, 5, 7]", first, data.metrics) == {"infinitebench_score": 0.5}
    assert score_output("I cannot compute that.", first, data.metrics) == {"infinitebench_score": 0.0}
    # re.split("[^0-9]") drops minus signs, so a negative value never matches: 1 of 3 (official too)
    assert score_output("[4, -1, -3]", negative, data.metrics) == pytest.approx(
        {"infinitebench_score": 1 / 3}
    )
    assert official_labels("math_calc", "[1, 3]") == ["1", "3"]  # a copy cast to strings
    assert official_labels("math_calc", [[2, 5]]) == official_labels("math_calc", [2, 5]) == ["2", "5"]


def test_infinitebench_labels_of_the_wrong_shape_are_refused_before_the_model_loads() -> None:
    def sample(task: str, answers: list[str]) -> Sample:
        return Sample(f"infinitebench-{task}-0000", "p", answers=answers, meta={"task": task})

    names = ("infinitebench_score",)
    check_task_samples(names, [sample("math_calc", ["1", "3"]), sample("code_run", ["-6"])])
    for task, answers, message in [
        ("math_calc", ["[1, 3, 6, 7]"], "list of integers"),
        ("math_find", ["eighty"], "math_find label is a number"),
        ("code_run", ["six"], "code_run label is an integer"),
        ("longbook_choice_eng", ["Light housework"], r"\[option text, letter A-D\]"),
    ]:
        with pytest.raises(ConfigError, match=f"sample 'infinitebench-{task}-0000' .*{message}"):
            check_task_samples(names, [sample(task, answers)])


# ---- LongBench v2 --------------------------------------------------------------------------------
def test_longbench_v2_prompt_choices_and_splits() -> None:
    path = str(BENCHMARKS / "longbench_v2")
    easy, hard, long = DATASETS.build({"name": "longbench_v2", "path": path}).samples()
    assert easy.prompt.startswith("Please read the following text and answer the question below.\n\n<text>\n")
    assert (
        "<text>\nThe lighthouse on the cape was painted white in 1902, after the storm.\n</text>"
        in easy.prompt
    )
    assert easy.question.endswith('(B) White\n(C) Green\n(D) Blue\n\nFormat your response as follows: '
                                  '"The correct answer is (insert answer here)".')  # fmt: skip
    assert "What is the correct answer to this question: What colour is the lighthouse?\n" in easy.question
    assert easy.prompt.endswith(easy.question) and easy.max_new_tokens == 128 and easy.answers == ["B"]
    assert (easy.meta["difficulty"], easy.meta["length"], hard.meta["length"]) == ("easy", "short", "medium")
    assert score_output("The correct answer is (B)", easy, ["longbench_v2_accuracy"]) == {
        "longbench_v2_accuracy": 1.0
    }
    assert score_output("I think (B).", easy, ["longbench_v2_accuracy"]) == {"longbench_v2_accuracy": 0.0}
    hard_only = DATASETS.build(
        {"name": "longbench_v2", "path": path, "difficulties": ["hard"], "lengths": ["long"]}
    )
    assert [s.id for s in hard_only.samples()] == [long.id]
    with pytest.raises(ConfigError, match="difficulties must be a non-empty list of easy, hard"):
        DATASETS.build({"name": "longbench_v2", "path": path, "difficulties": ["medium"]})


# ---- MATH-500, AIME25 ----------------------------------------------------------------------------
def test_math_problems_are_prompted_to_box_their_answer_and_checked_by_math_verify() -> None:
    half, polar = DATASETS.build({"name": "math500", "path": str(BENCHMARKS / "math500")}).samples()
    (aime,) = DATASETS.build({"name": "aime25", "path": str(BENCHMARKS / "aime25" / "test.jsonl")}).samples()
    assert half.prompt == (
        "Compute $\\dfrac{3}{6}$.\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert half.answers == ["\\frac{1}{2}"] and half.max_new_tokens == 4096 and half.meta["level"] == 1
    assert aime.answers == ["70"] and aime.id == "aime25-0000"
    names = ["math_verify_accuracy"]
    check_task_samples(names, [half, polar, aime])
    assert score_output("so it is $\\boxed{0.5}$", half, names) == {"math_verify_accuracy": 1.0}
    assert score_output("\\boxed{(3, \\frac{\\pi}{2})}", polar, names) == {"math_verify_accuracy": 1.0}
    assert score_output("I am not sure.", aime, names) == {"math_verify_accuracy": 0.0}
    with pytest.raises(ConfigError, match="Math-Verify cannot parse its reference answer"):
        check_task_samples(names, [Sample("bad", "p", answers=["\\"])])


@pytest.mark.parametrize(
    "protocol",
    ["query_aware", "{name: decode_time, interval: 4, target_size: 20}"],
)
def test_math500_runs_under_query_aware_and_decode_time(tmp_path: Path, protocol: str) -> None:
    from support.cli import TINY_MODEL, predict

    knorm = ["--model.compression.budget", "{tokens: 10000, window: 4}"]
    dataset = f"{{name: math500, path: {BENCHMARKS / 'math500'}, max_new_tokens: 10}}"
    predict(tmp_path, "--config", "knorm.yaml", *TINY_MODEL, *knorm, "--model.protocol", protocol,
            "--data.dataset", dataset)  # fmt: skip
    run_dir = tmp_path / "runs" / "exp" / "knorm"
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["math_verify_accuracy"] for r in records] == [0.0, 0.0]  # a random tiny model
    assert [r["max_new_tokens"] for r in records] == [10, 10]  # the dataset's limit
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["task_samples"] == {"math_verify_accuracy": 2}


# ---- SCBench ------------------------------------------------------------------------------------
def test_scbench_turns_share_their_context_and_keep_the_official_labels() -> None:
    data = DATASETS.build({"name": "scbench", "path": str(BENCHMARKS / "scbench"),
                           "tasks": ["scbench_kv", "scbench_choice_eng", "scbench_mf"]})  # fmt: skip
    kv1, kv2, kv3, choice1, choice2, mf1, mf2 = data.samples()
    head = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
    assert (
        kv1.prompt.startswith(head) and kv1.prompt.endswith(kv1.question) and kv1.question.startswith("Key:")
    )
    assert kv1.context_id == kv2.context_id != kv3.context_id and kv1.context == kv2.context
    assert (kv1.max_new_tokens, choice1.max_new_tokens, mf1.max_new_tokens) == (150, 40, 5)
    assert choice2.meta["label"] == ["Georgie", "B"] and choice2.question.endswith(
        "\n\nThe the correct answer is"
    )
    assert mf1.meta["label"] == 88 and mf1.answers == ["88"]
    assert mf1.prompt.startswith("The largest number of the list is: \n\n[3, 88, 14, 7]")  # turn 1 as prefix
    assert mf2.question == "What is the smallest number of the list?\n\nThe smallest number of the list is: "
    check_task_samples(data.metrics, data.samples())
    outputs = ['"beef-2"', "cafe-3", "x", "B", "B. Georgie", "88", "3"]
    scores = [
        score_output(o, s, data.metrics)["scbench_score"]
        for o, s in zip(outputs, data.samples(), strict=True)
    ]
    assert scores == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="scbench_mf label 'eighty'"):
        check_task_samples(
            ["scbench_score"], [Sample("x", "p", meta={"task": "scbench_mf", "label": "eighty"})]
        )


def test_scbench_mf_list_context_is_written_as_the_official_prompt_writes_it(tmp_path: Path) -> None:
    """scbench_mf's context is a list of integers (the dataset card: ``sequence: int64``), and
    ``create_scdq_prompt`` puts it into ``"{prefix}\\n\\n{context}"`` with ``str.format``, which writes
    a list as Python prints it. The same list stored as that text gives the same samples; a list
    context of another task, or a list of non-integers, is refused naming the row."""
    row = _rows("scbench_mf", "scbench")[0]
    assert row["context"] == [3, 88, 14, 7]  # the fixture has the Hub's shape
    largest, smallest = DATASETS.build({"name": "scbench", "path": str(BENCHMARKS / "scbench"),
                                        "tasks": ["scbench_mf"]}).samples()  # fmt: skip
    first = "The largest number of the list is: "
    assert largest.context == smallest.context == f"{first}\n\n[3, 88, 14, 7]"
    assert largest.prompt == f"{first}\n\n[3, 88, 14, 7]What is the largest number of the list?\n\n{first}"
    (tmp_path / "scbench_mf.jsonl").write_text(json.dumps({**row, "context": "[3, 88, 14, 7]"}) + "\n")
    as_text = DATASETS.build({"name": "scbench", "path": str(tmp_path), "tasks": ["scbench_mf"]})
    assert as_text.samples() == [largest, smallest]
    mf = "'context' must be a string or a list of integers, got"
    for task, context, refusal in [
        ("scbench_kv", [3, 88], "'context' must be a string, got a list"),
        ("scbench_mf", [3, 8.5, "x"], f"{mf} a list holding float, str"),
        ("scbench_mf", None, f"{mf} nothing"),
    ]:
        (tmp_path / f"{task}.jsonl").write_text(json.dumps({**row, "context": context}) + "\n")
        with pytest.raises(ConfigError, match=f"SCBench task '{task}' row 0: {refusal}"):
            DATASETS.build({"name": "scbench", "path": str(tmp_path), "tasks": [task]})


def test_scbench_runs_under_multi_question_one_compression_per_context(tmp_path: Path) -> None:
    from support.cli import TINY_MODEL, predict

    dataset = f"{{name: scbench, path: {BENCHMARKS / 'scbench'}, tasks: [scbench_kv]}}"
    predict(tmp_path, "--config", "knorm.yaml", *TINY_MODEL, "--model.protocol", "multi_question",
            "--data.dataset", dataset, "--data.batch_size", "1")  # fmt: skip
    run_dir = tmp_path / "runs" / "exp" / "knorm"
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["context_questions"] for r in records] == [2, 2, 1]  # both turns of row 0 on one compression
    assert all(r["protocol"] == "multi_question" and "scbench_score" in r for r in records)
    assert json.loads((run_dir / "metrics.json").read_text())["task_samples"] == {"scbench_score": 3}


# ---- LooGLE --------------------------------------------------------------------------------------
def test_loogle_questions_share_their_document() -> None:
    data = LooGLEDataset(
        path=str(BENCHMARKS / "loogle"), tasks=["shortdep_qa", "shortdep_cloze", "longdep_summarization"]
    )
    qa1, qa2, cloze, summary = data.samples()
    document = _rows("shortdep_qa", "loogle")[0]["input"]
    assert qa1.context_id == qa2.context_id != cloze.context_id and qa1.context == qa2.context
    head = "Please answer the question based on the long texts below. \n"
    assert qa1.prompt == f"{head}{document}\nQuestion: Where does Tank work?\nAnswer: "
    assert qa1.question == "\nQuestion: Where does Tank work?\nAnswer: " and qa1.max_new_tokens == 300
    assert (
        cloze.meta["cloze_answer"] == {"<mask-0>": "Tank", "<mask-1>": "JoAnn Fabrics"}
        and cloze.max_new_tokens == 50
    )
    assert "{'<mask-0>': 'Bob'" in cloze.prompt  # the template's escaped braces
    assert summary.question == "\n Summarization: " and summary.max_new_tokens == 500
    assert data.metrics == (*(f"loogle_{m}" for m in ("bleu1", "bleu4", "rouge1", "rouge2", "rouge_l")),
                            "loogle_cloze_exact", "loogle_cloze_partial")  # fmt: skip
    scores = score_output("{'<mask-0>': 'Tank', '<mask-1>': 'JoAnn'}", cloze, data.metrics)
    assert scores == {"loogle_cloze_exact": 0.5, "loogle_cloze_partial": 1.0}
    assert score_output("JoAnn Fabrics", qa1, data.metrics)["loogle_rouge_l"] == pytest.approx(1.0)
    short = LooGLEDataset(
        path=str(BENCHMARKS / "loogle"),
        tasks=["shortdep_qa"],
        max_length=80,
        tokenizer="tiny-qwen2",
        processors=PROCESSORS,
    )
    a, b = short.samples()
    assert a.context == b.context and a.meta["truncated_tokens"] > 0  # one cut, shared


# ---- needle in a haystack ------------------------------------------------------------------------
def test_needle_grid_and_heatmap(tmp_path: Path) -> None:
    data = NeedleHaystack(
        lengths=[400, 800], depths=[0, 50, 100], tokenizer="tiny-qwen2", processors=PROCESSORS
    )
    samples = data.samples()
    assert [(s.meta["length"], s.meta["depth"]) for s in samples] == [
        (n, d) for n in (400, 800) for d in (0, 50, 100)
    ]
    counter = token_counter("tiny-qwen2", PROCESSORS)
    needle = data.needle.strip()
    for s in samples:
        assert s.prompt.endswith(s.question) and needle in s.context and s.max_new_tokens == 300
        haystack = s.context.replace(data.needle, "")
        assert counter.count_text(haystack) <= s.meta["length"] - data.buffer
        where = s.context.index(needle) / len(haystack)  # share of the haystack before the needle
        assert {0: where < 0.05, 50: 0.3 < where <= 0.55, 100: where > 0.95}[int(s.meta["depth"])]
    rows = []
    for s in samples:
        output = "Eat a sandwich and sit in Dolores Park." if s.meta["depth"] < 100 else "No idea."
        rows.append({"id": s.id, "meta": s.meta, **score_output(output, s, data.metrics)})
    lengths, depths, grid = needle_grid(rows)
    assert (
        (lengths, depths) == ([400, 800], [0.0, 50.0, 100.0]) and grid[2] == [0.0, 0.0] and grid[0][0] > 0.5
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = needle_heatmap(tmp_path / "run", tmp_path / "plots" / "needle.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| needle | 400 | 3 |" in task_table(rows, ["needle_rouge1"])
    with pytest.raises(ConfigError, match="no prediction"):
        needle_heatmap([{"id": "x"}], tmp_path / "x.png")
    with pytest.raises(ConfigError, match="buffer"):
        NeedleHaystack(lengths=[100], tokenizer="tiny-qwen2", processors=PROCESSORS)


# ---- shipped configs -----------------------------------------------------------------------------
SHIPPED = sorted(p.stem for p in (presets_dir() / "benchmarks").glob("*.yaml"))
LOCAL: dict[str, list[str] | None] = {
    "longbench": ["hotpotqa"],
    "longbench_fewshot": ["trec"],
    "infinitebench": ["passkey"],
    "loogle": ["shortdep_qa"],
    "longbench_v2": None,  # no tasks: one multiple-choice set
    "math500": None,
    "aime25": None,
    "scbench": ["scbench_kv"],
}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_benchmark_configs_validate(name: str) -> None:
    from kvlab.runner.datamodule import KVLabDataModule

    assert load_config(f"benchmarks/{name}")["data"]["dataset"]["name"]
    cfg = resolve(["snapkv", f"benchmarks/{name}"], [])
    assert cfg["run"]["method"] == "snapkv" and cfg["run"]["experiment"] == name  # the method keeps its name
    check_fields(cfg, {"data": KVLabDataModule})
    node = dict(cfg["data"]["dataset"])
    if name in LOCAL:  # the Hub copies are not downloaded in tests: the fixtures have the same schema
        suite = node["name"]
        node.update(path=str(BENCHMARKS / suite), **({"tasks": LOCAL[name]} if LOCAL[name] else {}))
    else:  # generated suites: a small slice
        node.update({"lengths": [1024]} if node["name"] == "ruler" else {"lengths": [400], "depths": [50]})
        node.update({"tasks": ["niah_single_1"], "samples_per_task": 1} if node["name"] == "ruler" else {})
    dataset = DATASETS.build(node, "data.dataset", tokenizer="tiny-qwen2", processors=PROCESSORS)
    assert dataset.samples() and dataset.metrics


def test_longbench_tasks_prompted_raw_are_refused_with_a_chat_template() -> None:
    """trec & co. are prompted without a chat template by LongBench: a run applying one is refused."""
    from kvlab.runner.datamodule import KVLabDataModule

    node = {"name": "longbench", "path": str(BENCHMARKS / "longbench"), "tasks": ["trec"]}
    with pytest.raises(ConfigError, match="data.chat_template: none"):
        KVLabDataModule(dataset=node, model="tiny-qwen2", chat_template="auto").setup()
    KVLabDataModule(dataset=node, model="tiny-qwen2", chat_template="none").setup()

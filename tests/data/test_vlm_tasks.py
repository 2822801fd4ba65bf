"""VLM benchmark loaders on local fixtures in each Hub dataset's schema (tests/fixtures/vlm_tasks/,
written by make_fixtures.py): prompts as lmms-eval builds them, answers, limits, metrics."""

import pytest
from support import e2e
from support.paths import FIXTURES

from kvlab.config.errors import ConfigError
from kvlab.data import DATASETS
from kvlab.metrics.tasks import score_output, validate_task_metrics
from kvlab.pipeline import Pipeline

VLM_TASKS = FIXTURES / "vlm_tasks"
SHORT = "\nAnswer the question using a single word or phrase."


def load(task, **params):
    return DATASETS.build({"name": task, "path": str(VLM_TASKS / f"{task}.parquet"), **params})


def test_docvqa_prompts_answers_and_anls_match_lmms_eval():
    ds = load("docvqa")
    first, second, third = ds.samples()
    assert first.id == "docvqa-49153" and first.prompt == "What is the date on the form?" + SHORT
    assert first.question == first.prompt and first.context == "" and len(first.images) == 1
    assert first.answers == ["1/2/99", "January 2, 1999"] and first.max_new_tokens == 128
    assert first.context_id == second.context_id == "docvqa-doc14465" != third.context_id  # same page
    assert first.meta["task"] == first.meta["task_family"] == "docvqa" and first.meta["docId"] == 14465
    assert ds.metrics == ("anls",)
    assert score_output("January 2, 1999", first, ds.metrics) == {"anls": 1.0}


def test_chartqa_ids_prompts_and_relaxed_accuracy():
    ds = load("chartqa", limit=2)
    samples = ds.samples()
    assert [s.id for s in samples] == ["chartqa-test-0", "chartqa-test-1"]  # no id column: split-row
    assert samples[1].prompt == "What is the value of Italy?" + SHORT and samples[1].max_new_tokens == 16
    assert samples[1].meta["type"] == "augmented_test" and samples[0].context_id is None
    assert score_output("0.46", samples[1], ds.metrics) == {"relaxed_accuracy": 1.0}  # within 5% of 45%


def test_textvqa_prompts_and_vqa_accuracy_over_ten_answers():
    ds = load("textvqa")
    first, _, third = ds.samples()
    assert first.prompt == "What is the brand of this camera?" + SHORT  # capitalised as lmms-eval does
    assert len(first.answers) == 10 and first.id == "textvqa-34602"
    assert first.context_id == "textvqa-image003a8ae2ef43b901"
    # 6 of 10 say "dakota": every leave-one-out keeps >= 5 matches -> 1.0
    assert score_output("Dakota", first, ds.metrics) == {"vqa_accuracy": 1.0}
    # "14" 8 times, "fourteen" (not a mapped number word) and "1" once each: (8 * 7/3 -> 1, 2 * 1) -> 1.0
    assert score_output("14", third, ds.metrics) == {"vqa_accuracy": 1.0}


def test_ocrbench_prompts_and_scores_per_question_type():
    ds = load("ocrbench")
    regular, hme, kie = ds.samples()
    assert kie.prompt == "What is the date?"  # stripped question, no instruction
    assert (hme.meta["dataset"], hme.meta["question_type"]) == (
        "HME100k", "Handwritten Mathematical Expression Recognition")  # fmt: skip
    assert score_output("x ^ {2} + 1", hme, ds.metrics) == {"ocrbench": 1.0}
    assert score_output("It says hello", regular, ds.metrics) == {"ocrbench": 1.0}
    assert regular.max_new_tokens == 128


def test_mmmu_prompts_name_their_images_and_score_the_option_letter():
    ds = load("mmmu")
    bio, math, geo = ds.samples()
    assert bio.prompt == (
        "<image 1> Which organelle is shown?\nA. Nucleus\nB. Ribosome\nC. Mitochondrion\nD. Golgi apparatus"
        "\n\nAnswer with the option's letter from the given choices directly."
    )
    assert bio.choices == ["Nucleus", "Ribosome", "Mitochondrion", "Golgi apparatus"] and bio.answers == ["C"]
    assert math.prompt.endswith("\n\n" + SHORT.strip()) and math.choices == []
    assert len(bio.images) == 1 and len(math.images) == 2  # the images the prompt names
    assert bio.max_new_tokens == 16 and bio.id == "mmmu-validation_Biology_1"
    assert score_output("(C)", bio, ds.metrics) == {"mmmu_accuracy": 1.0}
    assert score_output("B", geo, ds.metrics) == {"mmmu_accuracy": 1.0}
    assert score_output("The slope is 2.50", math, ds.metrics) == {"mmmu_accuracy": 1.0}


def test_wrong_schema_and_bad_parameters():
    with pytest.raises(ConfigError, match=r"lacks the columns \['questionId', 'answers', 'docId'\]"):
        DATASETS.build({"name": "docvqa", "path": str(VLM_TASKS / "chartqa.parquet")})
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
        load("chartqa", max_new_tokens=0)
    with pytest.raises(ConfigError, match="unknown task metric"):  # the run checks the names
        validate_task_metrics(load("chartqa", metrics=["relaxed_acc"]).metrics)


def test_a_vlm_task_runs_on_a_tiny_vlm():
    """The samples go through a VLM's processor and a compressing pipeline; outputs are scored."""
    loaded = e2e.kvlab_model("tiny-qwen2-vl")
    samples = load("chartqa").samples()
    pipeline = Pipeline.from_config(
        {"budget": {"tokens": 12, "window": 4}, "importance": {"knorm": {"name": "key_norm"}}}
    )
    result = e2e.run(loaded, pipeline, samples, steps=3)
    assert len(result.tokens) == 3 and bool((result.kept <= 12).all())
    text = loaded.processor.decode(result.tokens[0])
    assert set(score_output(text, samples[0], ("relaxed_accuracy",))) == {"relaxed_accuracy"}

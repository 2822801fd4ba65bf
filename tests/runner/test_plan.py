"""The run plan: one validated, frozen config per run, the only thing the run's objects are built from."""

import dataclasses
import inspect

import pytest
import yaml

from kvlab.cli.predict import config_text
from kvlab.cli.predict_help import predict_help
from kvlab.config.errors import ConfigError
from kvlab.config.loader import resolve
from kvlab.runner.datamodule import KVLabDataModule
from kvlab.runner.fingerprint import fingerprint_fields
from kvlab.runner.module import KVLabModule
from kvlab.runner.plan import config_fields, plan_run


def snapkv_plan(**groups):
    cfg = resolve(["snapkv"], [])
    for group, fields in groups.items():
        cfg[group] = {**cfg.get(group, {}), **fields}
    return plan_run(cfg)


def test_the_plan_fills_every_default_and_is_frozen():
    plan = snapkv_plan(model={"model": "tiny-llama"})
    assert set(plan.model) == set(config_fields(KVLabModule))
    assert set(plan.data) == set(config_fields(KVLabDataModule))
    assert plan.data["model"] == "tiny-llama" and plan.model["max_new_tokens"] == 16
    assert plan.trainer["devices"] == 1 and plan.seed == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.seed = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.model["dtype"] = "bfloat16"  # type: ignore[index]
    arguments = plan.model_arguments()  # a copy: the module may keep and change it
    arguments["compression"]["budget"]["tokens"] = 1
    assert plan.model["compression"]["budget"]["tokens"] != 1


def test_config_yaml_run_again_is_the_same_run():
    """What ``config.yaml`` records (and ``--print_config`` prints) plans into the same run: the
    same fields, the same fingerprint."""
    plan = snapkv_plan(model={"model": "tiny-llama", "max_new_tokens": 3}, data={"limit": 2})
    again = yaml.safe_load(config_text(plan))
    replanned = plan_run(again)
    assert replanned == plan
    assert fingerprint_fields(replanned.config()) == fingerprint_fields(plan.config())


def test_wired_arguments_are_keyword_only_and_never_config_fields():
    """The run's driver gives the module its files and task metrics and the data module the samples
    already written, the context grouping and what needs each sample's question; a config cannot name them."""
    wiring = {
        KVLabModule: {"files", "task_metrics"},
        KVLabDataModule: {"skip_ids", "group_by_context", "question_split"},
    }
    for cls, wired in wiring.items():
        params = inspect.signature(cls.__init__).parameters
        assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} == wired
        assert not wired & set(config_fields(cls))
    with pytest.raises(ConfigError, match="unknown field model.files"):
        snapkv_plan(model={"files": {"run_dir": "/tmp"}})


def test_the_protocol_decides_the_batching_of_contexts():
    assert snapkv_plan().groups_contexts is False
    assert snapkv_plan(model={"protocol": "multi_question"}).groups_contexts is True


def test_the_plan_says_what_needs_each_samples_question():
    assert snapkv_plan().question_split is None
    assert (
        snapkv_plan(model={"protocol": "query_agnostic"}).question_split == "model.protocol = query_agnostic"
    )
    finch = {"compression": {"prefill": {"name": "progressive", "chunk": 64, "question": True}}}
    assert "question: true" in snapkv_plan(model=finch).question_split


def test_help_lists_every_config_field_and_no_wired_one():
    text = predict_help()
    for group, cls in (("model", KVLabModule), ("data", KVLabDataModule)):
        for name in config_fields(cls):
            if (group, name) != ("data", "model"):
                assert f"--{group}.{name} " in text
    for name in ("files", "task_metrics", "skip_ids", "group_by_context", "question_split", "trainer.logger"):
        assert f".{name} " not in text and f"--{name}" not in text
    assert "--trainer.max_steps (default: -1)" in text and "--run.overwrite (default: false)" in text

"""Registry validation, preset resolution and overrides: every bad input is a clear ConfigError."""

import pytest
import yaml

from kvlab.compression.importance import IMPORTANCE
from kvlab.config.errors import ConfigError
from kvlab.config.loader import find_config, load_config, merge, preset_names, resolve, split_overrides
from kvlab.pipeline import Pipeline

SNAP = {"budget": {"tokens": 64, "window": 16}, "importance": {"attention": {"name": "window_attention"}}}


def test_unknown_component_lists_known_names_and_closest_match():
    with pytest.raises(ConfigError) as err:
        Pipeline.from_config({**SNAP, "importance": {"attention": {"name": "window_atention"}}})
    msg = str(err.value)
    assert "window_atention" in msg and "Did you mean 'window_attention'" in msg
    assert "cumulative_attention" in msg  # known names listed
    assert "model.compression.importance.attention" in msg


def test_unknown_parameter_names_component_and_field():
    with pytest.raises(ConfigError) as err:
        Pipeline.from_config({**SNAP, "importance": {"attention": {"name": "window_attention", "windw": 8}}})
    msg = str(err.value)
    assert "window_attention" in msg and "'windw'" in msg and "Did you mean 'window'" in msg


def test_mistyped_parameter_names_the_field_and_type():
    with pytest.raises(ConfigError) as err:
        Pipeline.from_config(
            {**SNAP, "importance": {"attention": {"name": "window_attention", "kernel": "five"}}}
        )
    assert "'kernel' must be int" in str(err.value)
    with pytest.raises(ConfigError, match="'pool' must be"):
        Pipeline.from_config(
            {**SNAP, "importance": {"attention": {"name": "window_attention", "pool": "median"}}}
        )


def test_missing_required_parameter():
    from dataclasses import dataclass

    from kvlab.config.registry import Registry

    reg = Registry("thing", "x.thing")

    @reg.register("needs")
    @dataclass
    class Needs:
        size: int

    with pytest.raises(ConfigError, match="missing the required parameter 'size'"):
        reg.build({"name": "needs"})


def test_budget_below_protected_window():
    with pytest.raises(ConfigError) as err:
        Pipeline.from_config({**SNAP, "budget": {"tokens": 8, "window": 16}})
    assert "model.compression.budget.tokens = 8" in str(err.value) and "window 16" in str(err.value)


def test_scorer_window_larger_than_budget():
    # the observation window is budget.window: a scorer restating a larger one is refused
    with pytest.raises(
        ConfigError, match=r"importance.attention.window = 32 differs from .*budget.window = 4"
    ):
        Pipeline.from_config(
            {
                "budget": {"tokens": 20, "window": 4},
                "importance": {"attention": {"name": "window_attention", "window": 32}},
            }
        )
    # an unset scorer window is the budget's (never the scorer's own default, which could exceed the budget)
    pipe = Pipeline.from_config(
        {"budget": {"tokens": 20, "window": 4}, "importance": {"attention": {"name": "window_attention"}}}
    )
    assert pipe.importance["attention"].window == 4


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_ratio_outside_unit_interval(ratio):
    with pytest.raises(ConfigError, match=r"budget.ratio must be in \[0, 1\]"):
        Pipeline.from_config({**SNAP, "budget": {"ratio": ratio, "window": 16}})


def test_budget_shorthands():
    assert Pipeline.from_config({**SNAP, "budget": 64}).budget.tokens == 64
    assert Pipeline.from_config({**SNAP, "budget": 0.25}).budget.ratio == 0.25


def test_scorers_without_budget_is_an_error_and_no_scorer_is_the_full_cache():
    with pytest.raises(ConfigError, match="budget is missing"):
        Pipeline.from_config({"importance": {"key_norm": {}}})
    assert not Pipeline.from_config(None).compresses
    assert not Pipeline.from_config({}).compresses


def test_unknown_pipeline_field():
    with pytest.raises(ConfigError, match="Did you mean 'importance'"):
        Pipeline.from_config({**SNAP, "importanse": []})


def test_every_component_describes_its_parameters():
    rows = {row.name: row.params for row in IMPORTANCE.describe()}
    window = dict((p, (t, d)) for p, t, d in rows["window_attention"])
    assert window["window"] == ("int | None", "None") and window["kernel"] == ("int", "5")


def test_presets_are_found_by_bare_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config("snapkv.yaml").name == "snapkv.yaml"
    assert find_config("snapkv").name == "snapkv.yaml"
    for name in ("full", "random", "streamingllm", "snapkv", "knorm", "h2o", "pyramidkv"):
        assert name in preset_names()


def test_unknown_config_suggests_a_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="Did you mean 'snapkv'"):
        find_config("snapvk.yaml")


def test_every_preset_builds_a_valid_pipeline():
    for name in preset_names():
        cfg = resolve([name], [])
        Pipeline.from_config(cfg["model"].get("compression"))


def test_experiment_reuses_a_preset_in_one_line_and_overrides_fields(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({"preset": "snapkv", "model": {"compression": {"budget": {"tokens": 96}}}}))
    cfg = load_config(str(exp))["model"]["compression"]
    assert cfg["budget"]["tokens"] == 96
    assert cfg["budget"]["window"] == 32  # inherited sibling survives
    assert cfg["importance"]["attention"]["name"] == "window_attention"


def test_changing_a_component_name_replaces_its_parameters():
    cfg = resolve(["snapkv"], [("data.dataset", "{name: jsonl, path: x.jsonl}")])
    assert cfg["data"]["dataset"] == {"name": "jsonl", "path": "x.jsonl"}
    cfg = resolve(["pyramidkv"], [("model.compression.allocate.layer", "{name: uniform}")])
    assert cfg["model"]["compression"]["allocate"]["layer"] == {"name": "uniform"}
    cfg = resolve(["pyramidkv"], [("model.compression.allocate.layer.beta", "5")])
    assert cfg["model"]["compression"]["allocate"]["layer"] == {
        "name": "pyramid",
        "beta": 5,
        "arithmetic": "int",
    }


def test_command_line_overrides_merge_field_by_field():
    configs, rest, overrides = split_overrides(
        ["--config", "snapkv.yaml", "--model.compression.budget.tokens", "96", "--trainer.max_epochs=1",
         "--print_config"]
    )  # fmt: skip
    assert configs == ["snapkv.yaml"] and rest == ["--print_config"]  # every field is kvlab's to merge
    cfg = resolve(configs, overrides)
    assert cfg["model"]["compression"]["budget"] == {"tokens": 96, "window": 32}
    assert cfg["trainer"]["max_epochs"] == 1
    cfg = resolve(configs, [("model.compression.budget", "{ratio: 0.5}")])
    assert cfg["model"]["compression"]["budget"] == {"ratio": 0.5, "window": 32}  # tokens dropped


def test_preset_cycle_is_reported(tmp_path):
    (tmp_path / "a.yaml").write_text("preset: b.yaml\n")
    (tmp_path / "b.yaml").write_text("preset: a.yaml\n")
    with pytest.raises(ConfigError, match="preset cycle"):
        load_config(str(tmp_path / "a.yaml"))


def test_exclusive_fields_an_override_drops_its_alternatives():
    base = {"data": {"dataset": {"name": "synthetic_retrieval", "context_words": 400, "seed": 0}}}
    merged = merge(base, {"data": {"dataset": {"context_tokens": 1024}}})
    assert merged["data"]["dataset"] == {"name": "synthetic_retrieval", "seed": 0, "context_tokens": 1024}
    merged = merge({"budget": {"tokens": 64, "window": 8}}, {"budget": {"ratio": 0.2}})
    assert merged["budget"] == {"window": 8, "ratio": 0.2}

"""A sample's own answer limit (a benchmark's length per task) wins over ``max_new_tokens``: an
explicit limit that would not apply is refused before the model loads, and every record says the
limit its sample decoded under."""

import json

import pytest
from support.cli import TINY_MODEL, predict

import kvlab.models
from kvlab.api import compress_and_generate, load_model
from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample

#: counting to 2: each sample's own limit is 8 * 2 + 16 = 32 tokens
COUNTING = ["--data.dataset", "{name: synthetic_counting, num_samples: 2, min_count: 2, max_count: 2}"]
ARGS = [*TINY_MODEL, *COUNTING]


def test_an_explicit_limit_the_samples_override_is_refused_before_the_model_loads(
    tmp_path, capsys, monkeypatch
):
    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(kvlab.models, "load_model", forbidden)
    with pytest.raises(SystemExit) as exit_info:
        predict(tmp_path, "--config", "full", *ARGS, "--model.max_new_tokens", "4")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    refused = "--model.max_new_tokens = 4 would not apply: 2 of the 2 samples carry their own answer limit"
    assert f"{refused} (32 tokens)" in err
    assert "Remove --model.max_new_tokens" in err
    assert not (tmp_path / "runs").exists()  # nothing written


def test_the_samples_limits_are_noted_and_recorded(tmp_path, capsys):
    """Without ``--model.max_new_tokens`` the dataset's limits run: the run says so, and each record
    holds its limit; an explicit limit equal to the samples' own is no conflict."""
    predict(tmp_path, "--config", "full", *ARGS, "--model.max_new_tokens", "32")
    run = tmp_path / "runs" / "exp" / "full"
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert [r["max_new_tokens"] for r in records] == [32, 32]
    assert all(r["output_tokens"] <= 32 for r in records)
    predict(tmp_path, "--config", "full", *ARGS, "--run.overwrite", "true")  # the base's 16: a default
    out = capsys.readouterr().out
    assert "kvlab: note: 2 of the 2 samples carry their own answer limit (32 tokens), which replaces" in out
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert [r["max_new_tokens"] for r in records] == [32, 32]


def test_the_api_refuses_an_explicit_limit_a_sample_overrides():
    loaded = load_model("tiny-llama")
    own = Sample(id="a", prompt="Count from 1 to 3.", max_new_tokens=3)
    with pytest.raises(
        ConfigError, match=r"max_new_tokens = 5 would not apply: 1 of the 2 samples .* \(3 tokens\)"
    ):
        compress_and_generate(loaded, None, [own, "Hello"], max_new_tokens=5)
    outputs = compress_and_generate(loaded, None, [own, "Hello"])  # each under its own, else the default
    assert [o.record()["max_new_tokens"] for o in outputs] == [3, 32]
    assert len(outputs[0].token_ids) <= 3
    outputs = compress_and_generate(loaded, None, [own, "Hello"], max_new_tokens=3)
    assert [o.max_new_tokens for o in outputs] == [3, 3]

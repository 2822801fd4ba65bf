"""The engine check: kvlab's full cache against transformers' own forward (``model.verify``,
``kvlab check-model``). A test-only attention variant (kvlab's prefill attention with another
scaling than the model's) must be refused before any prediction; every supported family passes."""

import json

import pytest
import torch
from support.attention_variants import build, tokenizer
from support.cli import TINY, predict, write_jsonl

import kvlab
import kvlab.engine.attention as attention
from kvlab.cli.main import main
from kvlab.data.synthetic import SyntheticImageQA
from kvlab.engine.verify import verify_engine


@pytest.fixture
def wrong_scaling(monkeypatch):
    """kvlab's prefill attention with 1.5x the model's scaling: an engine that does not reproduce it."""
    exact = attention.prefill_attention

    def scaled(query, key, value, valid, scaling, options=None, **kwargs):
        return exact(query, key, value, valid, scaling * 1.5, options, **kwargs)

    monkeypatch.setattr(attention, "prefill_attention", scaled)


def run_predict(tmp_path, *args):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"id": f"s{i}", "prompt": "word " * (20 + 5 * i)} for i in range(2)]
    )
    predict(tmp_path, *TINY, "--data.dataset", f"{{name: jsonl, path: {data}}}", *args)
    return tmp_path / "runs" / "exp" / "method"


def test_run_with_an_engine_that_does_not_reproduce_the_model_is_refused(tmp_path, wrong_scaling, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_predict(tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.verify" in err and "--model.verify off" in err and "max |logit difference|" in err
    assert "first diverging greedy step" in err and "scaling=0.25" in err
    run_dir = tmp_path / "runs" / "exp" / "method"
    assert not list(run_dir.glob("predictions*.jsonl")) and not (run_dir / "metrics.json").exists()


def test_verify_off_runs_anyway_and_a_verified_run_reports_its_cost(tmp_path, wrong_scaling, monkeypatch):
    run_dir = run_predict(tmp_path / "off", "--model.verify", "off")
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 2 and not any("verify_seconds" in r for r in records)
    monkeypatch.undo()  # the exact engine again
    run_dir = run_predict(tmp_path / "on")
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 2 and sum("verify_seconds" in r for r in records) == 1
    assert next(r["verify_seconds"] for r in records if "verify_seconds" in r) > 0


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen2-vl", "tiny-llava"])
def test_every_family_passes(name):
    loaded = kvlab.load_model(name)
    images = 1 if loaded.info.vision_language else 0
    sample = SyntheticImageQA(num_samples=1, images_per_sample=max(images, 1), seed=3).samples()[0]
    if not images:
        sample.images = []
    result = verify_engine(loaded, loaded.processor.collate([sample]))
    assert result.ok, result.describe()
    assert result.tokens_match and result.max_logit_diff <= result.tolerance and result.native_tokens


def test_sliding_window_model_passes_and_is_probed_past_its_window():
    loaded = kvlab.wrap_model(build("mistral-sliding"), tokenizer(), name="mistral-sliding")
    result = verify_engine(loaded, [5, 6, 7, 8])  # shorter than the window of 6: a probe of 22 tokens too
    assert result.ok, result.describe()
    assert [n for _, n, _, _ in result.checks] == [4, 22] and result.features["sliding_window"] == 6


def test_a_missed_sliding_window_is_caught_by_the_probe(monkeypatch):
    """kvlab ignoring the window only shows past it: the probe finds it although the prompt is short."""
    exact = attention.prefill_attention

    def windowless(query, key, value, valid, scaling, options=None, **kwargs):
        return exact(query, key, value, valid, scaling, None, **kwargs)

    loaded = kvlab.wrap_model(build("mistral-sliding"), tokenizer(), name="mistral-sliding")
    monkeypatch.setattr(attention, "prefill_attention", windowless)
    result = verify_engine(loaded, [5, 6, 7, 8])
    assert not result.ok
    assert result.checks[0][2] == 0.0 and result.checks[1][2] > result.tolerance
    assert result.first_divergence.startswith("probe of 22 tokens")


def test_check_model_prints_a_table_and_exits_0(capsys):
    main(["check-model", "tiny-llama", "--lengths", "64,128", "--device", "cpu"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 64 ") or line.startswith("| 128 ")]
    assert len(rows) == 2 and all("| yes " in row for row in rows)
    assert "prompt example" in out and "kvlab check-model: OK" in out


def test_check_model_exits_1_on_a_mismatch(wrong_scaling, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check-model", "tiny-llama", "--lengths", "64", "--device", "cpu"])
    assert exit_info.value.code == 1
    assert "MISMATCH at 64 tokens" in capsys.readouterr().out
    assert torch.is_grad_enabled()  # nothing left switched off

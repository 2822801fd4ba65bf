"""A pipeline that only quantizes evicts nothing but changes every entry: its fidelity is measured
against the full cache, it never stands in for the full cache's reference, and its views name it."""

import json

from support.cli import TINY, write_jsonl

from kvlab.api import load_pipeline
from kvlab.cli.main import main
from kvlab.pipeline import Pipeline
from kvlab.runner.views.hparams import compression_columns

QUANTIZE = "{name: per_token, bits: 2, group: 16}"


def records(run):
    return [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]


def test_a_quantize_only_pipeline_is_not_the_full_cache():
    only_quantizes = Pipeline.from_config({"quantize": {"name": "per_token", "bits": 2, "group": 16}})
    assert not only_quantizes.compresses and not only_quantizes.keeps_full_cache
    assert Pipeline.from_config(None).keeps_full_cache
    assert not load_pipeline("snapkv").keeps_full_cache
    # TensorBoard's HPARAMS columns show the quantizer (they showed nothing, as for the full cache)
    columns = compression_columns({"quantize": {"name": "per_token", "bits": 2, "group": 16}})
    assert columns == {
        "quantize": "per_token",
        "quantize.bits": 2,
        "quantize.group": 16,
        "quantize.residual": 0,
    }


def test_quantized_full_cache_fidelity_is_against_the_full_cache(tmp_path):
    """The quantized run goes first, so the experiment's references are made while it runs: they
    must be the full cache's (the full run then scores exact), not the quantized outputs."""
    rows = [{"id": f"s{i}", "prompt": "word " * (40 + 9 * i)} for i in range(3)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    runs = ["--run.dir", str(tmp_path / "runs"), "--run.experiment", "exp"]
    common = ["predict", "--config", "full", *TINY, "--data.dataset", f"{{name: jsonl, path: {data}}}",
              "--model.fidelity", "true", *runs]  # fmt: skip
    main([*common, "--model.compression.quantize", QUANTIZE, "--run.method", "q2"])
    main([*common, "--run.method", "full"])
    quantized = records(tmp_path / "runs" / "exp" / "q2")
    full = records(tmp_path / "runs" / "exp" / "full")
    assert all(r["fidelity_kl"] > 1e-4 for r in quantized)  # 2-bit codes move the distributions (~5e-4)
    assert all(r["fidelity_exact"] == 1.0 and r["fidelity_kl"] < 1e-5 for r in full)  # float noise (~1e-7)

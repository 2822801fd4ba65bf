"""Peak memory on every device: a CPU run reports the process's RSS high-water mark, with its kind,
in the records, ``metrics.json`` and the summary; ``reproduce.json`` records what a re-run needs."""

from __future__ import annotations

import json

import torch
from support.cli import TINY, predict, write_jsonl

from kvlab.metrics.cost import NO_PEAK_NOTE, CostMetrics, process_peak_rss_bytes, process_rss_bytes
from kvlab.models.builtin import MODELS
from kvlab.models.fingerprint import model_fingerprint
from kvlab.runner.progress import format_summary


def test_cpu_run_reports_its_peak_rss_kind_and_reproduce_json(tmp_path, capsys):
    rows = [{"id": f"s{i}", "prompt": "word " * (20 + 5 * i), "answers": ["word"]} for i in range(2)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    predict(tmp_path, "--config", "snapkv", *TINY, "--data.dataset", f"{{name: jsonl, path: {data}}}",
            "--model.compression.budget", "{tokens: 12, window: 4}", "--model.fidelity", "false",
            "--data.batch_size", "1")  # fmt: skip
    run = tmp_path / "runs" / "exp" / "snapkv"
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    for record in records:
        assert record["peak_memory_kind"] == "process_rss_high_water"
        assert isinstance(record["peak_memory_bytes"], int) and record["peak_memory_bytes"] > 2**20
        assert 0 < record["peak_memory_rss_before_bytes"] <= record["peak_memory_bytes"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert isinstance(metrics["peak_memory_bytes"], int) and metrics["peak_memory_bytes"] > 2**20
    assert metrics["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in records)
    assert metrics["peak_memory_kind"] == "process_rss_high_water" and "peak_memory_note" not in metrics
    out = capsys.readouterr().out
    assert "process RSS high-water mark" in out and "not available" not in out

    reproduce = json.loads((run / "reproduce.json").read_text())
    model = MODELS.get("tiny-llama")().build(torch.float32)
    assert reproduce["model"] == "tiny-llama" and reproduce["model_seed"] == 0
    assert reproduce["model_fingerprint"] == model_fingerprint(model)
    assert reproduce["seed"] == 0  # the CLI's seed_everything default
    assert reproduce["libraries"]["torch"] == torch.__version__ and reproduce["device"]["type"] == "cpu"


def test_process_memory_readings_are_bytes():
    rss, peak = process_rss_bytes(), process_peak_rss_bytes()
    assert rss is not None and peak is not None
    # both in bytes: ru_maxrss is KiB on Linux, a missed conversion would put the peak ~1000x
    # below the current RSS (whether a fresh allocation grows the RSS depends on the allocator)
    assert 2**20 < rss <= peak < 2**40


def fake(peak=None, kind=None):
    record = dict.fromkeys(("kv_ratio", "kv_bytes_full", "kv_bytes_kept", "prompt_tokens"), 1.0)
    record.update(output_tokens=1.0, prefill_seconds=1.0, compression_seconds=0.0, decode_seconds=1.0)
    if peak is not None:
        record["peak_memory_bytes"] = peak
    if kind is not None:
        record["peak_memory_kind"] = kind
    return record


def cost(records):
    metric = CostMetrics()
    metric.update_records(records)
    return metric.compute()


def test_peak_kind_is_aggregated_and_the_note_only_without_any_figure():
    rss = cost([fake(5, "process_rss_high_water"), fake(7, "process_rss_high_water")])
    assert (rss["peak_memory_bytes"], rss["peak_memory_kind"]) == (7, "process_rss_high_water")
    assert "peak_memory_note" not in rss
    mixed = cost([fake(5, "process_rss_high_water"), fake(9, "cuda_allocated")])
    assert (mixed["peak_memory_bytes"], mixed["peak_memory_kind"]) == (9, "mixed")
    assert cost([fake(3)])["peak_memory_kind"] == "cuda_allocated"  # records from before the kind: CUDA
    none = cost([fake()])
    assert none["peak_memory_bytes"] is None and none["peak_memory_note"] == NO_PEAK_NOTE
    assert "peak_memory_kind" not in none
    summary = format_summary({**mixed, "samples": 2}, "runs/x")
    assert "peak_memory_bytes" in summary and "several kinds" in summary and "note:" not in summary
    assert "note: peak memory is not available" in format_summary({**none, "samples": 1}, "runs/x")

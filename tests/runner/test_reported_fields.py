"""Components report themselves: a component registered outside kvlab (here, in the test, as a plugin
would) declares a record field and reports it, and the field reaches the predictions, ``metrics.json``
and TensorBoard with no change to the runner (``docs/write_a_component.md``)."""

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from support.cli import TINY, predict, write_jsonl
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import kvlab
from kvlab.compression.selectors import SELECTORS, TopKSelector
from kvlab.config.capabilities import Outcome, RecordField, Report
from kvlab.pipeline.report import LayerReport


@dataclass
class CountingTopK(TopKSelector):
    """``topk`` that reports what the first layer kept per KV head (a plugin's own field)."""

    record_fields: ClassVar[dict[str, RecordField]] = {
        "toy_first_layer_kept": RecordField("entries kept at layer 0, mean over KV heads", "mean"),
    }

    def report(self, outcome: Outcome) -> Report:
        first = min(outcome.layers, key=lambda r: r.layer_idx)
        kept = first.kept.float().mean(-1).tolist()  # [B]
        return Report([{"toy_first_layer_kept": k} for k in kept], {"toy/first_layer_kept": sum(kept)})


@dataclass
class Undeclared(TopKSelector):
    """``topk`` that reports a field it does not declare."""

    def report(self, outcome: Outcome) -> Report:
        return Report([{"toy_other": 1} for _ in outcome.kv_bytes_kept])


@pytest.fixture
def toys():
    SELECTORS.register("counting_topk")(CountingTopK)
    SELECTORS.register("undeclared_topk")(Undeclared)
    yield
    SELECTORS.unregister("counting_topk")
    SELECTORS.unregister("undeclared_topk")


def test_a_registered_components_field_reaches_predictions_metrics_and_tensorboard(tmp_path, toys):
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"id": f"s{i}", "prompt": "word " * (30 + 10 * i)} for i in range(3)]
    )
    predict(
        tmp_path, "--config", "snapkv", *TINY, "--data.dataset", f"{{name: jsonl, path: {data}}}",
        "--data.batch_size", "2", "--model.compression.select", "{name: counting_topk}",
        "--model.compression.budget", "{tokens: 16, window: 4}",
    )  # fmt: skip
    run = tmp_path / "runs" / "exp" / "snapkv"
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert [r["toy_first_layer_kept"] for r in records] == [16.0] * 3  # the budget, in every head
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["toy_first_layer_kept"] == 16.0
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("toy/first_layer_kept")] == [32.0, 16.0]  # batches of 2 and 1


def test_a_field_the_component_does_not_declare_is_refused(toys):
    pipeline = kvlab.load_pipeline("snapkv", select={"name": "undeclared_topk"})
    layer = LayerReport(0, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(TypeError, match="toy_other"):
        pipeline.report([layer], torch.tensor([10]))

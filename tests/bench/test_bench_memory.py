"""``kvlab bench memory --prefill --methods ... --budget ...``: one row per method on the same
prompts, ratios to the full cache, Finch's question split off each prompt's end; nothing is
asserted about the figures' size but what the caches hold."""

import pytest
import torch

from kvlab.bench import memory
from kvlab.config.errors import ConfigError
from kvlab.models.base import Batch


def test_prefill_rows_per_method_with_ratios_to_full(monkeypatch, capsys):
    specs = []

    def in_process(spec, rss_limit):  # the measuring process's own function, without the process
        specs.append(spec)
        return memory.prefill_peaks(spec)

    monkeypatch.setattr(memory, "measure_in_subprocess", in_process)
    memory.run(["--prefill", "--model", "tiny-llama", "--contexts", "320", "--batches", "1",
                "--methods", "full,snapkv,finch", "--budget", "0.25", "--question", "16"])  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = {row[1]: row for row in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}
    assert list(rows) == ["full", "snapkv", "finch"]
    assert [(s["method"], s["budget"], s["question"]) for s in specs] == [
        (m, "0.25", 16) for m in ("full", "snapkv", "finch")
    ]
    assert rows["full"][6] == "1.00" and rows["full"][7] in ("1.00", "n/a")  # n/a: no growth at all
    cache = {m: float(row[9]) for m, row in rows.items()}  # MiB held after the prefill
    assert cache["snapkv"] < 0.5 * cache["full"] and cache["finch"] < 0.5 * cache["full"]


def test_question_split_takes_each_prompts_last_tokens():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    mask = (ids > 0).long()
    batch = Batch(ids, mask, torch.zeros_like(ids))
    context, question, valid = memory.question_split(batch, 2)
    assert question.tolist() == [[9, 10], [13, 14]] and bool(valid.all())
    assert context.input_ids.tolist() == [[5, 6, 7, 8], [0, 0, 11, 12]]
    assert context.attention_mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    with pytest.raises(ConfigError, match="--question 4"):  # the second prompt has 4 tokens
        memory.question_split(batch, 4)


def test_budget_flag():
    assert memory.budget_overrides("0.1") == {"budget.ratio": 0.1}
    assert memory.budget_overrides("128") == {"budget.tokens": 128}
    assert memory.budget_overrides(None) == {}
    for bad in ("0", "1.5", "-3", "ten"):
        with pytest.raises(ConfigError, match=f"--budget {bad}"):
            memory.budget_overrides(bad)

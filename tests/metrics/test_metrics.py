"""Metrics: text similarity against brute force, task metrics, DDP-style state merging, fidelity
(teacher forcing, KL against a direct computation, the top-K tail bucket), cost."""

import itertools
import math
import random
from collections import Counter

import pytest
import torch
from support.e2e import kvlab_model, run
from support.records import fake_records

from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.engine.generation import RunOptions, generate
from kvlab.metrics.cost import MAX_FIELDS, SUM_FIELDS, CostMetrics
from kvlab.metrics.fidelity import Reference, fidelity_values, teacher_forced_sums, teacher_tokens
from kvlab.metrics.means import record_values
from kvlab.metrics.reference import ReferenceStore
from kvlab.metrics.run import RunMetrics, summarize
from kvlab.metrics.tasks import TASK_METRICS, picked_choice, score_output, validate_task_metrics
from kvlab.metrics.text import lcs_length, position_match, rouge_l, token_f1
from kvlab.pipeline import Pipeline
from kvlab.runner.fidelity_run import FidelityEvaluator
from kvlab.runner.progress import format_summary

SNAP = {
    "budget": {"tokens": 24, "window": 4},
    "importance": {"attention": {"name": "window_attention"}},  # observes budget.window
}


# ---- text similarity ---------------------------------------------------------------------------
def naive_lcs(a, b):
    """Longest subsequence of ``a`` (tried longest first, every subset) that is a subsequence of b."""

    def is_subsequence(sub, seq):
        it = iter(seq)
        return all(x in it for x in sub)

    for n in range(len(a), -1, -1):
        if any(is_subsequence(c, b) for c in itertools.combinations(a, n)):
            return n
    return 0


def test_lcs_rouge_and_f1_match_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 7))]
        b = [rng.randint(0, 3) for _ in range(rng.randint(0, 7))]
        lcs = naive_lcs(a, b)
        assert lcs_length(a, b) == lcs
        overlap = sum(min(a.count(t), b.count(t)) for t in set(a))
        for score, common in ((rouge_l, lcs), (token_f1, overlap)):
            if not a and not b:
                expected = 1.0
            elif common == 0:
                expected = 0.0
            else:
                p, r = common / len(a), common / len(b)
                expected = 2 * p * r / (p + r)
            assert score(a, b) == pytest.approx(expected)
        matches = sum(x == y for x, y in zip(a, b, strict=False))
        assert position_match(a, b) == (1.0 if not (a or b) else matches / max(len(a), len(b)))


def test_generic_task_metrics_score_worked_examples():
    qa = Sample("q", "?", answers=["The Eiffel Tower", "eiffel"])
    scores = score_output("the eiffel tower!", qa, TASK_METRICS)
    assert scores["exact_match"] == 1.0 and scores["contains_answer"] == 1.0
    assert scores["token_f1"] == 1.0 and scores["rouge_l"] == 1.0
    assert "choice_accuracy" not in scores  # no choices: not applicable
    partial = score_output("tower of eiffel", qa, ["token_f1", "rouge_l"])
    assert partial["token_f1"] == pytest.approx(max(2 * (2 / 3) * 1 / (2 / 3 + 1), 2 * (1 / 3) / (1 / 3 + 1)))
    assert partial["rouge_l"] == pytest.approx(2 * (1 / 3) / (1 / 3 + 1))  # LCS 1 of (3, 2) words vs "eiffel"
    assert score_output("x", Sample("n", "?"), TASK_METRICS) == {}


@pytest.mark.parametrize(
    "output, picked",
    [("B", 1), ("(c) blue", 2), ("b. green", 1), ("I would say green, not red", 1), ("purple", None)],
)
def test_picked_choice_reads_a_letter_label_else_the_earliest_option(output, picked):
    assert picked_choice(output, ["red", "green", "blue"]) == picked


def test_choice_accuracy_accepts_letter_or_text_answers():
    for answer in ("B", "green"):
        sample = Sample("m", "?", answers=[answer], choices=["red", "green", "blue"])
        assert score_output("green", sample, ["choice_accuracy"]) == {"choice_accuracy": 1.0}
        assert score_output("A", sample, ["choice_accuracy"]) == {"choice_accuracy": 0.0}


def test_unknown_task_metric_is_a_config_error():
    with pytest.raises(ConfigError, match="Did you mean 'token_f1'"):
        validate_task_metrics(["token_f2"])


# ---- aggregation -------------------------------------------------------------------------------
def test_run_metrics_match_direct_formulas():
    records = fake_records(9, 0)
    m = summarize(records)
    n = sum(r["fidelity_positions"] for r in records)
    assert m["samples"] == 9
    assert m["fidelity_kl"] == pytest.approx(
        sum(r["fidelity_kl"] * r["fidelity_positions"] for r in records) / n
    )
    assert m["fidelity_top1"] == pytest.approx(
        sum(r["fidelity_top1"] * r["fidelity_positions"] for r in records) / n
    )
    assert m["fidelity_rouge_l"] == pytest.approx(sum(r["fidelity_rouge_l"] for r in records) / 9)
    scored = [r["token_f1"] for r in records if "token_f1" in r]
    assert m["token_f1"] == pytest.approx(sum(scored) / len(scored))
    assert "exact_match" not in m
    assert m["decode_tokens_per_second"] == pytest.approx(
        sum(r["output_tokens"] for r in records) / sum(r["decode_seconds"] for r in records)
    )
    assert m["kv_bytes_kept"] == sum(r["kv_bytes_kept"] for r in records)
    assert m["kv_bytes_allocated_peak"] == max(r["kv_bytes_allocated"] for r in records)
    assert m["peak_memory_bytes"] is None and "not available" in m["peak_memory_note"]


def test_states_merged_across_ranks_equal_one_process():
    """What DDP's reduction does (each state reduced by its dist_reduce_fx) gives the one-process result."""
    a, b = fake_records(5, 1), fake_records(4, 2)
    b[0]["peak_memory_bytes"] = 12345
    whole = RunMetrics()
    whole.update(a + b)
    ranks = [RunMetrics(), RunMetrics()]
    ranks[0].update(a)
    ranks[1].update(b)
    for name in ("cost", "greedy", "teacher", "task"):
        getattr(ranks[0], name).merge_state(getattr(ranks[1], name))
    merged, expected = ranks[0].compute(), whole.compute()
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert merged[key] == (pytest.approx(value) if isinstance(value, float) else value)
    assert merged["peak_memory_bytes"] == 12345


def test_cost_skips_missing_fields_and_reports_peak_when_present():
    metric = CostMetrics()
    old = {k: 1.0 for k in ("kv_ratio", "kv_bytes_full", "kv_bytes_kept", "prompt_tokens", "output_tokens")}
    old.update(prefill_seconds=1.0, compression_seconds=0.0, decode_seconds=1.0)  # an older record
    metric.update(record_values([old], (*SUM_FIELDS, *MAX_FIELDS)))
    out = metric.compute()
    assert out["kv_bytes_allocated_peak"] is None and out["peak_memory_bytes"] is None


# ---- fidelity ----------------------------------------------------------------------------------
def naive_kl(p_logits, q_logits):
    p = torch.softmax(p_logits.double(), -1)
    q = torch.softmax(q_logits.double(), -1)
    return float(sum(p[v] * math.log(p[v] / q[v]) for v in range(p.shape[0]) if p[v] > 0))


def prompts(n):
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    return [Sample(f"s{i}", " ".join(rng.choice(words) for _ in range(20 + 15 * i))) for i in range(n)]


def test_teacher_forced_kl_and_top1_equal_a_direct_computation():
    """tiny-llama's vocabulary (1024) fits in the top-K: the stored reference is exact."""
    loaded = kvlab_model("tiny-llama")
    samples = prompts(3)
    full = run(loaded, Pipeline.from_config(None), samples, steps=6)
    refs = [Reference.from_logits(full.tokens[b], full.step_logits[b]) for b in range(3)]
    pipeline = Pipeline.from_config(SNAP)
    batch = loaded.processor.collate(samples)
    forced = generate(
        loaded,
        pipeline,
        batch,
        RunOptions(max_new_tokens=6, return_logits=True, teacher_tokens=teacher_tokens(refs, 0)),
    )
    for b, ref in enumerate(refs):
        assert ref.positions == min(len(full.tokens[b]) + 1, 6)
        kl_sum, top1_sum = teacher_forced_sums(ref, forced.step_logits[b])
        expected = sum(
            naive_kl(full.step_logits[b, i], forced.step_logits[b, i]) for i in range(ref.positions)
        )
        agree = sum(
            int(forced.step_logits[b, i].argmax() == full.step_logits[b, i].argmax())
            for i in range(ref.positions)
        )
        assert kl_sum == pytest.approx(expected, rel=1e-4, abs=1e-6)
        assert top1_sum == agree
        # teacher forcing: the compressed model saw the reference tokens, one by one, after its prefill
        alone = generate(
            loaded,
            pipeline,
            loaded.processor.collate([samples[b]]),
            RunOptions(max_new_tokens=6, return_logits=True, teacher_tokens=teacher_tokens([ref], 0)),
        )
        n = ref.positions
        torch.testing.assert_close(alone.step_logits[0, :n], forced.step_logits[b, :n], atol=1e-4, rtol=1e-4)
        assert alone.tokens[0][: n - 1] == ref.tokens[: n - 1]


def test_full_cache_is_perfectly_faithful():
    loaded = kvlab_model("tiny-qwen2")
    samples = prompts(2)
    batch = loaded.processor.collate(samples)
    full = Pipeline.from_config(None)
    result = generate(loaded, full, batch, RunOptions(max_new_tokens=5, return_logits=True))
    for values in FidelityEvaluator(loaded, ReferenceStore(None), RunOptions(5), "float32").evaluate(
        full, batch, result
    ):
        assert values["fidelity_exact"] == 1.0 and values["fidelity_top1"] == 1.0
        assert values["fidelity_kl"] == pytest.approx(0.0, abs=1e-6)


def test_top_k_reference_is_a_lower_bound_with_the_tail_bucket():
    """With K < V the rest of the vocabulary is one outcome: KL of the (K+1)-outcome distributions."""
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(3, 50), torch.randn(3, 50)
    ref = Reference.from_logits([1, 2], p_logits, topk=5)
    kl_sum, _ = teacher_forced_sums(ref, q_logits)
    p, q = torch.softmax(p_logits.double(), -1), torch.softmax(q_logits.double(), -1)
    expected = 0.0
    for i in range(3):
        top = p[i].topk(5).indices
        rest = torch.ones(50, dtype=torch.bool)
        rest[top] = False
        pb = torch.cat([p[i, top], p[i, rest].sum()[None]])
        qb = torch.cat([q[i, top], q[i, rest].sum()[None]])
        expected += float((pb * (pb / qb).log()).sum())
        assert expected <= sum(naive_kl(p_logits[j], q_logits[j]) for j in range(i + 1)) + 1e-9
    assert kl_sum == pytest.approx(expected, rel=1e-4)


def test_greedy_agreement_of_a_diverging_output_matches_hand_values():
    ref = Reference([5, 6, 7], torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.long))
    values = fidelity_values(ref, [5, 9, 7, 8], None)
    assert values == {
        "fidelity_exact": 0.0,
        "fidelity_token_match": 0.5,
        "fidelity_rouge_l": pytest.approx(4 / 7),
    }


def test_reference_store_loads_what_it_saved_and_skips_unreadable_files(tmp_path):
    store = ReferenceStore(tmp_path)
    ref = Reference.from_logits([3, 4], torch.randn(3, 40), topk=8)
    store.save("k", ref)
    back = store.load("k")
    assert (
        back.tokens == [3, 4] and torch.equal(back.ids, ref.ids) and torch.equal(back.logprobs, ref.logprobs)
    )
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    assert store.load("bad") is None and store.load("missing") is None
    assert Counter(p.suffix for p in tmp_path.iterdir()) == {".pt": 2}  # no temporary file left


def test_metrics_json_counts_the_samples_each_task_metric_scored_and_the_summary_warns():
    records = [{"id": "a", "exact_match": 1.0, "token_f1": 0.5}, {"id": "b", "exact_match": 0.0}, {"id": "c"}]
    metrics = summarize(records)
    assert metrics["samples"] == 3 and metrics["task_samples"] == {"exact_match": 2, "token_f1": 1}
    summary = format_summary(metrics, "runs/x")
    assert "warning: exact_match scored 2 of 3 samples" in summary
    assert "warning: token_f1 scored 1 of 3 samples" in summary
    full = summarize([{"id": "a", "exact_match": 1.0, "longbench_score": 0.25}])
    assert full["task_samples"] == {"exact_match": 1, "longbench_score": 1}
    assert "warning" not in format_summary(full, "runs/x")
    assert "longbench_score" in format_summary(full, "runs/x")  # a suite's metric is shown too

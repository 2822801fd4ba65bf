"""Fake per-sample records of a run, for the run metrics and their DDP reduction."""

import random


def fake_records(n: int, seed: int) -> list[dict]:
    """``n`` seeded per-sample records with every field the run metrics read (``token_f1`` on odd
    samples only, as when only some samples are scored)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        positions = rng.randint(1, 6)
        record = {
            "id": f"{seed}-{i}",
            "kv_ratio": rng.random(),
            "kv_bytes_full": 1000,
            "kv_bytes_kept": rng.randint(0, 1000),
            "prompt_tokens": rng.randint(5, 50),
            "output_tokens": rng.randint(0, 8),
            "prefill_seconds": rng.random(),
            "compression_seconds": rng.random() / 10,
            "decode_seconds": rng.random(),
            "kv_bytes_allocated": rng.randint(100, 900),
            "fidelity_exact": float(rng.random() < 0.5),
            "fidelity_token_match": rng.random(),
            "fidelity_rouge_l": rng.random(),
            "fidelity_kl": rng.random(),
            "fidelity_top1": rng.randint(0, positions) / positions,
            "fidelity_positions": positions,
        }
        if i % 2:
            record["token_f1"] = rng.random()  # only some samples are scored
        out.append(record)
    return out

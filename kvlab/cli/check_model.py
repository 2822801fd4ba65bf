"""``kvlab check-model MODEL [--lengths 256,2048] [--dtype float32] [--device cpu]``.

For each length, a deterministic prompt of exactly that many tokens (repeated words in the
model's own prompt format, the middle cut to the length) runs through transformers' own forward
and through kvlab's engine with nothing evicted (:func:`kvlab.engine.verify.verify_engine`). One
table row per length: max |logit difference| of the prompt's last position, whether the greedy
tokens match, the attention features and tokens/s of both paths; then the formatted prompt
(start/end). Exits 1 on any mismatch, 0 when every length passes (``docs/models.md``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvlab.api import load_model
from kvlab.cli.prompt_example import elide
from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.engine.verify import verify_engine
from kvlab.models.base import LoadedModel

WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches"
#: tokens kept from the end of the formatted prompt (the generation prompt) when cutting its middle
TAIL = 32


def prompt_ids(loaded: LoadedModel, length: int) -> list[int]:
    """``length`` token ids of a formatted prompt of repeated words: its first ``length - TAIL``
    tokens and its last ``TAIL`` (the model's generation prompt), ``[length]``."""
    words = length
    while True:
        batch = loaded.processor.collate([Sample(id="check", prompt=" ".join([WORDS] * (words // 16 + 1)))])
        ids = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
        if len(ids) >= length:
            tail = min(TAIL, length // 4)
            return ids[: length - tail] + ids[len(ids) - tail :]
        words *= 2


def parse_lengths(text: str) -> list[int]:
    """``"256,2048"`` -> ``[256, 2048]``.

    Raises:
        ConfigError: a length that is not a positive integer.
    """
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 8:
        raise ConfigError(
            f"check-model --lengths must be comma-separated prompt lengths of at least 8 tokens (e.g. "
            f"--lengths 256,2048), got {text!r}."
        )
    return lengths


def main(args: list[str]) -> None:
    """Run the check for every length, print the table; exit 1 on any mismatch."""
    parser = argparse.ArgumentParser(prog="kvlab check-model", description=__doc__.split("\n\n")[1])
    parser.add_argument("model", help="built-in name (kvlab list), local directory or Hub id")
    parser.add_argument("--lengths", default="256,2048", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="e.g. cuda (default: cuda when available, else cpu)")
    options = parser.parse_args(args)
    lengths = parse_lengths(options.lengths)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_model(options.model, options.dtype, device=device)
    limit = loaded.info.max_position_embeddings
    if max(lengths) + 8 > limit:
        raise ConfigError(
            f"check-model --lengths {options.lengths}: model {options.model!r} takes at most "
            f"{limit} positions; choose lengths below it."
        )
    print(
        f"kvlab check-model {options.model} ({options.dtype}, {device}): kvlab (full cache) vs transformers"
    )
    header = (
        "tokens",
        "max abs logit diff",
        "tolerance",
        "greedy match",
        "native tok/s",
        "kvlab tok/s",
        "checks",
    )
    rows, failed, example, features = [], False, "", {}
    for length in lengths:
        ids = prompt_ids(loaded, length)
        if not example:
            example = loaded.processor.tokenizer.decode(ids, skip_special_tokens=False)
        result = verify_engine(loaded, ids)
        features = result.features
        failed |= not result.ok
        rows.append(
            (
                str(length),
                f"{result.max_logit_diff:.3g}",
                f"{result.tolerance:.3g}",
                "yes" if result.tokens_match else "NO",
                f"{result.total_tokens / max(result.seconds_native, 1e-9):.0f}",
                f"{result.total_tokens / max(result.seconds_kvlab, 1e-9):.0f}",
                " + ".join(f"{name} ({n})" for name, n, _, _ in result.checks),
            )
        )
        if not result.ok:
            print(f"MISMATCH at {length} tokens: {result.describe()}")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")
    shown = ", ".join(f"{k}={v}" for k, v in features.items()) or "plain causal attention"
    print(f"attention features: {shown}")
    print(f"prompt example ({lengths[0]} tokens, special tokens visible):\n{elide(example)}")
    if failed:
        print("kvlab check-model: MISMATCH: kvlab's engine does not reproduce this model.", file=sys.stderr)
        sys.exit(1)
    print("kvlab check-model: OK")

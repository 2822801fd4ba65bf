"""The reference framework's (kvpress) rows of ``kvlab bench e2e``, run as a script under another Python.

``python kvpress_rows.py SPEC`` with ``SPEC`` a JSON object: ``shape`` (the fields of
:class:`kvlab.bench.e2e.Shape`), ``cells`` (``[context, batch]`` pairs), ``tokens`` (decode tokens
per row), ``device`` and ``dtype``. It builds the same Llama model (same shape, seed and
dtype), the same seeded prompts and fed tokens as ``kvlab bench e2e``, and prints one JSON row
per line (the fields of :class:`kvlab.bench.e2e.Row`) for kvpress' SnapKV and AdaKV (on SnapKV)
at 10% kept (``compression_ratio=0.9``): the press applied around the prefill forward,
then decoding on the ``DynamicCache`` it left, as kvpress' own pipeline does.

This file imports torch, transformers and kvpress only, never kvlab: kvpress pins its own
transformers, so it lives in an environment of its own (``--kvpress-python``).
"""

from __future__ import annotations

import inspect
import json
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


def build(shape: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model ``kvlab.bench.e2e.build_model`` builds (same config, seed and dtype)."""
    config = LlamaConfig(
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], vocab_size=shape["vocab"], rope_theta=shape["rope_theta"],
        max_position_embeddings=shape["max_positions"], tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def row(model, press, label: str, T: int, B: int, tokens: int, device: torch.device, cache_kw: str) -> dict:
    """One row: the press around the prefill, then ``tokens - 1`` decode steps on its cache."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(T * 31 + B)  # as kvlab.bench.e2e.prompts
    ids = torch.randint(3, vocab, (B, T), generator=gen).to(device)
    fed = torch.randint(3, vocab, (B, tokens), generator=gen).to(device)
    out = {"model": "", "context": T, "batch": B, "cache": label, "oom": False}
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        start = sync(device)
        cache = DynamicCache()
        with press(model):
            logits = model(input_ids=ids, **{cache_kw: cache}, use_cache=True, logits_to_keep=1).logits
        logits[:, -1].argmax(-1)
        out["ttft"] = sync(device) - start
        out["kv_bytes"] = sum(
            t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
        )
        start = sync(device)
        for step in range(tokens - 1):
            positions = torch.full((B, 1), T + step, device=device)
            model(
                input_ids=fed[:, step : step + 1], position_ids=positions, **{cache_kw: cache}, use_cache=True
            )
        out["tokens_per_s"] = B * (tokens - 1) / (sync(device) - start)
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    except (torch.cuda.OutOfMemoryError, MemoryError):
        out["oom"] = True
    return out


def main(spec: dict) -> None:
    from kvpress import AdaKVPress, SnapKVPress  # the reference framework, in this environment only

    device = torch.device(spec["device"])
    model = build(spec["shape"], device, getattr(torch, spec["dtype"]))
    cache_kw = (
        "past_key_values" if "past_key_values" in inspect.signature(model.forward).parameters else "cache"
    )
    presses = {
        "kvpress snapkv 10%": lambda: SnapKVPress(compression_ratio=0.9),
        "kvpress adakv 10%": lambda: AdaKVPress(SnapKVPress(compression_ratio=0.9)),
    }
    for T, B in spec["cells"]:
        for label, make in presses.items():
            result = row(model, make(), label, T, B, spec["tokens"], device, cache_kw)
            result["model"] = spec["shape"]["name"]
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

"""Small helpers shared by the model families: dtypes, seeded construction, reading HF configs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kvlab.config.errors import ConfigError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bf16" | torch.bfloat16 | ...`` -> a floating :class:`torch.dtype`."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ConfigError(f"model dtype must be a floating dtype, got {dtype}.")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ConfigError(
            f"Unknown model dtype '{dtype}'. Use one of: float32, bfloat16, float16 (or fp32, bf16, fp16)."
        )
    return _DTYPES[key]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run a block on one intra-op thread (the same float reductions in every process, so a
    construction or a training is bit-identical across processes), then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block under ``torch.manual_seed(seed)`` without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_from_config(model_cls: Any, config: Any, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """Instantiate ``model_cls`` from ``config`` with seeded random weights, sdpa attention, eval mode.

    Weights are initialised in float32 (so every dtype starts from the same values) and then cast.
    """
    with seeded(seed):
        model = model_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.to(dtype).eval()


def text_config(config: Any) -> Any:
    """The language-model part of an HF config (the config itself for text-only models)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


#: the config fields holding the ids of the tokens that carry image / video features
IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index")
VIDEO_TOKEN_FIELDS = ("video_token_id", "video_token_index")


def config_token_ids(config: Any, *names: str) -> tuple[int, ...]:
    """The distinct int ids stored under any of ``names`` on the top-level config (or its text config)."""
    ids: list[int] = []
    for cfg in (config, text_config(config)):
        for name in names:
            value = getattr(cfg, name, None)
            values = value if isinstance(value, list | tuple) else [value]
            for v in values:
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
                    ids.append(v)
    return tuple(ids)

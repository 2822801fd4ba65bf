""":class:`~kvlab.models.base.ModelInfo` from an HF config, for any family."""

from __future__ import annotations

from typing import Any

from kvlab.models.base import ModelInfo
from kvlab.models.common import IMAGE_TOKEN_FIELDS, VIDEO_TOKEN_FIELDS, config_token_ids, text_config
from kvlab.models.vlm import BIDIRECTIONAL_IMAGE_FAMILIES


def model_info(config: Any, name: str) -> ModelInfo:
    """Shapes and special tokens of the language model described by an HF ``config``.

    Reads ``text_config`` for vision-language models; head_dim falls back to hidden / heads and
    KV heads to the query heads (MHA). Image tokens come from ``image_token_id`` /
    ``image_token_index``, video tokens from ``video_token_id`` / ``video_token_index``.
    ``bidirectional_image_blocks`` is set for a vision-language family in
    :data:`~kvlab.models.vlm.BIDIRECTIONAL_IMAGE_FAMILIES` (``model_type``).
    """
    text = text_config(config)
    num_heads = int(text.num_attention_heads)
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    image_ids = config_token_ids(config, *IMAGE_TOKEN_FIELDS)
    video_ids = config_token_ids(config, *VIDEO_TOKEN_FIELDS)
    return ModelInfo(
        name=name,
        num_layers=int(text.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        image_token_ids=image_ids,
        video_token_ids=video_ids,
        vision_language=getattr(config, "vision_config", None) is not None,
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 8192),
        bidirectional_image_blocks=getattr(config, "vision_config", None) is not None
        and getattr(config, "model_type", "") in BIDIRECTIONAL_IMAGE_FAMILIES,
    )

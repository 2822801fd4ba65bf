"""Attention masks of kvlab's prompt: the image blocks a bidirectional-image model attends within.

(The composable mask predicates used by prefill attention, the attention helpers of
:class:`~kvlab.compression.context.LayerContext` and the cache's slot layout join them here.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.models.base import IMAGE


def image_block_ids(modality: torch.Tensor) -> torch.Tensor:
    """The image block of each prompt token, ``[B, T]`` long: -1 outside images, else the index of
    its run of consecutive image tokens in the row (0, 1, ...).

    ``modality [B, T]``: 1 at image tokens (``kvlab.models.base.IMAGE``). As transformers'
    ``get_block_sequence_ids_for_mask`` for Gemma 3 (``token_type_ids == 1``): a block starts at an
    image token whose predecessor is not one, so each image's soft tokens form one block (Gemma 3
    writes ``<start_of_image>`` / ``<end_of_image>``, text, around them); padding is -1.
    """
    is_image = modality == IMAGE
    previous = F.pad(is_image, (1, 0), value=False)[:, :-1]
    starts = (is_image & ~previous).long().cumsum(-1) - 1
    return torch.where(is_image, starts, torch.full_like(starts, -1))

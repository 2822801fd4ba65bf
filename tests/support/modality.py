"""Contexts and samples that mix text and image tokens, for the modality allocators and routing."""

import torch
from naive.context import make_ctx

from kvlab.data.synthetic import SyntheticImageQA, SyntheticRetrieval

#: the recent window the modality tests observe and protect
WINDOW = 4


def with_modality(lengths, seed=0, **kw):
    """A padded batch whose tokens are text or image (image runs at random places)."""
    ctx = make_ctx(lengths, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    image = (torch.rand(ctx.valid.shape, generator=gen) < 0.5).long()
    ctx.modality = torch.where(ctx.valid, image, -1)
    return ctx


def mixed_samples():
    """Three samples of a tiny VLM batch: three images, one image, text only."""
    two = SyntheticImageQA(num_samples=1, images_per_sample=3, seed=3).samples()
    one = SyntheticImageQA(num_samples=1, images_per_sample=1, seed=4).samples()
    text = SyntheticRetrieval(num_samples=1, context_words=30, seed=2).samples()
    return two + one + text

"""Shared test settings: offline, and one torch thread per xdist worker (2 workers on 2 cores)."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

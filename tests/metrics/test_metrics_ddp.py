"""The run metrics reduce correctly under real DDP: two gloo processes on loopback, each with
its share of the records, compute the same metrics.json as one process with all of them."""

import json
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from support.records import fake_records

from kvlab.metrics.run import RunMetrics, summarize


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(rank: int, world: int, port: int, shards: list, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        metrics = RunMetrics()
        metrics.update(shards[rank])
        result = metrics.compute()  # torchmetrics all-gathers and reduces every state
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(result, handle)
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_reduction_equals_one_process(tmp_path):
    a, b = fake_records(5, 1), fake_records(4, 2)
    b[0]["peak_memory_bytes"] = 12345  # a max-reduced state present on one rank only
    mp.spawn(rank_main, args=(2, free_port(), [a, b], str(tmp_path)), nprocs=2, join=True)
    expected = summarize(a + b)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == (pytest.approx(value) if isinstance(value, float) else value), key

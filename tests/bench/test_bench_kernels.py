"""``kvlab bench kernels``: refused without CUDA; on CPU its inputs, launcher calls, byte counts,
table and targets are exercised with tiny shapes under the Triton interpreter and a wall-clock timer
(the figures mean nothing there; tests/gpu and .ci/gpu run it on a GPU)."""

import time

import pytest
import torch

pytest.importorskip("triton")

from kvlab.bench import kernels as bench  # noqa: E402
from kvlab.cli.main import main  # noqa: E402


class WallTimer(bench.Timer):
    """One call per contender, timed by the wall clock; no triton.testing (no device)."""

    def __init__(self):
        self.l2 = 1 << 16
        self.warmup = self.rep = 0

    def sets(self, nbytes):
        return 1  # one input set: the interpreter's figures mean nothing, only the plumbing is checked

    def time(self, fn, sets):
        start = time.perf_counter()
        for inputs in sets:
            fn(inputs)
        return (time.perf_counter() - start) * 1e3 / len(sets)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_kernels_refuses_without_cuda(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "kernels"])
    assert exc.value.code == 2
    assert "on a CUDA device, and this machine has none" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the interpreted kernels on CPU tensors")
def test_every_kernel_row_is_measured_and_rendered(monkeypatch):
    from kvlab.kernels import dispatch

    assert dispatch.interpreter()
    shapes = bench.Shapes(1, 4, 2, 16, torch.float32, 3, 4, 8, torch.device("cpu"))
    rows = bench.measure(shapes, [96], [0.1, 0.5], WallTimer())
    kernels = [row.kernel for row in rows]
    assert kernels == [
        "ragged decode attention", "ragged decode attention", "packed decode attention (KIVI-2)",
        "packed decode attention (KIVI-2)", "window scores", "compaction", "compaction",
        "merge (LOOK-M)", "merge (LOOK-M)", "chunk scores + top-k", "chunk scores + top-k",
        "chunk gather (host)", "chunk gather (host)",
    ]  # fmt: skip
    decode = rows[0]
    assert decode.full is not None and decode.reference is not None and decode.bytes > 0
    assert all(row.bytes > 0 and row.triton > 0 and row.copy > 0 for row in rows)
    table = bench.render(rows, 1000.0, "markdown").splitlines()
    assert table[0].startswith("| kernel | context | kept |") and len(table) == 2 + len(rows)
    assert "| chunk gather (host) | 96 | 10% |" in table[-2] and "| n/a |" in table[-2]  # no HBM peak
    assert len(bench.render(rows, None, "text").splitlines()) == 1 + len(rows)
    targets = bench.target_lines(rows, 1000.0)
    assert any("of peak" in line for line in targets) and any("full SDPA" in line for line in targets)


def test_the_peak_bandwidth_figure_names_its_source(monkeypatch):
    names = {"NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H100 PCIe": 2000.0, "NVIDIA H200": 4800.0}
    for name, gbs in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        peak, source = bench.peak_with_source(torch.device("cuda"), None)
        assert peak == gbs and name in source
    assert bench.peak_with_source(torch.device("cuda"), 1234.0) == (1234.0, "--peak-gbs")

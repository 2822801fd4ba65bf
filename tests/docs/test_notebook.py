"""The notebooks in notebooks/ execute top to bottom and show their tables and plots."""

import os

import nbformat
import pytest
from nbclient import NotebookClient
from support.paths import REPO

NOTEBOOK = REPO / "notebooks" / "sweep.ipynb"
BENCHMARK = NOTEBOOK.with_name("benchmark.ipynb")


@pytest.mark.slow
def test_sweep_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_NOTEBOOK_RUNS", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    rich = [o for o in outputs if o.output_type == "execute_result"]
    assert any("budget.tokens=40" in o["data"].get("text/markdown", "") for o in rich)
    assert any("image/png" in o["data"] for o in rich)
    assert len(list((tmp_path / "runs" / "notebook").glob("*/metrics.json"))) == 4


@pytest.mark.slow
def test_benchmark_notebook_executes(tmp_path, monkeypatch):
    """The slice of ``kvlab reference-table --suite ruler`` (3 runs per protocol, 2 samples of
    ~380 tokens each, smollm2-135m): about a minute on 2 cores."""
    monkeypatch.setenv("KVLAB_NOTEBOOK_RUNS", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    nb = nbformat.read(BENCHMARK, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    rich = [o["data"] for o in outputs if o.output_type == "execute_result"]
    tables = [d.get("text/markdown", "") for d in rich]
    assert any(
        "| method | query_aware @ 25% | query_aware @ 50% |" in t and "| snapkv |" in t for t in tables
    )
    assert any("| query_agnostic | snapkv@budget=0.25 | 512 |" in t for t in tables)
    assert any("image/png" in d for d in rich)
    suite = tmp_path / "runs" / "suite"
    for protocol in ("query_aware", "query_agnostic"):
        runs = sorted(p.parent.name for p in (suite / f"ruler-{protocol}").glob("*/metrics.json"))
        assert runs == ["full", "snapkv@budget=0.25", "snapkv@budget=0.5"]

"""The notebook in notebooks/ executes top to bottom and shows the comparison table and the plot."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "sweep.ipynb"


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

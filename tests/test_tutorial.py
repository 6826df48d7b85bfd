"""docs/tutorial.ipynb runs top to bottom (its own cells assert that training learns and that a
saved adapter reloads to the same logits)."""
import os


import nbclient  # test-only dependencies (setup.py extras "test")
import nbformat
import pytest

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "tutorial.ipynb")


@pytest.mark.slow
def test_tutorial_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    os.environ.setdefault("GLOG_v", "3")
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "final loss" in outputs and "adapter_model.safetensors" in outputs

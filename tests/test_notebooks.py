"""Executes every notebook in `examples/` and fails if any cell fails.

Every comparison in the notebooks ends with `np.testing.assert_allclose` against PyTorch,
so a broken parity fails a cell, and with it this test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def _execute(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    # "python3" is ipykernel's kernel: jupyter_client finds its kernelspec in
    # `sys.prefix/share/jupyter/kernels` (installed with ipykernel into the venv) and
    # starts it with `sys.executable`, so the notebook runs in this environment.
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    return client.execute()


def _generator():
    path = EXAMPLES / "_build_notebooks.py"
    spec = importlib.util.spec_from_file_location("_build_notebooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_value_hooks.ipynb", "05_node_and_multi_grad_hooks.ipynb"} <= names


def test_kernel_runs_in_this_environment():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    out = _execute(nb).cells[0].outputs
    assert out[0]["text"].strip() == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} has outputs: clear them before committing"
            )


def test_generated_notebooks_match_their_generator():
    generator = _generator()
    for name in generator.NOTEBOOKS:
        on_disk = nbformat.read(EXAMPLES / name, as_version=4)
        assert on_disk == generator.build(name), (
            f"examples/{name} differs from examples/_build_notebooks.py: "
            "run `python examples/_build_notebooks.py`"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    try:
        _execute(nb)
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name} failed:\n{error}")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")

"""The notebooks in `examples/`: committed without outputs, in sync with their sources.

Every notebook is executed once per test run, by the strict docs build
(`tests/test_docs.py::test_mkdocs_builds_strictly`: mkdocs-jupyter with `execute: true` and
`allow_errors: false`), so a failing cell fails that test. Every comparison in the notebooks
ends with `np.testing.assert_allclose` against PyTorch, so a broken parity fails a cell, and
with it the docs build. `test_kernel_runs_in_this_environment` checks the kernel both use.

Each notebook's source is its jupytext percent-format twin (`examples/01_value_hooks.py` for
`examples/01_value_hooks.ipynb`): edit the `.py`, then run
`.venv/bin/jupytext --to ipynb --update examples/[0-9]*.py` to write the notebook (no outputs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbclient
import nbformat
import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
SOURCES = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
SYNC_COMMAND = ".venv/bin/jupytext --to ipynb --update examples/[0-9]*.py"


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


def _cells(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


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


def test_every_notebook_has_a_source_and_every_source_a_notebook():
    assert [p.stem for p in SOURCES] == [p.stem for p in NOTEBOOKS], (
        f"each examples/NN_name.py needs its examples/NN_name.ipynb and back: run `{SYNC_COMMAND}`"
    )


@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_matches_its_source(source):
    notebook = source.with_suffix(".ipynb")
    expected = jupytext.read(source, fmt="py:percent")
    committed = nbformat.read(notebook, as_version=4)
    assert len(expected.cells) > 2
    assert _cells(committed) == _cells(expected), (
        f"examples/{notebook.name} differs from examples/{source.name}: run `{SYNC_COMMAND}`"
    )
    assert committed.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_headings_are_unique(path):
    # A notebook page's heading ids come from the headings' text: two headings with one
    # text get one id, and the page's "On this page" link to the later jumps to the former.
    nb = nbformat.read(path, as_version=4)
    headings = [
        line.lstrip("#").strip().lower()
        for cell in nb.cells
        if cell.cell_type == "markdown"
        for line in cell.source.splitlines()
        if line.startswith("#")
    ]
    repeated = sorted({h for h in headings if headings.count(h) > 1})
    assert not repeated, f"examples/{path.name} repeats the headings {repeated}: rename the later"

"""The quickstart page's scripts (docs/quickstart/*.py): each runs, beside its PyTorch twin,
and is no longer than the twin (Equinox's explicit state excepted, as the page says).

The page includes the files themselves (`--8<--`), so what it shows is what runs here.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import warnings
from pathlib import Path

import jax
import matplotlib
import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
SCRIPTS = ROOT / "docs" / "quickstart"
TASKS = sorted(p.stem for p in SCRIPTS.glob("*.py") if not p.stem.endswith("_torch"))
# Lines the Equinox script needs beyond its twin for Equinox itself, not for hooks: the
# state threaded explicitly (`make_with_state`, `vmap`'s `axis_name`). Said on the page.
EQUINOX_STATE_LINES = {"e_batchnorm_hook": 2}


def code_lines(path: Path) -> int:
    """Lines that are neither blank nor comments."""
    lines = path.read_text().splitlines()
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def run_script(path: Path, tmp_path: Path) -> str:
    matplotlib.use("Agg")
    out = io.StringIO()
    stack = contextlib.ExitStack()
    cwd = os.getcwd()
    tmp_path.mkdir(parents=True, exist_ok=True)
    os.chdir(tmp_path)  # figures are saved here
    try:
        # As a user runs them: JAX's default dtype promotion (conftest makes it strict).
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the libraries' own notices (Opacus', Equinox')
            stack.enter_context(jax.numpy_dtype_promotion("standard"))
            runpy.run_path(str(path), run_name="__main__")
    finally:
        stack.close()
        os.chdir(cwd)
        import matplotlib.pyplot as plt

        plt.close("all")
    return out.getvalue()


def test_six_tasks_with_twins():
    assert TASKS == [
        "a_clamp_grads",
        "b_capture_activations",
        "c_patch_heads",
        "d_dp_sgd",
        "e_batchnorm_hook",
        "f_nnx_trainer",
    ]
    page = (ROOT / "docs" / "quickstart.md").read_text()
    for task in TASKS:
        assert (SCRIPTS / f"{task}_torch.py").exists()
        for name in (task, f"{task}_torch"):
            assert f'--8<-- "docs/quickstart/{name}.py"' in page, f"{name}.py is not on the page"


@pytest.mark.parametrize("task", TASKS)
def test_script_runs_and_is_as_short_as_its_twin(task, tmp_path):
    jhooks_script, torch_script = SCRIPTS / f"{task}.py", SCRIPTS / f"{task}_torch.py"
    allowed = code_lines(torch_script) + EQUINOX_STATE_LINES.get(task, 0)
    assert code_lines(jhooks_script) <= allowed, f"{task}.py is longer than its PyTorch twin"
    printed = run_script(jhooks_script, tmp_path / "jhooks")
    assert printed.strip(), f"{task}.py printed nothing"
    torch_printed = run_script(torch_script, tmp_path / "torch")
    assert torch_printed.strip()
    if task in SAME_NUMBERS:
        assert_same_numbers(printed, torch_printed)


# Tasks whose twins start from the same weights and data and print the same numbers, in
# the same order within each line (the others start from their libraries' own random init).
SAME_NUMBERS = {"f_nnx_trainer"}


NAMED = r"'([\w.]+)': (-?[\d.]+(?:e-?\d+)?)"  # 'fc1': 0.0793
NUMBER = r"-?\d+\.\d+(?:e-?\d+)?"  # the other numbers with a decimal point


def numbers(line: str) -> list[float]:
    """The numbers in a printed line: its unnamed ones in order, then the named ones by
    name (a dict printed by PyTorch's hook order and one printed by JAX's differ)."""
    named = dict(re.findall(NAMED, line))
    plain = re.findall(NUMBER, re.sub(NAMED, "", line))
    return [float(v) for v in plain] + [float(named[k]) for k in sorted(named)]


def assert_same_numbers(printed: str, torch_printed: str) -> None:
    ours, theirs = printed.strip().splitlines(), torch_printed.strip().splitlines()
    assert len(ours) == len(theirs) > 1
    for mine, twin in zip(ours, theirs):
        assert sorted(dict(re.findall(NAMED, mine))) == sorted(dict(re.findall(NAMED, twin)))
        got, want = numbers(mine), numbers(twin)
        assert len(got) == len(want) > 1, (mine, twin)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{mine}\n{twin}")

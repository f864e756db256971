"""The helpers of scripts/: the oldest JAX that `scripts/setup.sh --jax min` installs."""

import importlib.util
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _load_lower_bounds():
    path = ROOT / "scripts" / "jax_lower_bounds.py"
    spec = importlib.util.spec_from_file_location("jax_lower_bounds", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lower_bounds_of_jax_and_jaxlib_only():
    bounds = _load_lower_bounds().lower_bounds(
        ["jax>=0.10", "jaxlib >= 0.10.1", "equinox>=0.13", "jax-extra>=9", "numpy<3"]
    )
    assert bounds == {"jax": "0.10", "jaxlib": "0.10.1"}


def test_pyproject_gives_both_bounds(capsys):
    assert _load_lower_bounds().main() == 0
    pins = capsys.readouterr().out.split()
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [pin.split("==")[0] for pin in pins] == ["jax", "jaxlib"]
    for pin in pins:
        assert pin.replace("==", ">=") in dependencies

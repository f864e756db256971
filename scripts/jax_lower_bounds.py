"""Prints `jax==X` and `jaxlib==Y`, the lower bounds of pyproject's dependencies, one a line.

`scripts/setup.sh --jax min` installs them, so that the tests also run against the oldest
JAX that jhooks claims to support.
"""

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
PINNED = ("jax", "jaxlib")


def lower_bounds(dependencies: list[str]) -> dict[str, str]:
    """The `>=` bound of each package in `PINNED`, from requirement strings."""
    bounds = {}
    for requirement in dependencies:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", requirement.strip())
        if match and match[1] in PINNED:
            bounds[match[1]] = match[2]
    return bounds


def main() -> int:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    bounds = lower_bounds(dependencies)
    missing = [name for name in PINNED if name not in bounds]
    if missing:
        print(f"error: pyproject.toml gives no `>=` bound for {missing}", file=sys.stderr)
        return 1
    for name in PINNED:
        print(f"{name}=={bounds[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

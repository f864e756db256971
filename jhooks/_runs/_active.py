"""The runs active in this thread (`run_with_hooks`, `run_with_cache`), innermost last.

`hook_point` applies every active run; a staged run (`_loops.py`) asks how many are
active. Kept here, below both, so that neither imports the other to reach it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core import NAMES_KEYED, ThreadStack

if TYPE_CHECKING:
    from ._points import Run

ACTIVE_RUNS: ThreadStack[Run] = ThreadStack("active runs")


def names_unkeyed() -> bool:
    """Whether a run reads module names where no cache key shows them: a run started
    inside a function the user jitted (`_core/_handles.py`, "Names are keyed")."""
    return bool(ACTIVE_RUNS) and not NAMES_KEYED


def names_read() -> bool:
    """Whether a run is active or being keyed here: module registries compare by
    identity then (`_modules/_registry.py`), as its names tell modules apart."""
    return bool(ACTIVE_RUNS) or bool(NAMES_KEYED)

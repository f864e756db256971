"""The runs active in this thread (`run_with_hooks`, `run_with_cache`), innermost last.

`hook_point` applies every active run; a staged run (`_loops.py`) asks how many are
active. Kept here, below both, so that neither imports the other to reach it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core import ThreadStack

if TYPE_CHECKING:
    from ._points import Run

ACTIVE_RUNS: ThreadStack[Run] = ThreadStack("active runs")

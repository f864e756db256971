"""`loop_index()` from persistent module hooks: the outermost hookable call as a run.

A hook registered with `register_forward_hook` (not given to a run) that calls
`jhooks.loop_index()` inside the `lax.scan` (or `nnx.scan`, `lax.while_loop`) of a
model has no `run_with_hooks` to feed it the index. The outermost call of a hookable
module stands in for one, at no cost when nothing needs it: the call runs plainly,
with only a marker on a stack; if `loop_index()` is called inside a loop within that
call, it raises `NeedsStaging`, and the call starts again as a staged run without hooks
or cache (`_loops.staged_run`), whose harvest feeds the loops their indices. Which
module classes needed it is remembered, so their next calls are staged at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .._core import NAMES_KEYED, Bounded, current_trace
from ._active import ACTIVE_RUNS
from ._loops import MODULE_ROOTS, NeedsStaging, staged_run
from ._points import Run
from ._scopes import in_module_call

_staged_classes: Bounded[int, Any] = Bounded(256)  # id -> the call, kept alive


def outermost_call(
    module: Any, args: tuple, kwargs: dict, call: Callable[[Any, tuple, dict], Any], key: Any
) -> Any:
    """`call(module, args, kwargs)`, as a run for `loop_index` when it is the outermost
    hookable call and no run is active.

    **Arguments:**

    - `module`: the hookable module called.
    - `args`, `kwargs`: its arguments.
    - `call`: makes the hooked call.
    - `key`: the class's own `__call__` (which classes needed staging).

    **Returns:**

    What the call returns.
    """
    if ACTIVE_RUNS or in_module_call():
        return call(module, args, kwargs)
    if id(key) not in _staged_classes:
        try:
            with MODULE_ROOTS.pushed(current_trace()):
                return call(module, args, kwargs)
        except NeedsStaging:
            pass
        _staged_classes[id(key)] = key
    run = Run([], [], None, None, f"the call of {type(module).__qualname__}")

    nnx = sys.modules.get("flax.nnx")  # a Flax NNX module is already imported
    if nnx is not None and not isinstance(module, nnx.Module):
        nnx = None

    def staged(a: tuple, k: dict) -> Any:
        # This run names no point: the names it passes are read by no one.
        with ACTIVE_RUNS.pushed(run), NAMES_KEYED.pushed(run):
            out = call(a[0], a[1:], k)
        return out if nnx is None else (out, nnx.state(a[0]))

    out, _ = staged_run(run, staged, (module, *args), kwargs)
    if nnx is not None:
        out, state = out
        nnx.update(module, state)
    return out

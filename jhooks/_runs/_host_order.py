"""Hooks on values in program order: each host call waits for the one before it.

XLA runs the host calls of independent points (a layer's `q`, `k` and `v`) in any order,
so a hook at `k` could run before the hook at `q` whose value it reads. Each host call
therefore takes an operand computed from the first output of the host call evaluated
before it in the same trace (`host_value`'s `after`), which XLA must compute first.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._core import current_trace
from ._host_calls import AFTER

# The `after` operand of a host call that follows none in its trace.
FIRST = np.zeros(AFTER.shape, AFTER.dtype)


class HostOrder:
    """The latest host call's output in each trace of one program: held in the
    program's own trace (dropped with it, `Owner.end_trace`), weakly in the traces of
    loop bodies and branches, which end before it and may keep no tracer of theirs."""

    def __init__(self, top: Any):
        self.top = top
        self._top_last: Any = None
        self._inner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def after(self) -> Any:
        """The `after` operand of a host call evaluated now."""
        trace = current_trace()
        if trace is self.top:
            last = self._top_last
        else:
            ref = self._inner.get(trace)
            last = ref() if ref is not None else None
        return FIRST if last is None else last.ravel()[:1].astype(np.float32)

    def made(self, outputs: list) -> None:
        """Notes the outputs of a host call evaluated now."""
        sized = [x for x in outputs if x.size and not jnp.iscomplexobj(x)]
        if not sized:
            return
        trace = current_trace()
        if trace is self.top:
            self._top_last = sized[0]
        else:
            self._inner[trace] = weakref.ref(sized[0])


def order_in(owner: Any) -> HostOrder:
    """The order of the host calls in `owner`'s program (`Owner.host_order`; a fresh
    one when the program is traced again)."""
    if owner.host_order is None or owner.host_order.top is not owner.top:
        owner.host_order = HostOrder(owner.top)
    return owner.host_order

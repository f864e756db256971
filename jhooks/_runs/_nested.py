"""Hooks of a run nested in another run's program: on values, on every call.

A run called by the function of another run (TransformerLens' nested hooks; a
`jhooks.generate` inside `run_with_cache`) is traced inline, in the outer run's
program, and that program is reused on later calls: a hook traced there would run its
Python once per trace, on tracers. Where the outer run gives values (it is eager, and
the point is not under a `jax.vmap`), a hook of the inner run whose Python does more
than compute with JAX (`_pure.writes_nothing`), or whose trace needs a concrete value,
and every hook after it in program order, is a host call instead (but for a forward
hook whose value is differentiated, traced as in the outer run) (`_host_calls.py`'s
graph break): the hook runs each time the program reaches its point, with the concrete
arrays, and what it returns is the point's value. A pure hook stays traced, as in the
outer run.

The hook is the one the trace met: the function of the outer run is traced once per
structure (JAX's rule), and its Python, the inner run's call and its list of hooks
included, runs in that trace.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax

from .._core import get_aval, host_call, is_array_like, is_batched, is_differentiated
from ._host_calls import CONCRETE, HostEntry, failure, holds_tracer, users_hook
from ._pure import writes_nothing
from ._scopes import HookName


class Nested:
    """The hooks of one inner run: whether one has run on values yet (those after it,
    in program order, do too: they may read what it wrote)."""

    def __init__(self, outer: Any = None) -> None:
        self.on_values = False
        self.outer = outer  # the outer run's call (`_program.Call`)

    def forward(self, hook: Callable, value: Any, name: str) -> Any:
        """`hook(value, name)`, on values where it must be."""
        leaves = jax.tree.leaves(value)
        if any(is_batched(x) for x in leaves):
            return hook(value, HookName(name))
        differentiated = any(is_differentiated(x) for x in leaves)
        if not self.on_values and (differentiated or _traced(hook)):
            # Traced, as in the outer run: a pure hook (unless it needs a value), and
            # a forward hook whose replacement is differentiated.
            try:
                return hook(value, HookName(name))
            except CONCRETE:
                if differentiated:
                    raise
        self.on_values = True
        return on_values(hook, name, value, backward=False)

    def backward(self, hook: Callable, name: str) -> Callable:
        """`hook` as a backward hook of point `name`, on values where it must be."""
        if not self.on_values and _traced(hook):
            return hook
        self.on_values = True
        if self.outer is not None:  # its backward pass waits for the program's
            self.outer.backward_on_values = True

        def on_gradient(grad: Any, name: str) -> Any:
            if any(is_batched(x) for x in jax.tree.leaves(grad)):
                return hook(grad, name)
            return on_values(hook, str(name), grad, backward=True)

        on_gradient.__wrapped__ = hook  # type: ignore[attr-defined]
        return on_gradient


def _traced(hook: Callable) -> bool:
    """Whether a hook stays traced: it writes nothing, or holds a transformation's
    tracer, or is jhooks' own (`jhooks.splice`'s, whose points the run reaches)."""
    users = users_hook(hook)
    if (getattr(users, "__module__", None) or "").startswith("jhooks."):
        return True
    return writes_nothing(users) or holds_tracer(users)


def on_values(hook: Callable, name: str, value: Any, backward: bool) -> Any:
    """The value at point `name` after `hook`, run by the program on concrete arrays."""
    leaves, in_tree = jax.tree.flatten(value)
    statics = tuple(None if is_array_like(x) else x for x in leaves)
    arrays = [x for x in leaves if is_array_like(x)]
    entry = HostEntry(hook, name, backward, in_tree, statics)
    entry.set_avals([get_aval(x) for x in arrays])
    outs = _host(entry, arrays)
    it = iter(outs)
    return jax.tree.unflatten(in_tree, [next(it) if s is None else s for s in statics])


def _call(entry: HostEntry, differentiated: bool, leaves: list) -> list:
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in entry.avals]

    def run(*arrays: Any) -> list:
        try:
            return entry.run(arrays, differentiated)
        except BaseException:
            with _lock:
                _failed.append(entry)
            raise

    return host_call(run, leaves, shapes)


# The entries whose hook raised, the latest last: the run raises the hook's own error.
_failed: list[HostEntry] = []
_lock = threading.Lock()


def nested_failure() -> BaseException | None:
    """The error a nested run's hook on values raised (taken: each is raised once)."""
    with _lock:
        entries, _failed[:] = _failed[:], []
    return failure(entries[::-1])


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _host(entry: HostEntry, leaves: list) -> list:
    return _call(entry, False, leaves)


@_host.defjvp
def _host_jvp(entry: HostEntry, primals: tuple, tangents: tuple) -> tuple[list, list]:
    # The value passes its gradient through unchanged; a replacement is refused there.
    return _call(entry, True, primals[0]), tangents[0]

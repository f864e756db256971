"""Tracers a trace left behind. Where a hook kept the tracers of its own trace
(`acts.append(z)`): found from the trace's reference count, in what the hook's code
reaches, and only past that by a search of the heap. And the concrete value of one that
a run's program computed from constants alone (`jnp.float32(3.0)`, `jnp.zeros(3) * 2`),
the same on every call: its equations evaluated again, eagerly."""

from __future__ import annotations

import collections
import gc
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import jax
from jax._src import core as _core

from .._entries import entries, inside

# The traces of the run's programs (`trace_program`) -> the values of their constants,
# by variable: JAX forgets them when the trace ends. Held while a tracer of it lives.
_programs: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()
MAX_EQUATIONS = 4096  # a value made by more is not evaluated again (it is taken out)


def remember_program(trace: Any, jaxpr: Any, consts: list) -> None:
    """Keeps what a program's trace closed over, for `concrete_value`."""
    _programs[trace] = dict(zip(jaxpr.constvars, consts))


def remember_failed(trace: Any) -> None:
    """The same for a trace that raised (the model's own error): what it wrote before
    is taken back too. JAX ends such a trace without clearing its frame."""
    frame = getattr(trace, "frame", None)
    _programs[trace] = dict(getattr(frame, "constvar_to_val", None) or {})


def of_ended_program(x: Any) -> bool:
    """Whether `x` is a tracer of a run's program whose trace has ended (one the trace
    left in the user's objects)."""
    return isinstance(x, _core.Tracer) and x._trace in _programs and _ended(x._trace)


def _ended(trace: Any) -> bool:
    now = _core.trace_ctx.trace
    while now is not None:
        if now is trace:
            return False
        now = getattr(now, "parent_trace", None)
    return True


def concrete_value(x: Any) -> Any:
    """The value of `x`, a tracer of a run's program that ended, where the program
    computed it from constants and literals alone, with no effect; else `None` (it
    depends on the program's inputs: it has a value per call)."""
    if not of_ended_program(x):
        return None
    consts = _programs[x._trace]
    order, done, stack = [], set(), [(x, False)]
    while stack:  # the equations that made `x`, each after those that made its operands
        t, ready = stack.pop()
        eqn = getattr(t, "parent", None)
        if eqn is None:
            if not isinstance(t.val, _core.Literal) and t.val not in consts:
                return None  # an input
        elif ready:
            if id(eqn) not in done:
                done.add(id(eqn))
                order.append(eqn)
        elif id(eqn) not in done:
            if eqn.effects or len(done) + len(stack) > MAX_EQUATIONS:
                return None
            stack.append((t, True))
            stack.extend((u, False) for u in eqn.in_tracers)
    env: dict = {}

    def read(t: Any) -> Any:
        v = t.val
        if isinstance(v, _core.Literal):
            return v.val
        return consts[v] if t.parent is None else env[v]

    try:
        with _core.eval_context():
            for eqn in order:
                params = eqn.primitive.get_bind_params(eqn.params)
                with eqn.ctx.manager:
                    out = eqn.primitive.bind(*map(read, eqn.in_tracers), **params)
                env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
            value = read(x)
            return value if isinstance(value, jax.Array) else jax.device_put(value)
    except Exception:  # noqa: BLE001 - not evaluated again: taken out instead
        return None


def places_of(tracer: Any, ignore: Any = None) -> list:
    """Where the user's lists, dicts and objects hold `tracer`: `(container, key,
    tracer, tracer)`, `key` an index, a dict key, or an attribute name (`container` an
    object); `ignore`, a list of the caller's that holds it."""
    places = []
    for ref in gc.get_referrers(tracer):
        if ref is ignore:
            continue
        if isinstance(ref, list):
            places += [(ref, i, tracer, tracer) for i, v in enumerate(ref) if v is tracer]
        elif isinstance(ref, dict):
            owner = next(
                (o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref), None
            )
            for k, v in list(ref.items()):
                if v is tracer:
                    places.append((ref if owner is None else owner, k, tracer, tracer))
        elif isinstance(getattr(ref, "__dict__", None), dict) and not isinstance(ref, type):
            places += [(ref, k, tracer, tracer) for k, v in vars(ref).items() if v is tracer]
    return places


def leaked_tracers(trace_ref: weakref.ref, rules: int, reach: list) -> tuple[list, dict | None]:
    """The tracers of a finished trace still reachable: a hook kept them; and, when
    `reach` (what the hook's own code reaches) holds them all, their places there,
    `(holder, key, held, tracer)`: `held` the entry's value, the tracer or a tuple
    holding it (`_core/_entries.py`).

    A trace is held only by its tracers, and by the derivative rule of each custom
    derivative call it recorded (`jax.nn.relu`; `rules` of them), which stays in the
    jaxpr: the count says whether anything else holds it, and how many tracers do. They are
    looked for in `reach` first (a list, dict, object or closure cell the hook's `self`,
    closure or globals hold: `acts.append(z)`), and the heap is searched only where some
    are elsewhere.
    """
    trace = trace_ref()
    if trace is None:
        return [], None
    # getrefcount's argument and the local name `trace` are two references.
    held = sys.getrefcount(trace) - 2 - rules
    if held <= 0:
        return [], None
    places: dict[int, list] = {}
    tracers: dict[int, Any] = {}

    def ours(v: Any) -> bool:
        return isinstance(v, _core.Tracer) and getattr(v, "_trace", None) is trace

    for container, key, value in held_in(reach):
        for tracer in inside(value, ours):
            tracers[id(tracer)] = tracer
            places.setdefault(id(tracer), []).append((container, key, value, tracer))
    if len(tracers) >= held:
        return list(tracers.values()), places
    gc.collect()
    return [r for r in gc.get_referrers(trace) if isinstance(r, _core.Tracer)], None


def held_in(reach: list, budget: int = 4096) -> Iterator[tuple[Any, Any, Any]]:
    """`(holder, key, value)` for the entries of the holders in `reach` (lists, dicts,
    deques, objects, closure cells: `_core/_entries.py`), and of the lists, dicts and
    deques they hold (inside tuples too), two levels deep, `budget` entries at most."""
    seen: set[int] = set()
    level = list(reach)
    for _ in range(2):
        below = []
        for obj in level:
            if id(obj) in seen or isinstance(obj, (type, types.ModuleType, _core.Tracer)):
                continue
            seen.add(id(obj))
            found = entries(obj)
            for _how, key, value in (found or [])[:budget]:
                budget -= 1
                yield obj, key, value
                below += inside(value, _container)
            if budget <= 0:
                return
        level = below


def _container(value: Any) -> bool:
    return isinstance(value, (list, dict, collections.deque))

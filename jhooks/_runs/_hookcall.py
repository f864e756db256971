"""One hook called at one point, traced on its own: `HookCall`, `traced_call`.

The hook is called with abstract values of its point (tracers), its name, and, in a
loop, `jhooks.loop_index()` giving the iterations around the point; what it computes is
a small jaxpr whose constants and literals are arguments (`_core/_jax_compat/_tracing`).
A pure hook (`_pure.py`) is not called again where it was traced before with the same
key: its trace is reused, with its arrays now. `evaluate` runs a hook call at its point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from .._core import (
    Bounded,
    Emitted,
    closure_cells,
    collecting,
    current_trace,
    eval_traced,
    forward_emits,
    get_aval,
    hook_name,
    is_array_like,
    is_dead_tracer,
    is_inexact_array,
    out_of_vmaps,
    reached_by,
    running,
    trace_hook,
)
from . import _loops
from ._backward import as_gradient
from ._host_calls import (
    AFTER,
    CONCRETE,
    HostEntry,
    holds_tracer,
    host_number,
    host_value,
    reads_loop_index,
    users_hook,
)
from ._host_order import FIRST, order_in
from ._pure import Key, pure_key, with_inputs
from ._scopes import HookName

if TYPE_CHECKING:
    from ._hookpass import Owner


class HookCall:
    """One hook called at one point, traced: which hook (`index` among the run's forward
    then backward hooks), the point's `name`, the value's structure, the loop depth at
    the point, and the trace."""

    __slots__ = (
        "index",
        "name",
        "backward",
        "in_tree",
        "statics",
        "depth",
        "traced",
        "key",
        "emit_hooks",
        "outer",
        "abstract",
        "host",
        "at",
    )

    def __init__(self, index: int, name: str, backward: bool, value: Any, depth: int):
        self.index, self.name, self.backward, self.depth = index, name, backward, depth
        leaves, self.in_tree = jax.tree.flatten(value)
        self.statics = tuple(None if is_array_like(x) else x for x in leaves)
        self.traced: Any = None
        self.key: Any = None
        self.emit_hooks: dict[str, str] = {}
        self.outer = False  # a backward hook for an outer `jax.grad`, traced at its point
        self.abstract: Any = None  # the value it was given, abstract (`_abstract_value`)
        self.host: HostEntry | None = None  # run on values by the program (`_host_calls`)
        self.at: tuple[bool, bool] = (True, False)  # its point: (values allowed, differentiated)

    def avals(self, value: Any) -> list:
        return [get_aval(x) for x in jax.tree.leaves(value) if is_array_like(x)]


def traced_call(
    hook: Callable,
    index: int,
    name: str,
    is_backward: bool,
    value: Any,
    depth: int,
    alone: bool = True,
    where: Where | None = None,
) -> HookCall:
    """Calls `hook(value, name)` on abstract values of `value`, traced on its own; for
    a pure hook (`_pure.py`), the same call traced before, if there is one. Or, where
    `where` allows it, the hook is not called now: the call runs it on values when the
    program reaches it (`_host_calls.py`).

    `alone`: outside the body's trace (the hook pass), where `loop_index()` gives the
    iterations of the `depth` loops around the point; inside it (a record), it asks
    the body's trace, as any code there."""
    call = HookCall(index, name, is_backward, value, depth)
    avals = call.avals(value)
    where = where or Where()
    if where.values and where.on_host:  # after a hook on values: on values too
        return _on_values(call, hook, avals)
    users = users_hook(hook)
    key = pure_key(users, True)
    pure = key is not None
    # In a differentiated run a forward hook is traced (what it returns is
    # differentiated), unless a hook before it ran on values.
    traced = not is_backward and where.differentiated
    if where.values and not (traced or pure or holds_tracer(users)):
        return _on_values(call, hook, avals)
    try:
        if pure:
            return _traced_pure(call, hook, avals, alone, key if users is hook else None)
        # Not pure, traced: it computes with a transformation's values around the run
        # (a head from the user's `jax.vmap`), which exist only while it is traced.
        _trace_call(call, hook, avals, alone, [], [])
        return call
    except CONCRETE:
        if not where.values:
            raise
        return _on_values(call, hook, avals)
    except ReadKept:
        # A backward hook reading what a forward hook kept: on values, in the backward
        # pass, the kept value is concrete (given when the forward has run).
        if not (is_backward and where.values):
            raise
        return _on_values(call, hook, avals)


class ReadKept(ValueError):
    """A hook read a traced value that a hook kept earlier in the call."""


def _loop_index(depth: int, arrays: list) -> tuple:
    """The iterations of the `depth` loops around a hook's point, in its trace (whose
    inputs are the point's `arrays`)."""
    with _loops.HOOK_SITE.pushed(depth), _loops.HOOK_VALUES.pushed((current_trace(), arrays)):
        return _loops.loop_index()


class Where:
    """Where a hook call is made, for whether it may run on values: not under a vmap
    (`values`), whether its value is differentiated, and whether a call before it in
    program order ran on values (`on_host`: then it does too)."""

    __slots__ = ("values", "differentiated", "on_host")

    def __init__(self, values: bool = False, differentiated: bool = False, on_host: bool = False):
        self.values, self.differentiated, self.on_host = values, differentiated, on_host


# The traced host call of each value structure, and what its hook is given
# (`HostEntry.set_avals`): the same jaxpr serves every hook, its one constant being the
# number of the call's entry.
_host_traces: Bounded[Any, Any] = Bounded(4096)


def _on_values(call: HookCall, hook: Callable, avals: list) -> HookCall:
    """`call` made a host call: the hook runs on values where the program reaches it."""
    call.host = entry = HostEntry(hook, call.name, call.backward, call.in_tree, call.statics)
    entry.loops = call.depth
    if call.depth and not call.backward and reads_loop_index(users_hook(hook)):
        entry.depth = call.depth
    shape = (call.backward, call.in_tree, call.statics, tuple(avals), entry.depth)
    known = _host_traces.get(shape)
    if known is None:
        number = host_number(entry, avals)
        fn = host_value(entry, _loop_index)
        int32 = get_aval(number)
        after = get_aval(AFTER)
        traced = trace_hook(fn, [int32, after, *avals], f"hook {hook_name(hook)}", [number])
        _host_traces[shape] = (traced, entry.host_avals)
    else:
        _host_traces.move_to_end(shape)
        number = host_number(entry, avals, known[1])
        traced = known[0].with_given([number])
    _keyed(call, traced)
    return call


def _traced_pure(
    call: HookCall, hook: Callable, avals: list, alone: bool, known_key: Key | None
) -> HookCall:
    """`known_key`: `pure_key(hook, True)` where the caller has it."""
    name, is_backward, depth = call.name, call.backward, call.depth
    where = (name, is_backward, call.in_tree, call.statics, tuple(avals), depth)
    for inputs in (True, False):
        key = known_key if inputs and known_key is not None else pure_key(hook, inputs)
        if key is None:
            break
        entry = (tuple(key.parts), where)
        known = _pure_calls.get(entry)
        if known is not None:
            _pure_calls.move_to_end(entry)
            return _again(known[0], call, key.arrays)
        arrays = [get_aval(x) for x in key.arrays]
        try:
            _trace_call(call, hook, avals, alone, key.arrays, arrays)
        except Exception:
            if not inputs or not key.arrays:
                raise
            continue  # it needs an array's value: keyed by the array's identity
        if not (call.traced.kept or call.traced.leaked or call.traced.callbacks):
            # Kept without this call's arrays: they are given anew on each reuse.
            kept = HookCall(call.index, call.name, call.backward, None, call.depth)
            kept.traced = call.traced.with_given([None] * len(key.arrays))
            kept.emit_hooks, kept.key = call.emit_hooks, call.key
            _pure_calls[entry] = (kept, key.held)
        return call
    _trace_call(call, hook, avals, alone, [], [])
    return call


# A pure hook's traced calls, by its key and its point; with what the key holds.
_pure_calls: Bounded[Any, tuple[HookCall, list]] = Bounded(4096)


def _again(known: HookCall, call: HookCall, arrays: list) -> HookCall:
    """A pure hook's call traced before, for this call (its arrays now)."""
    call.traced = known.traced.with_given(list(arrays)) if arrays else known.traced
    call.emit_hooks = known.emit_hooks
    call.key = (call.index, *known.key[1:])
    return call


def asks_loop_index(call: HookCall) -> bool:
    """Whether the hook call reads `jhooks.loop_index()` (a loop's iteration)."""
    return bool(call.depth) and any(
        e.primitive.name == "jhooks_loop_index" for e in call.traced.jaxpr.eqns
    )


def _trace_call(
    call: HookCall, hook: Callable, avals: list, alone: bool, given: list, given_avals: list
) -> None:
    name, is_backward, depth, statics = call.name, call.backward, call.depth, call.statics
    n = len(given)

    def fn(leaves: list) -> Any:
        fn_hook = with_inputs(hook, leaves[:n]) if n else hook
        it = iter(leaves[n:])
        value = jax.tree.unflatten(call.in_tree, [next(it) if s is None else s for s in statics])
        site = _loops.HOOK_SITE.pushed(depth) if alone else contextlib.nullcontext()
        arrays = [x for x in leaves[n:] if is_array_like(x)]
        anchor = _loops.HOOK_VALUES.pushed((current_trace(), arrays))
        with site, anchor, collecting(Emitted()) as emitted:
            if is_backward:
                with running(hook):
                    out = as_gradient(fn_hook(value, HookName(name)), value)
            else:
                out = fn_hook(value, HookName(name))
        call.emit_hooks = dict(emitted.hooks)
        return out, dict(emitted.values)

    try:
        users = users_hook(hook)
        reach = [held for _, held in reached_by(users)] + closure_cells(users)
        traced = trace_hook(fn, [*given_avals, *avals], f"hook {hook_name(hook)}", given, reach)
        if any(is_dead_tracer(c) for c in traced.consts):
            raise jax.errors.UnexpectedTracerError("a tracer of a finished trace")
    except jax.errors.UnexpectedTracerError as err:
        raise ReadKept(
            f"hook {hook_name(hook)} at point {name!r} read a traced value that a hook kept "
            "earlier in this call. In a run that is differentiated (jax.grad around it, or "
            "backward hooks or gradients in it), forward hooks are traced, each on its own, "
            "so that what they return is differentiated, and what one keeps is its concrete "
            "value only when the forward ends (backward hooks can read it). Read it in a "
            "backward hook, call the run without differentiating it (hooks then run on "
            "values, and read what earlier hooks kept), or keep it in one run "
            "(jhooks.run_with_cache) and read it in the next."
        ) from err
    _keyed(call, traced)


def _keyed(call: HookCall, traced: Any) -> None:
    name, is_backward, depth, statics = call.name, call.backward, call.depth, call.statics
    call.traced = traced
    call.key = (
        call.index,
        name,
        is_backward,
        call.in_tree,
        statics,
        depth,
        traced.key,
        traced.out_tree,
    )


def evaluate(
    call: HookCall, consts: list, value: Any, owner: Owner | None = None, position: int = 0
) -> Any:
    """What the traced hook call returns for `value`; emitted values are emitted, and
    the values the hook kept, evaluated in the program's own trace, are its outputs."""
    leaves = [x for x in jax.tree.leaves(value) if is_array_like(x)]
    order = None
    if call.host is not None:
        order = order_in(owner) if owner is not None else None
        leaves = [order.after() if order is not None else FIRST, *leaves]
    (out, emitted), kept = eval_traced(call.traced, consts, leaves)
    if order is not None:
        order.made([x for x in jax.tree.leaves(out) if is_array_like(x)])
    # Under the user's vmap around a model (hooks see one example there), what a hook
    # kept is given back stacked, batch axis first, as the cache holds it.
    given = out_of_vmaps(owner.top, kept) if kept and owner is not None else None
    if given is not None and owner is not None:
        owner.kept_values += given
        owner.kept_from += [(position, k) for k in range(len(given))]
    if emitted:
        forward_emits({(n, call.emit_hooks[n]): v for n, v in emitted.items()})
    return out


def abstract_value(call: HookCall) -> Any:
    """The value a hook call was given, as abstract values (its static parts as they were)."""
    if call.abstract is None:
        after = call.host is not None  # a host call's `after` operand comes first
        avals = iter(call.traced.jaxpr.invars[len(call.traced.consts) + after :])
        leaves = [next(avals).aval if s is None else s for s in call.statics]
        call.abstract = jax.tree.unflatten(call.in_tree, leaves)
    return call.abstract


def gradient_of(value: Any) -> Any:
    """The abstract gradient a backward hook of `value` is given: `None` for a leaf
    that has none (an integer)."""
    return jax.tree.map(lambda x: get_aval(x) if is_inexact_array(x) else None, value)


def signature(value: Any) -> tuple:
    """A value's structure and its leaves' abstract values (its other leaves as they are)."""
    leaves, tree = jax.tree.flatten(value)
    return tree, tuple(get_aval(x) if is_array_like(x) else x for x in leaves)

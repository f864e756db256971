"""A run's hooks run their Python on every call, on the user's own objects.

The function a run calls (the model) is traced once per structure, as under `jax.jit`;
its hooks are not part of that key. On every call each hook is called again, as
PyTorch calls it: once per point it selects, in program order, on abstract values of
the point, with whatever it reads as it is now. Each such call is traced on its own
to a small jaxpr (`HookCall`), whose constants and literal operands are the compiled
program's arguments, so the program is reused whenever the hooks computed the same
structure, whatever Python produced it. So side effects, random draws, counters,
iterators, identity checks and lazy initialisation happen once per call per point, on
the real objects, and nothing of the user's is copied or written.

Three modes, one per kind of trace of the run's body (`SiteHook`):

- *record*: the first call of a model structure (or one whose points moved) traces
  the body abstractly; each hook is traced where its point is reached, and evaluated
  there. The calls made, and the points reached, are the run's *layout*.
- *replay*: the compiled program's trace evaluates, at each point, the hook call
  traced for it this call, its constants being the program's arguments.
- *inline*: a run inside another run's program or a function the user stages out
  calls its hooks directly, as any Python code there.

A warm call looks its layout up and traces the hooks alone (`hook_pass`), without
tracing the model.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax

from .._core import (
    Emitted,
    collecting,
    current_trace,
    eval_traced,
    forward_emits,
    get_aval,
    hook_name,
    is_array_like,
    is_dead_tracer,
    is_inexact_array,
    running,
    trace_hook,
)
from . import _loops
from ._backward import as_gradient, replayed
from ._pure import pure_key, with_inputs
from ._scopes import HookName


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

    def avals(self, value: Any) -> list:
        return [get_aval(x) for x in jax.tree.leaves(value) if is_array_like(x)]


class Site:
    """A point whose backward hooks a differentiated program runs: its name, the hooks
    selecting it, and the abstract value of its gradient."""

    __slots__ = ("name", "indices", "value")

    def __init__(self, name: str, indices: list[int], value: Any):
        self.name, self.indices, self.value = name, indices, value


class Layout:
    """What one trace of the body reached, for the hook pass to call again: the hook
    calls in order (forward hooks, and backward hooks the body's own differentiation
    ran), and the points whose backward hooks an outer `jax.grad` would run."""

    __slots__ = ("calls", "sites")

    def __init__(self, calls: list[HookCall], sites: list[Site]):
        self.calls, self.sites = calls, sites


class Owner:
    """The hooks of one run call, and what they did: the hook calls of this call (made
    by `hook_pass`, or recorded), and the points reached.

    In record mode the program is being traced (`program`): each hook call's constants
    become inputs of it (`inputs`: which call and constant feeds each)."""

    def __init__(
        self,
        hooks: list[Callable],
        nfwd: int,
        mode: str,
        differentiated: bool = False,
    ):
        self.hooks, self.nfwd, self.mode = hooks, nfwd, mode
        self.differentiated = differentiated
        self.calls: list[HookCall] = []
        self.sites: list[Site] = []
        self.consts: list = []  # in replay: the hook calls' constants, traced
        self.program: Any = None  # in record: the program's trace
        self.inputs: list = []  # in record: (call, constant) per input, or its aval
        self.run: Any = None
        self.taken: dict[tuple[int, str], int] = {}
        self.top: Any = None  # the program's own trace (not a loop's, a vmap's...)
        # What hooks kept (`acts.append(out)`), evaluated in the program's own trace:
        # the values, and which call's which kept value each is.
        self.kept_values: list = []
        self.kept_from: list[tuple[int, int]] = []

    def for_run(self, run: Any) -> None:
        """A run that starts again (staged, for `loop_index`) starts its record again:
        the inputs made for the calls before are fed zeros."""
        if self.run is not run:
            self.run = run
            self.taken = {}
            self.kept_values, self.kept_from = [], []
            if self.mode == "record":
                self.inputs = [
                    self.calls[src[0]].traced.jaxpr.invars[src[1]].aval
                    if type(src) is tuple
                    else src
                    for src in self.inputs
                ]
                self.calls, self.sites = [], []

    def record(self, call: HookCall, value: Any) -> Any:
        """Adds `call`, made at its point now, and evaluates it there."""
        position = len(self.calls)
        self.calls.append(call)
        consts = list(call.traced.consts)
        if self.program is not None:
            for j in range(len(consts)):
                consts[j] = self.program.new_input(call.traced.jaxpr.invars[j].aval)
                self.inputs.append((position, j))
        return evaluate(call, consts, value, self, position)

    def take(self, index: int, name: str) -> tuple[HookCall, list, int] | None:
        """The next hook call of hook `index` at point `name`, its constants, and its
        position among the calls."""
        seen = self.taken.get((index, name), 0)
        found = [i for i, c in enumerate(self.calls) if c.index == index and c.name == name]
        if seen >= len(found):
            return None
        self.taken[(index, name)] = seen + 1
        position = found[seen]
        start = sum(len(c.traced.consts) for c in self.calls[:position])
        call = self.calls[position]
        return call, self.consts[start : start + len(call.traced.consts)], position

    def layout(self) -> Layout:
        return Layout(self.calls, self.sites)

    def key(self) -> tuple:
        return tuple(c.key for c in self.calls)

    def const_values(self) -> list:
        return [x for c in self.calls for x in c.traced.consts]


class SiteHook:
    """What a run's point calls for one of the user's hooks (see the module's docstring)."""

    def __init__(self, owner: Owner | None, index: int, hook: Callable):
        self.owner, self.index, self.hook = owner, index, hook
        self.__wrapped__ = hook
        self.__qualname__ = hook_name(hook)

    def __call__(self, value: Any, name: str) -> Any:
        """The user's hook, called as it is."""
        return self.hook(value, HookName(name))

    def forward(self, value: Any, name: str, run: Any) -> Any:
        owner = self.owner
        if owner is None:
            return self.hook(value, HookName(name))
        owner.for_run(run)
        if owner.mode == "record":
            depth = _loops.site_depth(run)
            call = traced_call(self.hook, self.index, str(name), False, value, depth, False)
            if _asks_loop_index(call):
                _loops.loop_index()  # a trace reused: the run is staged, as the hook asked
            return owner.record(call, value)
        found = owner.take(self.index, str(name))
        if found is None:
            raise LayoutChanged(name)
        call, consts, position = found
        if _asks_loop_index(call):
            _loops.loop_index()  # in a run not staged yet, it starts again, staged
        return evaluate(call, consts, value, owner, position)


class LayoutChanged(Exception):
    """The program's trace reached a point the hook pass did not call the hook for."""


def backward(hooks: list[SiteHook], value: Any, name: str, run: Any) -> Any:
    """`value` with the backward hooks `hooks` of one point, in their run's mode."""
    owner = hooks[0].owner
    if owner is None:
        return None  # the caller registers the hooks themselves
    owner.for_run(run)
    leaves = [x for x in jax.tree.leaves(value) if is_array_like(x)]
    if not leaves:
        return value
    if owner.mode == "record":
        site = Site(str(name), [h.index for h in hooks], gradient_of(value))
        owner.sites.append(site)
        if not owner.differentiated:
            # Called only if the body differentiates itself: traced then, there.
            recorders = [_Recorder(owner, h, str(name)) for h in hooks]
            return replayed(value, [(r, []) for r in recorders], str(name))
        # An outer `jax.grad` differentiates the program: the hooks are traced now.
        pairs = []
        for h in hooks:
            call = traced_call(h.hook, h.index, site.name, True, site.value, 0, False)
            call.outer = True
            position = len(owner.calls)
            pairs.append((_Replay(call, h.hook), _inputs(owner, call, position)))
            owner.calls.append(call)
        return replayed(value, pairs, str(name))
    found = [owner.take(h.index, str(name)) for h in hooks]
    calls = [f for f in found if f is not None]
    if not calls:
        return value  # not differentiated this call: its hooks were not called
    pairs = [(_Replay(call, owner.hooks[call.index]), consts) for call, consts, _ in calls]
    return replayed(value, pairs, str(name))


class _Recorder:
    """A backward hook traced where the body's own differentiation calls it."""

    def __init__(self, owner: Owner, hook: SiteHook, name: str):
        self.owner, self.hook, self.name = owner, hook, name
        self.__wrapped__ = hook.hook

    def __call__(self, grad: Any, consts: list) -> Any:
        call = traced_call(self.hook.hook, self.hook.index, self.name, True, grad, 0, False)
        return self.owner.record(call, grad)


def _inputs(owner: Owner, call: HookCall, position: int) -> list:
    """The program's new inputs for the constants of `call` (at `position`)."""
    consts = []
    for j in range(len(call.traced.consts)):
        consts.append(owner.program.new_input(call.traced.jaxpr.invars[j].aval))
        owner.inputs.append((position, j))
    return consts


class _Replay:
    def __init__(self, call: HookCall, hook: Callable):
        self.call = call
        self.__wrapped__ = hook

    def __call__(self, grad: Any, consts: list) -> Any:
        return evaluate(self.call, consts, grad)


def gradient_of(value: Any) -> Any:
    """The abstract gradient a backward hook of `value` is given: `None` for a leaf
    that has none (an integer)."""
    return jax.tree.map(lambda x: get_aval(x) if is_inexact_array(x) else None, value)


def traced_call(
    hook: Callable,
    index: int,
    name: str,
    is_backward: bool,
    value: Any,
    depth: int,
    alone: bool = True,
) -> HookCall:
    """Calls `hook(value, name)` on abstract values of `value`, traced on its own; for
    a pure hook (`_pure.py`), the same call traced before, if there is one.

    `alone`: outside the body's trace (the hook pass), where `loop_index()` gives the
    iterations of the `depth` loops around the point; inside it (a record), it asks
    the body's trace, as any code there."""
    call = HookCall(index, name, is_backward, value, depth)
    avals = call.avals(value)
    where = (name, is_backward, call.in_tree, call.statics, tuple(avals), depth)
    for inputs in (True, False):
        key = pure_key(hook, inputs)
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
            _pure_calls[entry] = (call, key.held)
            while len(_pure_calls) > _MAX_PURE_CALLS:
                _pure_calls.popitem(last=False)
        return call
    _trace_call(call, hook, avals, alone, [], [])
    return call


# A pure hook's traced calls, by its key and its point; with what the key holds.
_MAX_PURE_CALLS = 4096
_pure_calls: OrderedDict[Any, tuple[HookCall, list]] = OrderedDict()


def _again(known: HookCall, call: HookCall, arrays: list) -> HookCall:
    """A pure hook's call traced before, for this call (its arrays now)."""
    call.traced = known.traced.with_given(list(arrays)) if arrays else known.traced
    call.emit_hooks = known.emit_hooks
    call.key = (call.index, *known.key[1:])
    return call


def _asks_loop_index(call: HookCall) -> bool:
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
        with site, collecting(Emitted()) as emitted:
            if is_backward:
                with running(hook):
                    out = as_gradient(fn_hook(value, HookName(name)), value)
            else:
                out = fn_hook(value, HookName(name))
        call.emit_hooks = dict(emitted.hooks)
        return out, dict(emitted.values)

    try:
        traced = trace_hook(fn, [*given_avals, *avals], f"hook {hook_name(hook)}", given)
        if any(is_dead_tracer(c) for c in traced.consts):
            raise jax.errors.UnexpectedTracerError("a tracer of a finished trace")
    except jax.errors.UnexpectedTracerError as err:
        raise ValueError(
            f"hook {hook_name(hook)} at point {name!r} read a traced value that a hook kept "
            "earlier in this call: a run calls each hook on abstract values of its own point, "
            "and what one hook keeps is given its concrete value only when the call ends. "
            "Pass the value through the points themselves (one hook on both points), or "
            "keep it in one run (jhooks.run_with_cache) and read it in the next."
        ) from err
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
    (out, emitted), kept = eval_traced(call.traced, consts, leaves)
    if kept and owner is not None and current_trace() is owner.top:
        owner.kept_values += kept
        owner.kept_from += [(position, k) for k in range(len(kept))]
    if emitted:
        forward_emits({(n, call.emit_hooks[n]): v for n, v in emitted.items()})
    return out


def hook_pass(owner: Owner, layout: Layout, differentiated: bool) -> None:
    """Calls every hook again, on abstract values, where `layout` says it is called:
    forward hooks in program order; backward hooks in the order the body's own
    differentiation called them or, for a program an outer `jax.grad` differentiates,
    point by point from the last."""
    outer = any(c.outer for c in layout.calls)
    for c in layout.calls:
        if c.outer and not differentiated:
            continue  # the layout's program was differentiated; this one is not
        hook = owner.hooks[c.index]
        new = traced_call(hook, c.index, c.name, c.backward, _abstract_value(c), c.depth)
        new.outer = c.outer
        owner.calls.append(new)
    if differentiated and not outer and not any(c.backward for c in layout.calls):
        backward_calls(owner, layout.sites)


def backward_calls(owner: Owner, sites: list[Site]) -> None:
    """Calls the backward hooks of `sites` that an outer `jax.grad` runs, from the
    last point to the first, as its backward pass reaches them."""
    for site in reversed(sites):
        for index in site.indices:
            call = traced_call(owner.hooks[index], index, site.name, True, site.value, 0)
            call.outer = True
            owner.calls.append(call)


def _abstract_value(call: HookCall) -> Any:
    """The value a hook call was given, as abstract values (its static parts as they were)."""
    if call.abstract is None:
        avals = iter(call.traced.jaxpr.invars[len(call.traced.consts) :])
        leaves = [next(avals).aval if s is None else s for s in call.statics]
        call.abstract = jax.tree.unflatten(call.in_tree, leaves)
    return call.abstract

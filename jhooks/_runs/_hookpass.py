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
  the program with each hook traced where its point is reached and evaluated there,
  its constants becoming inputs of the program as they are found. The calls made, and
  the points reached, are the run's *layout*.
- *replay*: the compiled program's trace evaluates, at each point, the hook call
  traced for it this call, its constants being the program's arguments.
- *inline*: a run inside a function the user stages out calls its hooks directly, as
  any Python code there; a run inside another run's program too, but for the hooks
  that must run on values (`_nested.py`).

A warm call looks its layout up and traces the hooks alone (`hook_pass`), without
tracing the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core import (
    guided,
    hook_name,
    is_array_like,
    is_batched,
    is_differentiated,
    vmapped_between,
)
from . import _loops
from ._backward import replayed
from ._hookcall import (
    HookCall,
    Where,
    abstract_value,
    asks_loop_index,
    evaluate,
    gradient_of,
    signature,
    traced_call,
)
from ._host_order import HostOrder
from ._nested import Nested
from ._scopes import HookName, users_vmap_base
from ._select import is_operation


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

    __slots__ = ("calls", "sites", "points", "chosen", "again")

    def __init__(self, calls: list[HookCall], sites: list[Site], run: Any = None):
        self.calls, self.sites = calls, sites
        # For each call, the position of an earlier call of the same hook at the same
        # point for a value of the same structure (another branch of a `cond`), or -1.
        first: dict[tuple, int] = {}
        self.again: list[int] = []
        for i, c in enumerate(calls):
            same = (c.index, c.name, c.depth, signature(abstract_value(c)))
            self.again.append(-1 if c.backward else first.get(same, -1))
            first.setdefault(same, i)
        # The points reached, and what each predicate hook chose of them (by index).
        self.points: tuple = tuple(run.points) if run is not None else ()
        self.chosen: dict[int, frozenset[str]] = run.chosen() if run is not None else {}


class Owner:
    """The hooks of one run call, and what they did: the hook calls of this call (made
    by `hook_pass`, or recorded), and the points reached.

    In record mode the program is being traced (`program`): each hook call's constants
    become inputs of it (`inputs`: which call and constant feeds each)."""

    def __init__(self, hooks: list[Callable], mode: str, differentiated: bool = False):
        self.hooks, self.mode = hooks, mode
        self.differentiated = differentiated
        self.calls: list[HookCall] = []
        self.sites: list[Site] = []
        self.consts: list = []  # in replay: the hook calls' constants, traced
        self.program: Any = None  # in record: the program's trace
        self.inputs: list = []  # in record: (call, constant) per input, or its aval
        self.run: Any = None
        self.latest: Any = None  # the latest run made with these hooks (`Run`)
        # Points, and what the predicate hooks chose of them this call (by index).
        self.given: tuple[tuple, dict[int, frozenset[str]]] | None = None
        self.taken: dict[tuple[int, str], int] = {}
        # (len(calls), (hook, point) -> [(position, first constant)]), made by `take`.
        self._positions: tuple[int, dict] | None = None
        self.top: Any = None  # the program's own trace (not a loop's, a vmap's...)
        # What hooks kept (`acts.append(out)`), evaluated in the program's own trace:
        # the values, and which call's which kept value each is.
        self.kept_values: list = []
        self.kept_from: list[tuple[int, int]] = []
        # Whether a hook call ran on values (`_host_calls`): every later one does too.
        self.on_host = False
        self.values = True  # whether hooks may run on values (not under the user's vmap)
        self.host_order: HostOrder | None = None  # hooks on values in program order

    def where(self, value: Any, differentiated: bool = False) -> Where:
        """Whether a hook call at a point of `value` may run on values (`Where`)."""
        leaves = jax.tree.leaves(value)
        base = getattr(self.run, "base", None)
        batched = any(is_batched(x) for x in leaves) or users_vmap_base() is not None
        batched = batched or (base is not None and vmapped_between(base))
        through = differentiated or any(is_differentiated(x) for x in leaves)
        return Where(self.values and not batched, through or self.differentiated, self.on_host)

    def made(self, call: HookCall, where: Where) -> HookCall:
        """`call`, made now in program order: after a host call, calls are host calls."""
        call.at = (where.values, where.differentiated)
        self.on_host = self.on_host or call.host is not None
        return call

    def host_entries(self) -> list:
        """The entries of the forward host calls (a backward one runs in the backward
        pass, after the run)."""
        return [c.host for c in self.calls if c.host is not None and not c.backward]

    def end_trace(self) -> None:
        """Drops what refers to the trace that just ended (its tracers, the trace): a
        warm call reuses this owner, and nothing may keep that trace alive."""
        self.consts, self.kept_values, self.top, self.program = [], [], None, None
        self.host_order = None

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
                self.on_host = False

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
        if self._positions is None or self._positions[0] != len(self.calls):
            self._positions = (len(self.calls), _positions(self.calls))
        found = self._positions[1].get((index, name), [])
        seen = self.taken.get((index, name), 0)
        if seen >= len(found):
            return None
        self.taken[(index, name)] = seen + 1
        position, start = found[seen]
        call = self.calls[position]
        return call, self.consts[start : start + len(call.traced.consts)], position

    def alternative(self, index: int, name: str, value: Any, depth: int) -> HookCall | None:
        """The call of hook `index` at point `name` made earlier in this trace for a
        value of the same structure, if any: a reach of the same name is the other
        branch of a `lax.cond` (or another trace of a loop's body), where the hook
        runs once per call, as it does in PyTorch, its call evaluated in both."""
        structure = signature(value)
        for c in self.calls:
            same = (c.index, c.name, c.backward, c.depth) == (index, name, False, depth)
            if same and signature(abstract_value(c)) == structure:
                return c
        return None

    def layout(self) -> Layout:
        """Where the hooks were called, without what they computed (nor the arrays
        they held): what the hook pass needs to call them again."""
        calls = []
        for c in self.calls:
            light = HookCall(c.index, c.name, c.backward, None, c.depth)
            light.abstract, light.outer, light.at = abstract_value(c), c.outer, c.at
            calls.append(light)
        return Layout(calls, self.sites, self.latest)

    def key(self) -> tuple:
        return tuple(c.key for c in self.calls)

    def const_values(self) -> list:
        return [x for c in self.calls for x in c.traced.consts]


class SiteHook:
    """What a run's point calls for one of the user's hooks (see the module's docstring)."""

    def __init__(
        self, owner: Owner | None, index: int, hook: Callable, nested: Nested | None = None
    ):
        self.owner, self.index, self.hook = owner, index, hook
        self.nested = nested  # inline in another run's program: its hooks on values
        self.__wrapped__ = hook
        self.__qualname__ = hook_name(hook)

    def __call__(self, value: Any, name: str) -> Any:
        """The user's hook, called as it is."""
        return self.hook(value, HookName(name))

    def forward(self, value: Any, name: str, run: Any) -> Any:
        owner = self.owner
        if owner is None:
            if self.nested is not None:
                return self.nested.forward(self.hook, value, str(name))
            return self.hook(value, HookName(name))
        owner.for_run(run)
        if owner.mode == "record":
            depth = _loops.site_depth(run)
            where = owner.where(value)
            call = owner.alternative(self.index, str(name), value, depth)
            if call is None:
                call = traced_call(
                    self.hook, self.index, str(name), False, value, depth, False, where
                )
            owner.made(call, where)
            if asks_loop_index(call):
                _loops.loop_index()  # a trace reused: the run is staged, as the hook asked
            return owner.record(call, value)
        found = owner.take(self.index, str(name))
        if found is None:
            raise LayoutChanged(name)
        call, consts, position = found
        if asks_loop_index(call):
            _loops.loop_index()  # in a run not staged yet, it starts again, staged
        return evaluate(call, consts, value, owner, position)


def _positions(calls: list[HookCall]) -> dict:
    """(hook, point) -> each of its calls' position and the index of its first constant."""
    out: dict = {}
    start = 0
    for position, c in enumerate(calls):
        out.setdefault((c.index, c.name), []).append((position, start))
        start += len(c.traced.consts)
    return out


class LayoutChanged(Exception):
    """The program's trace reached a point the hook pass did not call the hook for."""


def backward(hooks: list[SiteHook], value: Any, name: str, run: Any) -> Any:
    """`value` with the backward hooks `hooks` of one point, in their run's mode."""
    owner = hooks[0].owner
    assert owner is not None  # inline runs register their hooks as value hooks (`Run`)
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
            where = owner.where(value)
            light = HookCall(h.index, site.name, True, None, 0)
            call = _guided_call(h.hook, light, where, site.value, alone=False)
            owner.made(call, where)
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
        hook, owner = self.hook, self.owner
        where = owner.where(grad)
        call = traced_call(hook.hook, hook.index, self.name, True, grad, 0, False, where)
        owner.made(call, where)
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


def hook_pass(owner: Owner, layout: Layout, differentiated: bool) -> None:
    """Calls every hook again, on abstract values, where `layout` says it is called:
    forward hooks in program order; backward hooks in the order the body's own
    differentiation called them or, for a program an outer `jax.grad` differentiates,
    point by point from the last."""
    outer = any(c.outer for c in layout.calls)
    made: dict[int, HookCall] = {}  # by the layout's position
    for i, c in enumerate(layout.calls):
        if c.outer and not differentiated:
            continue  # the layout's program was differentiated; this one is not
        values, through = c.at
        where = Where(owner.values and values, through or differentiated, owner.on_host)
        # A point's other branch: the hook's call made for the first, not the hook again.
        new = made.get(layout.again[i])
        if new is None:
            new = _guided_call(owner.hooks[c.index], c, where)
        made[i] = new
        owner.made(new, where)
        new.outer = c.outer
        owner.calls.append(new)
    if differentiated and not outer and not any(c.backward for c in layout.calls):
        backward_calls(owner, layout.sites)


def _guided_call(
    hook: Any, c: HookCall, where: Where, value: Any = None, alone: bool = True
) -> HookCall:
    """`traced_call` of a hook where a layout calls it (on `value`, by default what `c`
    was given), through the guided errors of hooks (`_core/_guide.py`), as a run's first
    trace calls them (`run_chain`)."""
    kind = "operation" if is_operation(c.name) else "hook point"
    place = f"at {kind} {c.name!r}{' (backward)' if c.backward else ''}"

    def call(hook: Any, value: Any) -> HookCall:
        return traced_call(hook, c.index, c.name, c.backward, value, c.depth, alone, where)

    return guided(call, hook, abstract_value(c) if value is None else value, place)


def backward_calls(owner: Owner, sites: list[Site]) -> None:
    """Calls the backward hooks of `sites` that an outer `jax.grad` runs, from the
    last point to the first, as its backward pass reaches them."""
    for site in reversed(sites):
        for index in site.indices:
            hook = owner.hooks[index]
            where = Where(owner.values, True, owner.on_host)
            call = traced_call(hook, index, site.name, True, site.value, 0, True, where)
            owner.made(call, where)
            call.outer = True
            owner.calls.append(call)

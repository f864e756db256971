"""One compiled program of a run, and what its trace runs.

A `Call` is one call of a run: the function, its arguments and the walk of what they
read (`_closures.Walk`), the hooks' calls of this call (`_hookpass.Owner`). A `Program`
is one `jax.jit`: traced with the hooks evaluated where their calls were traced
(replay), or traced while the hooks are traced where their points are, their constants
becoming inputs of the program as they are found (`record`). Either way its arguments
are the model's leaves, then the hook calls' constants; its outputs, the function's
output and the values the hooks kept (`acts.append(out)`: `_kept.py`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from .._core import (
    RUN,
    Bounded,
    Install,
    ThreadStack,
    Walk,
    concrete_only,
    current_trace,
    get_aval,
    is_tracer,
    program_key,
    static_key,
    touched,
    trace_context,
    trace_program,
)
from ._hookpass import Owner, SiteHook
from ._waits import waiting

NUMBERS = (int, float, complex)
MAX_PROGRAMS = 256  # programs kept (`_programs.py`), and layouts

# The calls whose program is being traced, innermost last.
LIVE: ThreadStack[Call] = ThreadStack("run programs being traced")


class Spec:
    """What a run does besides calling `fn`: its hooks, and its body.

    `body(fn, args, kwargs, fwd, bwd)` runs the function under the run; `options` is
    the key of whatever else it depends on (the cache filter...).
    """

    def __init__(
        self, caller: str, body: Callable, options: Hashable, fwd: list, bwd: list
    ) -> None:
        self.caller, self.body, self.options = caller, body, options
        self.fwd, self.bwd = fwd, bwd
        self.registered: Hashable = ()  # the registered hooks' keys this call

    def run(self, fn: Callable, args: tuple, kwargs: dict, owner: Owner | None, nested: Any = None):
        """`body` with the hooks as the run's points call them (`SiteHook`)."""
        n = len(self.fwd)
        fwd = [(sel, SiteHook(owner, i, h, nested)) for i, (sel, h) in enumerate(self.fwd)]
        bwd = [(sel, SiteHook(owner, n + i, h, nested)) for i, (sel, h) in enumerate(self.bwd)]
        return self.body(fn, args, kwargs, fwd, bwd)


class Call:
    """One call of a run: its roots (function, arguments, hooks), the walk of what they
    read, each root's plan, and which sites are traced."""

    def __init__(
        self,
        spec: Spec,
        roots: list,
        walk: Walk | None,
        plans: list | None,
        traced: list[int],
        sites: list,
    ):
        # A warm call (`_fast`) has no walk: a trace walks again, and finds the sites
        # in the same order, as nothing the last walk read has changed.
        self.spec, self.roots, self.walk = spec, roots, walk
        self.plans, self.traced, self.sites = plans, traced, sites
        self.before: Walk | None = None  # what the roots held when the trace began
        self.owner: Owner | None = None  # the hooks, and their calls traced this call
        self.layout_key: Any = None  # where the layout of this call's structure is kept
        self.values = True  # whether its points' values are concrete (not under a vmap)
        # Whether a nested run's backward hook runs on values in its program (`_nested`).
        self.backward_on_values = False


class Program:
    """One compiled program: its own `jax.jit`, so it is freed with this object.

    Its arguments are the model's leaves, then the hook calls' constants in the order
    `inputs` gives: `(call, constant)` positions among the hook calls, or the abstract
    value of an input no call feeds (zeros: a call of a run that started again).

    Jitted with `keep_unused=True`: a hook on values at a point whose value the model
    does not use still runs (its host call has no JAX effect to keep it)."""

    def __init__(self) -> None:
        self.watch: list = []
        self.traces = 0
        self.boxed = False  # whether a trace returned Python values (`_Box`)
        self.inputs: list | None = None  # None: every call's constants, in order
        self.kept_from: list = []  # which hook call kept each extra output
        # (trace context, abstract values) -> (jitted, the constants it is passed)
        self._traced: dict[Any, tuple[Callable, Consts]] = {}
        self._recorded: tuple[Callable, Consts] | None = None
        self._weak: set[int] = set()  # the ids of what the program's key holds weakly
        # Whether a trace met a nested run's backward hook on values (`_waits.py`).
        self.backward_on_values = False

    def jitted(self, *args: Any, waits: bool = False) -> Any:
        """Runs the program: as recorded (`record`), or traced by `_replay`; `waits`:
        its backward pass runs hooks on values, which the backward pass waits for
        (`_waits.waiting`).

        A method, not a bound method kept on the instance: that would be a reference
        cycle, and an evicted program (its executables, about 1.4 MB each on CPU) would
        wait for the cyclic GC's next full collection instead of being freed at once."""
        if self._recorded is not None:
            return self._call_recorded(args, waits)
        return self._replay(args, waits)

    def hold_weakly(self, objects: list) -> None:
        """Holds the arrays among the program's constants that are `objects` (what its
        key holds by identity: it dies with them) weakly, now and in later traces."""
        self._weak = {id(o) for o in objects}
        for _, consts in [*self._traced.values(), *filter(None, [self._recorded])]:
            consts.weaken(self._weak)

    def _call_recorded(self, args: tuple, waits: bool) -> Any:
        assert self._recorded is not None
        jitted, consts = self._recorded
        values = consts.get()
        return self._replay(args, waits) if values is None else _call(jitted, values, args, waits)

    def _replay(self, args: tuple, waits: bool) -> Any:
        """`_trace` as a `jax.jit` of the same arguments would run it, but the arrays
        its trace closed over (the function's own, read from outside its arguments) are
        passed in, not embedded in the program: one copy of a closed-over model's
        weights, however many programs read it."""
        # A jax.Array's own abstract value, read rather than made (about 2 µs an
        # argument: a model's hundred leaves took 200 µs a call).
        key = (trace_context(), tuple(getattr(x, "aval", None) or get_aval(x) for x in args))
        found = self._traced.get(key)
        if found is None:
            shapes: dict[str, Any] = {}

            def body(_: Any, *leaves: Any) -> list:
                flat, shapes["tree"] = jax.tree.flatten(self._trace(*leaves))
                return flat

            run, consts, _ = trace_program(body, [get_aval(x) for x in args], "run")
            found = (_jit_consts(run, shapes["tree"]), Consts(consts, self._weak))
            if not any(is_tracer(c) for c in consts):  # a transformation's: this call's
                self._traced[key] = found
        jitted, held = found
        values = held.get()
        if values is None:  # an array it read is gone: its key too (not called again)
            self._traced.pop(key, None)
            return self._replay(args, waits)
        return _call(jitted, values, args, waits or self.backward_on_values)

    def _trace(self, *leaves: Any) -> Any:
        call = LIVE.items()[-1]
        out = _begin(self, call, leaves)
        self.backward_on_values = self.backward_on_values or call.backward_on_values
        leaves_out = jax.tree.leaves(out)
        self.boxed = self.boxed or not all(isinstance(x, jax.Array) for x in leaves_out)
        kept = self._kept(call)
        if call.owner is not None:
            call.owner.end_trace()
        return boxed(out), kept

    def _kept(self, call: Call) -> list:
        """The values the hooks kept, as outputs (see `_hookpass.deliver`)."""
        owner = call.owner
        if owner is None:
            return []
        self.kept_from = list(owner.kept_from)
        return list(owner.kept_values)

    def record(self, call: Call, leaves: list) -> None:
        """Traces the program while the hooks are traced where their points are: each
        hook call's constants become inputs of the program as they are found."""
        owner = call.owner
        assert owner is not None
        shapes: dict[str, Any] = {}

        def body(program: Any, *model_leaves: Any) -> list:
            owner.program = program
            result = _begin(self, call, model_leaves)
            self.backward_on_values = self.backward_on_values or call.backward_on_values
            shapes["boxed"] = not all(isinstance(x, jax.Array) for x in jax.tree.leaves(result))
            out = (boxed(result), self._kept(call))
            owner.end_trace()  # before the trace ends: nothing may keep its tracers
            flat, shapes["tree"] = jax.tree.flatten(out)
            return flat

        run, consts, _ = trace_program(body, [get_aval(x) for x in leaves], call.spec.caller)
        self.inputs = owner.inputs
        self.boxed = shapes["boxed"]
        self._recorded = (_jit_consts(run, shapes["tree"]), Consts(consts, self._weak))

    def arguments(self, owner: Owner | None) -> list:
        """The hook calls' constants, as this program takes them."""
        if owner is None:
            return []
        if self.inputs is None:
            return owner.const_values()
        return [
            owner.calls[src[0]].traced.consts[src[1]] if type(src) is tuple else _zeros(src)
            for src in self.inputs
        ]


class Consts:
    """The arrays a program's trace closed over, which it is passed on each call; those
    its key holds by identity (the user's, read from outside the arguments) are held
    weakly, so that a program never keeps an array rebound away alive (a global model
    replaced at every step): its key dies with them, and it with its key."""

    __slots__ = ("values", "weak")

    def __init__(self, consts: list, weak: set[int]):
        self.values: list = list(consts)
        self.weak: list[int] = []  # where a weak reference stands
        self.weaken(weak)

    def weaken(self, weak: set[int]) -> None:
        for i, c in enumerate(self.values):
            if i not in self.weak and id(c) in weak:
                self.values[i] = weakref.ref(c)
                self.weak.append(i)

    def get(self) -> list | None:
        """The arrays, or `None` if one held weakly is gone."""
        if not self.weak:
            return self.values
        values = list(self.values)
        for i in self.weak:
            values[i] = values[i]()
            if values[i] is None:
                return None
        return values


def _call(jitted: Callable, values: list, args: tuple, waits: bool) -> Any:
    if waits:
        values, args = waiting(values, args)
    return jitted(values, *args)


def _jit_consts(run: Callable, tree: Any) -> Callable:
    """`run(*consts, *args)` jitted, its flat outputs made `tree` again: `(consts, *args)`."""
    return jax.jit(
        lambda consts, *args: jax.tree.unflatten(tree, run(*consts, *args)), keep_unused=True
    )


def shape_key(x: Any) -> Any:
    """An argument's type, shape, dtype and weak type: what its points' values depend on."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return type(x)
    return (shape, x.dtype, getattr(x, "weak_type", False))


def _zeros(aval: Any) -> Any:
    return np.zeros(aval.shape, aval.dtype)


def boxed(out: Any) -> Any:
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else _Box(x), out)


def _begin(program: Program, call: Call, leaves: tuple) -> Any:
    """Runs the run's body on the program's arguments: the model's, then the hooks'."""
    program.traces += 1
    spec = call.spec
    if call.plans is None:
        call.walk, _, call.plans = walk_roots(spec, call.roots)
    call.before = walk_roots(spec, call.roots, record=True)[0]
    n = len(call.traced)
    values = list(call.sites)
    for i, x in zip(call.traced, leaves[:n]):
        # A number is traced only as an operand: where its value is needed (a
        # string, a loop bound) the trace fails and it is static again.
        values[i] = concrete_only(x) if type(values[i]) in NUMBERS else x
    owner = call.owner
    if owner is not None:
        owner.top = current_trace()
        if owner.mode == "replay":
            owner.consts = list(leaves[n:])
    needed = touched(call.plans, set(call.traced))
    install = Install(values, needed)
    # The arguments' pytree made again around the tracers (as `jax.jit` does); the
    # rest (a function, its closures and globals, objects) is the user's own.
    fn, args, kwargs = (
        p if plan is None or not (type(plan) is int or id(plan) in needed) else install(plan)
        for p, plan in zip(call.roots, call.plans)
    )
    del install  # it holds tracers
    with program_key(Token()):
        return spec.run(fn, args, kwargs, owner)


@jax.tree_util.register_static
class _Box:
    """A Python value a program returns (a string, a name): in the output's structure."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Box) and other.value is self.value


def unbox(out: Any) -> Any:
    return jax.tree.map(
        lambda x: x.value if isinstance(x, _Box) else x, out, is_leaf=lambda x: isinstance(x, _Box)
    )


class Token:
    """A fresh jit context per traced program: jits inside it retrace in each new one."""

    __slots__ = ("__weakref__",)


def selector_key(sel: Any) -> Hashable:
    return (sel.names, None if sel.predicate is None else static_key(sel.predicate))


# Objects a trace wrote (see `_after_trace`), by id: (object, {entry: what it left there});
# held, so that ids stay theirs.
written: Bounded[int, Any] = Bounded(MAX_PROGRAMS * 4)


def walk_roots(
    spec: Spec,
    roots: list,
    record: bool = False,
    names: set | None = None,
    selectors: tuple | None = None,
) -> tuple[Walk, Hashable, list]:
    walk = Walk(RUN, written, record)
    walk.names.update(names or ())
    keys: list = [spec.caller, spec.options, spec.registered, len(spec.fwd), len(spec.bwd)]
    plans = []
    for i, root in enumerate(roots):
        keys.append(walk(root, ("fn", "args", "kwargs")[i]))
        plans.append(walk.plan)
    if selectors is None:
        selectors = tuple(selector_key(sel) for sel, _ in (*spec.fwd, *spec.bwd))
    keys.extend(selectors)
    if walk.names_grew():  # a user module met before the code that reads it
        return walk_roots(spec, roots, record, walk.names, selectors)
    return walk, tuple(keys), plans

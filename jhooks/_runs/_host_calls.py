"""Hooks that run on values: a run's graph break, PyTorch's eager semantics.

In a run called outside the user's `jax.jit` (an *eager* run), a hook whose Python does
more than compute with JAX (it prints, counts, keeps a value, converts one with `float`
or `np.asarray`, branches on one, reads what another hook kept) is not traced: the
program calls it, through a host callback, when execution reaches its point, with the
point's concrete arrays, and takes what it returns. This is torch.compile's graph
break: the program before and after the point stays compiled and is reused. Its Python
so runs once per call in program order, forward hooks in the forward pass and backward
hooks in the backward pass, and everything it keeps is a concrete array.

Which hooks run on values (`Owner.on_host`): every hook that is not pure (`_pure.py`),
a pure one whose trace needs a concrete value, and, in program order, every hook after
the first of these: their Python reads what the hooks before them wrote in this call.

A host call is traced like any hook call (`_hookcall.HookCall`): one callback whose
first operand is the number of this call's entry (a lifted constant), so the program
is the same whatever the hook is, and its callback calls the hook of the call running;
its second makes it wait for the host call before it (`_host_order.py`).
Under differentiation the value passes its gradient through unchanged, and a hook that
replaced it is refused: jhooks cannot differentiate Python that ran on values.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core import (
    Emitted,
    NeedsConcrete,
    as_arrays,
    check_like,
    code_names,
    collecting,
    guided,
    hook_name,
    host_avals,
    host_call,
    is_array_like,
    is_dead_tracer,
    is_host_hook,
    is_tracer,
    reached_by,
    register_callback,
    registered,
    unregister,
    user_stacklevel,
)
from ._backward import as_gradient
from ._pure import writes_nothing
from ._scopes import HookName

# The errors of Python that needs a traced value's value.
CONCRETE = (
    NeedsConcrete,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerArrayConversionError,
)


class HostEntry:
    """One host call: the hook, its point, the value's structure, and the error it
    raised when the program ran it (re-raised by the run, `raise_failure`)."""

    __slots__ = (
        "hook",
        "name",
        "backward",
        "in_tree",
        "statics",
        "avals",
        "error",
        "number",
        "depth",
        "loops",
        "place",
        "host_avals",
    )

    def __init__(self, hook: Callable, name: str, backward: bool, in_tree: Any, statics: tuple):
        self.hook, self.name, self.backward = hook, name, backward
        self.in_tree, self.statics = in_tree, statics
        self.avals: list = []  # of the point's arrays (`set_avals`)
        self.host_avals: list = []  # of the arrays the hook is given (`as_arrays`)
        self.error: BaseException | None = None
        self.number: Any = None
        self.depth = 0  # the loops around its point whose iteration the hook reads
        self.loops = 0  # the loops around its point
        self.place = f"at {'operation' if '/' in name else 'hook point'} {name!r}"
        if backward:
            self.place += " (backward)"

    def set_avals(self, avals: list, host: list | None = None) -> None:
        """The abstract values of the point's arrays, and of what the hook is given
        (`host_avals(avals)`, where the caller has them)."""
        self.avals = list(avals)
        self.host_avals = host_avals(avals) if host is None else host

    def run(self, leaves: tuple, differentiated: bool) -> list:
        try:
            return self._run(leaves, differentiated)
        except BaseException as err:  # KeyboardInterrupt too: the run raises it again
            self.error = err
            raise

    def _run(self, operands: tuple, differentiated: bool) -> list:
        index = tuple(int(i) for i in operands[: self.depth])
        reached = operands[self.depth :]
        leaves = as_arrays(reached, self.host_avals)
        it = iter(leaves)
        value = jax.tree.unflatten(
            self.in_tree, [next(it) if s is None else s for s in self.statics]
        )
        place = self.place
        given = index if self.depth else (() if not self.loops else None)
        if self.backward:  # the backward pass runs loops in reverse: no index there
            given = _Backward(self.hook)
        with _running_on_host(given), collecting(Emitted()) as emitted:
            out = guided(lambda h, v: h(v, HookName(self.name)), self.hook, value, place)
        if emitted.values:
            raise ValueError(
                f"hook {hook_name(self.hook)} {place} called jhooks.emit"
                f"({next(iter(emitted.values))!r}) while running on values (its Python does "
                "more than compute with JAX), where nothing carries the value out of the "
                "program: keep it in your own list or dict there, or emit from a pure hook."
            )
        if self.backward:
            out = as_gradient(out, value)
        if out is None:
            return list(reached)
        what = "gradient" if self.backward else "value"
        if isinstance(value, list) and isinstance(out, tuple) and len(out) == len(value):
            out = list(out)  # an operation's outputs: a list or a tuple (`jnp.split`)
        check_like(self.hook, out, value, what, f"at hook point {self.name!r}")
        if differentiated:
            # Its tangent would be taken as the identity: refused (a backward hook's
            # replacement is differentiated again under grad of grad, `jax.hessian`).
            where = (
                "a backward pass that is differentiated again"
                if self.backward
                else "a run that is differentiated"
            )
            raise ValueError(
                f"hook {hook_name(self.hook)} at point {self.name!r} runs on concrete values "
                "(its Python does more than compute with JAX: it writes state, prints, or "
                f"converts a value) and returned a replacement in {where}: jhooks cannot "
                "differentiate Python that ran on values. Return the replacement from a pure "
                "hook (JAX only, writing nothing) that runs before any hook with side "
                "effects, or keep the hook's side effects in a separate hook that returns None."
            )
        new = [x for x in jax.tree.leaves(out) if is_array_like(x)]
        return [np.asarray(x, dtype=a.dtype) for x, a in zip(new, self.avals)]


_state = threading.local()


class _running_on_host:
    """Marks the thread as running a hook on values, in the loop iterations `index`
    (`None`: the hook does not read them)."""

    def __init__(self, index: Any):
        self.index = index

    def __enter__(self) -> None:
        stack = getattr(_state, "indices", None)
        if stack is None:
            stack = _state.indices = []
        stack.append(self.index)

    def __exit__(self, *exc: Any) -> None:
        _state.indices.pop()


class _Backward:
    """`_running_on_host`'s index in a backward hook: `loop_index()` is refused there."""

    def __init__(self, hook: Any):
        self.hook = hook


def in_backward_hook(hook: Any) -> ValueError:
    """The error of `loop_index()` called in backward hook `hook`."""
    return ValueError(
        f"jhooks.loop_index() was called in backward hook {hook_name(hook)}: it is "
        "available only in the forward pass (forward hooks and forward code) of "
        "jhooks.run_with_hooks or jhooks.run_with_cache. Read it in a forward hook, "
        "or give the backward hook one point per layer."
    )


def host_loop_index() -> tuple | None:
    """In a hook running on values, the iterations of the loops around its point (or
    an error, where its code does not name `loop_index` or it is a backward hook);
    `None` elsewhere."""
    stack = getattr(_state, "indices", None)
    if not stack:
        return None
    if isinstance(stack[-1], _Backward):
        raise in_backward_hook(stack[-1].hook)
    if stack[-1] is None:
        raise ValueError(
            "jhooks.loop_index() was called by a hook running on values whose code does "
            "not name loop_index (a helper it calls does): jhooks gives a hook on values "
            "the iterations only when its own code calls jhooks.loop_index(). Call it in "
            "the hook and pass the result on."
        )
    return tuple(jax.numpy.asarray(i, jax.numpy.int32) for i in stack[-1])


def reads_loop_index(hook: Any) -> bool:
    """Whether the code of `hook` (or the code inside it) names `loop_index`."""
    fn = hook.func if isinstance(hook, functools.partial) else hook
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    elif not isinstance(fn, types.FunctionType):
        fn = vars(type(fn)).get("__call__")
    code = getattr(fn, "__code__", None)
    return code is not None and "loop_index" in code_names(code)


# The abstract value of a host call's `after` operand (`host_value`).
AFTER = jax.ShapeDtypeStruct((1,), np.float32)


def host_value(entry: HostEntry, loop_index: Callable[[int, list], tuple]) -> Callable[[list], Any]:
    """The traced function of a host call, of `[number, after, *leaves]`: the value at
    its point after the hook, computed by the callback of the entry numbered `number`
    (an input given as a constant, so that one trace serves every entry). `after` (of
    `AFTER`'s shape, unread) is computed from the outputs of the host call before it
    (`Owner.after_host_calls`), so that the calls run in program order."""

    def fn(leaves: list) -> Any:
        number, after, *rest = leaves
        index = list(loop_index(entry.depth, rest)) if entry.depth else []
        outs = _host(number, after, index, rest)
        it = iter(outs)
        return jax.tree.unflatten(
            entry.in_tree, [next(it) if s is None else s for s in entry.statics]
        ), {}

    return fn


def host_number(entry: HostEntry, avals: list, host: list | None = None) -> Any:
    """Registers `entry` (for values of `avals`; `host`: `HostEntry.set_avals`): the
    number its program is given."""
    entry.set_avals(avals, host)
    entry.number = np.int32(register_callback(entry))
    return entry.number


def _callback(target: Callable, head: list, leaves: list, skip: int) -> list:
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves[skip:]]
    return host_call(target, [*head, *leaves], shapes)


@jax.custom_jvp
def _host(number: Any, after: Any, index: list, leaves: list) -> list:
    return _callback(_value, [number, after], [*index, *leaves], len(index))


@jax.custom_jvp
def _differentiated(number: Any, after: Any, index: list, leaves: list) -> list:
    return _callback(_differentiated_value, [number, after], [*index, *leaves], len(index))


def _host_jvp(primals: tuple, tangents: tuple) -> tuple[list, list]:
    # The value passes its tangent through unchanged, at any order of differentiation
    # (grad of grad: the differentiated call is differentiated again by this rule).
    return _differentiated(*primals), tangents[3]


_host.defjvp(_host_jvp)
_differentiated.defjvp(_host_jvp)


def _value(number: np.ndarray, after: np.ndarray, *leaves: np.ndarray) -> list:
    return registered(int(number)).run(leaves, False)


def _differentiated_value(number: np.ndarray, after: np.ndarray, *leaves: np.ndarray) -> list:
    return registered(int(number)).run(leaves, True)


def holds_tracer(hook: Any) -> bool:
    """Whether `hook` holds a live tracer in what its own code reaches (`reached_by`:
    cells, defaults, `partial` arguments, `self`, named globals), or in the tuples,
    lists, dicts and objects there (a transformation's value around the run), within 256
    values (beyond them, a tracer fails where the hook uses it). A tracer of a trace that
    ended (what a forward hook of a differentiated run kept) is not one: a backward hook
    reading it runs on values, where it is concrete."""
    budget = [256]
    return any(_holds(v, 0, budget) for _, v in reached_by(hook))


def _holds(x: Any, depth: int, budget: list) -> bool:
    budget[0] -= 1
    if depth > 3 or budget[0] < 0:
        return False
    if is_tracer(x):
        return not is_dead_tracer(x)
    if isinstance(x, (tuple, list)):
        held = list(x[:256])
    elif isinstance(x, dict):
        held = [v for _, v in zip(range(256), x.values())]
    elif hasattr(x, "__dict__") and not isinstance(x, (type, types.ModuleType)):
        if isinstance(x, (types.FunctionType, types.MethodType, functools.partial)):
            return False
        held = list(vars(x).values())[:256]
    else:
        return False
    return any(_holds(v, depth + 1, budget) for v in held)


def ran(entries: list[HostEntry]) -> None:
    """Forgets the entries of forward host calls whose program has run (a backward
    call's entry stays registered: the backward pass may run later)."""
    for entry in entries:
        unregister(entry.number)


def users_hook(hook: Any) -> Any:
    """The user's hook inside jhooks' own wrapper of it (a name's layout), whose code
    decides whether it is pure."""
    while (getattr(hook, "__module__", None) or "").startswith("jhooks.") and hasattr(
        hook, "__wrapped__"
    ):
        hook = hook.__wrapped__
    return hook


_told: set = set()


def warn_once_per_compilation(spec: Any) -> None:
    """Tells, once per hook, that a hook with side effects in a run inside the user's
    `jax.jit` runs once per compilation (JAX's rule), and the ways out."""
    for _, wrapper in (*spec.fwd, *spec.bwd):
        hook = users_hook(wrapper)
        told = getattr(hook, "__code__", None) or hook_name(hook)
        if told in _told or is_host_hook(hook) or writes_nothing(hook):
            continue  # a `jhooks.host` hook runs on every call: nothing to tell
        _told.add(told)
        warnings.warn(
            f"jhooks.{spec.caller}: hook {hook_name(hook)} has Python side effects (it writes "
            "state, prints or calls code other than JAX), and the run is inside a function "
            "you stage out (jax.jit, eqx.filter_jit, nnx.jit, lax.scan): JAX calls it on "
            "tracers once per compilation, not once per call. Call the run outside your jit "
            "(its hooks then run on every call, with concrete values, as in PyTorch), or wrap "
            "the side effect in jhooks.host.",
            stacklevel=user_stacklevel(("jhooks", "jax")),
        )


def failure(entries: list[HostEntry]) -> BaseException | None:
    """The first error a host call of `entries` raised, taken (each is raised once)."""
    for entry in entries:
        if entry.error is not None:
            err, entry.error = entry.error, None
            return err
    return None

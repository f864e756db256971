"""Tracing one hook on its own, to a jaxpr whose constants are arguments.

A run calls each hook's Python on every call (`_runs/_hookpass.py`), on abstract values
of the hook's point, and compares what the hook computed by its structure: the jaxpr
with every constant and literal operand lifted out (`Traced.key`), the lifted values
being the compiled program's arguments. What the hook left behind (a traced value in
one of the user's objects) is found by whether the trace outlived the hook.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._leaks import leaked_tracers, places_of, remember_failed, remember_program

try:  # jax 0.10: tracing a function to a jaxpr without jax.make_jaxpr's wrapping.
    from jax._src import api_util as _api_util
    from jax._src import config as _config
    from jax._src import core as _core
    from jax._src import linear_util as _lu
    from jax._src import source_info_util as _source_info
    from jax._src.interpreters import ad as _ad_internal
    from jax._src.interpreters import batching as _batching_internal
    from jax._src.interpreters import partial_eval as _pe
    from jax._src.lax import slicing as _slicing
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"jhooks traces hooks through jax._src.linear_util, which moved in this JAX "
        f"({jax.__version__}); jhooks supports jax 0.10. Please report it."
    ) from e

# The primitive of `jax.debug.callback` (and so of `jhooks.host`): its `callback`
# parameter is Python called when the program runs, so the compiled program calls the
# current call's function through `_dispatch`, given its number as an operand. (The
# callbacks of `pure_callback` and `io_callback` stay parameters: a new one is a new
# program.)
_CALLBACKS = frozenset({"debug_callback"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call"})


def get_aval(x: Any) -> Any:
    """The abstract value (shape, dtype, weak type) of an array, tracer or abstract value."""
    aval = x if isinstance(x, _core.ShapedArray) else _core.typeof(x)
    return _core.ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def is_array_like(x: Any) -> bool:
    """Whether `x` is an array (JAX, NumPy, a tracer) or an abstract value of one."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, _core.ShapedArray))


def is_tracer(x: Any) -> bool:
    """Whether `x` is a tracer (an abstract value of a trace), not a concrete array."""
    return isinstance(x, _core.Tracer)


def is_vmapped(x: Any) -> bool:
    """Whether `x` is a tracer of `jax.vmap`: one example's value (its shape has no batch
    axis) of a batched array."""
    return isinstance(x, _batching_internal.BatchTracer)


def is_dead_tracer(x: Any) -> bool:
    """Whether `x` is a tracer of a trace that is not running now (one that ended: a
    value a hook kept), not of the current trace or a transformation around it."""
    if not isinstance(x, _core.Tracer):
        return False
    trace = _core.trace_ctx.trace
    while trace is not None:
        if x._trace is trace:
            return False
        trace = getattr(trace, "parent_trace", None)
    return True


def is_differentiated(x: Any) -> bool:
    """Whether `x` is a tracer of a differentiation (`jax.grad`, `jax.vjp`, `jax.jvp`
    around the code), possibly under other transformations' tracers."""
    while isinstance(x, _core.Tracer):
        if isinstance(x, (_ad_internal.JVPTracer, *_LINEARIZE)):
            return True
        x = getattr(x, "val", getattr(x, "primal", None))
    return False


_LINEARIZE = tuple(t for t in (getattr(_ad_internal, "LinearizeTracer", None),) if t is not None)


class Traced:
    """One call of a hook, traced: `jaxpr` (its lifted constants first, then the
    inputs), the constants' values, the output's structure, and `key`, the structure
    of the computation (equal keys: one compiled program serves both)."""

    __slots__ = ("jaxpr", "consts", "out_tree", "key", "leaked", "kept", "callbacks")

    def __init__(self, jaxpr: Any, consts: list, out_tree: Any, key: Any, leaked: list):
        self.jaxpr, self.consts, self.out_tree = jaxpr, consts, out_tree
        self.key, self.leaked = key, leaked
        # Where the hook kept each traced value that is an extra output of the jaxpr
        # (after `out_tree`'s): (container, key, tracer) places, one list per value.
        self.kept: list[list] = []
        self.callbacks = False  # whether it calls Python when the program runs

    def with_given(self, given: list) -> Traced:
        """The same trace with other values of its given inputs (`trace_hook`)."""
        new = Traced(
            self.jaxpr,
            self.consts[: len(self.consts) - len(given)] + given,
            self.out_tree,
            self.key,
            [],
        )
        new.kept = [[] for _ in self.kept]
        new.callbacks = self.callbacks
        return new


def trace_hook(
    fn: Callable[[list], Any],
    in_avals: list,
    name: str,
    given: list | None = None,
    reach: list | None = None,
) -> Traced:
    """Traces `fn(leaves) -> pytree` on abstract leaves `in_avals` (`ShapedArray`s).

    **Arguments:**

    - `fn`: called once with a list of tracers.
    - `in_avals`: the abstract values of its inputs.
    - `name`: what the jaxpr is traced for, in JAX's messages.

    **Returns:**

    A `Traced`: every constant and literal operand of the jaxpr lifted out as an
    argument, and the tracers the hook left reachable after the trace (`leaked`).
    `given`: values of the first inputs, which are constants too (after the lifted
    ones, in `Traced.consts`). `reach`: what the hook's own code reaches, where a value
    it kept is looked for before the heap is searched.
    """
    store: dict[str, Any] = {}

    def flat(*leaves: Any) -> list:
        store["trace"] = weakref.ref(_core.trace_ctx.trace)
        out = fn(list(leaves))
        outs, tree = jax.tree.flatten(out)
        # Python values in the output (a point's str or int leaf) stay Python values.
        arrays = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in outs]
        statics = tuple(None if a else x for a, x in zip(arrays, outs))
        store["tree"] = (tree, statics)
        return [x for a, x in zip(arrays, outs) if a]

    info = _api_util.debug_info(name, fn, (in_avals,), {})
    wrapped = _lu.wrap_init(flat, debug_info=info)
    # What the hook keeps (`acts.append(z)`) is found below and given its concrete value
    # or taken out, with a warning: under `jax.checking_leaks()` it is not JAX's leak.
    with _config.check_tracer_leaks(False):
        jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, in_avals)
    rules = sum(1 for eqn in jaxpr.eqns if eqn.primitive.name in _CUSTOM)
    leaked, shallow = leaked_tracers(store["trace"], rules, reach or [])
    kept, places = [], []
    if leaked:
        known = set(jaxpr.invars) | {v for eqn in jaxpr.eqns for v in eqn.outvars}
        for tracer in leaked:
            where = shallow.get(id(tracer)) if shallow is not None else places_of(tracer, leaked)
            if (isinstance(tracer.val, _core.Literal) or tracer.val in known) and where:
                kept.append(tracer.val)
                places.append(where)
        leaked = [t for t in leaked if not any(t is p[3] for w in places for p in w)]
        jaxpr = jaxpr.replace(outvars=[*jaxpr.outvars, *kept])
    lifted, values, key = _lift(jaxpr, consts)
    traced = Traced(lifted, values + list(given or ()), store["tree"], key, leaked)
    traced.kept = places
    traced.callbacks = any(e.params.get("callback") is _dispatch for e in lifted.eqns)
    return traced


def _lift(jaxpr: Any, consts: list) -> tuple[Any, list, Any]:
    """`jaxpr` with its constants and literal operands as leading inputs, their
    values, and the key of what is left: the lifted jaxpr as JAX prints it (its
    equations, parameters and abstract values, variables numbered in order)."""
    new_vars: list = list(jaxpr.constvars)
    values: list = list(consts)

    def lifted_input(aval: Any, value: Any) -> Any:
        var = _core.Var(aval)
        new_vars.append(var)
        values.append(value)
        return var

    def operand(v: Any) -> Any:
        return lifted_input(v.aval, v.val) if isinstance(v, _core.Literal) else v

    int32 = _core.ShapedArray((), np.int32)
    eqns = []
    for eqn in jaxpr.eqns:
        invars = [operand(v) for v in eqn.invars]
        params = eqn.params
        if eqn.primitive is _slicing.slice_p and params.get("strides") is None:
            # A slice at a Python int (`z[:, head]`): its start is an argument too, so
            # a sweep over heads is one program (the same slice, never clamped).
            starts = [lifted_input(int32, np.int32(a)) for a in params["start_indices"]]
            sizes = tuple(b - a for a, b in zip(params["start_indices"], params["limit_indices"]))
            eqns.append(
                eqn.replace(
                    primitive=_slicing.dynamic_slice_p,
                    invars=[*invars, *starts],
                    params={"slice_sizes": sizes},
                )
            )
            continue
        if eqn.primitive.name in _CALLBACKS and "callback" in params:
            number = lifted_input(int32, np.int32(_register(params["callback"])))
            invars = [number, *invars]
            params = {**params, "callback": _dispatch}
        eqns.append(eqn.replace(invars=invars, params=params))
    outvars = [operand(v) for v in jaxpr.outvars]
    lifted = jaxpr.replace(
        constvars=[], invars=[*new_vars, *jaxpr.invars], eqns=eqns, outvars=outvars
    )
    return lifted, values, str(lifted)


def eval_traced(traced: Traced, consts: list, leaves: list) -> tuple[Any, list]:
    """Evaluates a traced hook on `consts` (its lifted constants, possibly traced)
    and its input leaves, binding every equation in the current trace: its output,
    and the extra outputs (the values it kept, `Traced.kept`)."""
    outs = _core.eval_jaxpr(traced.jaxpr, [], *consts, *leaves)
    tree, statics = traced.out_tree
    n = len(outs) - len(traced.kept)
    it = iter(outs[:n])
    flat = [next(it) if s is None else s for s in statics]
    return jax.tree.unflatten(tree, flat), list(outs[n:])


# The Python functions of callbacks in hooks, by a number the program passes to
# `_dispatch`: the latest calls' functions, so that a compiled program runs the
# callback of the call that runs it.
_MAX_CALLBACKS = 4096
_callbacks: OrderedDict[int, Callable] = OrderedDict()
_numbers = itertools.count(1)
_lock = threading.Lock()


def _register(callback: Any) -> int:
    with _lock:
        number = next(_numbers) % (2**31 - 1)
        _callbacks[number] = callback
        while len(_callbacks) > _MAX_CALLBACKS:
            _callbacks.popitem(last=False)
    return number


def unregister(number: Any) -> None:
    """Forgets what `_register` registered under `number` (its program has run)."""
    with _lock:
        _callbacks.pop(int(number), None)


def is_batched(x: Any) -> bool:
    """Whether `x` is a tracer of `jax.vmap`, possibly under other transformations'."""
    while isinstance(x, _core.Tracer):
        if isinstance(x, _batching_internal.BatchTracer):
            return True
        x = getattr(x, "val", getattr(x, "primal", None))
    return False


def differentiated_primal(x: Any) -> Any:
    """The concrete value under a differentiation's tracer (`jax.grad`, `jax.vjp` around
    eager code), or `None` where there is none (a staged or batched value)."""
    while isinstance(x, (_ad_internal.JVPTracer, *_LINEARIZE)):
        x = x.primal
    return None if isinstance(x, _core.Tracer) else x


def ended_differentiation_primal(x: Any) -> Any:
    """The value under `x` when `x` is a tracer of a differentiation that has ended (a
    forward value a hook kept, read in the backward pass), else `None`."""
    if not isinstance(x, (_ad_internal.JVPTracer, *_LINEARIZE)) or not is_dead_tracer(x):
        return None
    while isinstance(x, (_ad_internal.JVPTracer, *_LINEARIZE)) and is_dead_tracer(x):
        x = x.primal
    return x


def registered(number: Any) -> Any:
    """What `_register` registered under `number` (a program's operand)."""
    callback = _callbacks.get(int(np.asarray(number)))
    if callback is None:  # pragma: no cover - a program run 4,096 hook calls later
        raise RuntimeError(
            "jhooks: a host callback of a hook ran after 4,096 later hook calls had "
            "replaced it; run the program sooner after the run that made it."
        )
    return callback


def _dispatch(number: Any, *args: Any, **kwargs: Any) -> Any:
    return registered(number)(*args, **kwargs)


class ProgramTrace:
    """A program's trace that takes more inputs while it runs (`new_input`): the
    constants of the hooks traced at their points, found as the body is traced."""

    def __init__(self) -> None:
        self.trace: Any = None
        self.extra: list = []  # the abstract values of the inputs added

    def new_input(self, aval: Any) -> Any:
        """A new input of the program, of abstract value `aval` (after its inputs)."""
        self.extra.append(aval)
        return self.trace.new_arg(aval, _source_info.current())


def trace_program(
    fn: Callable[..., list], in_avals: list, name: str
) -> tuple[Callable[..., list], list, ProgramTrace]:
    """Traces `fn(program, *leaves) -> list of arrays` to a program: a function of the
    constants the trace closed over (the arrays the function read from outside its
    arguments), the leaves and then of the inputs `fn` added (`program.new_input`), to
    jit; and those constants, to pass as arguments (so that no compiled program
    embeds a copy of a closed-over model's weights)."""
    program = ProgramTrace()

    def flat(*leaves: Any) -> list:
        program.trace = _core.trace_ctx.trace
        return fn(program, *leaves)

    info = _api_util.debug_info(name, fn, tuple(in_avals), {})
    wrapped = _lu.wrap_init(flat, debug_info=info)
    try:
        jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, in_avals)
    except BaseException:
        if program.trace is not None:  # the function raised: what it wrote is taken back
            remember_failed(program.trace)
        program.trace = None
        raise
    remember_program(program.trace, jaxpr, consts)  # for a tracer the trace left behind
    program.trace = None
    closed = _core.ClosedJaxpr(_pe.convert_constvars_jaxpr(jaxpr), ())
    return functools.partial(_core.eval_jaxpr, closed.jaxpr, ()), list(consts), program


def trace_context() -> Any:
    """What JAX keys a jit's traces by besides the abstract values (x64, the default
    device, the mesh...): a program traced by `trace_program` is kept under it."""
    return _config.trace_context()


def partial_evaluating() -> bool:
    """Whether JAX is partially evaluating Python code right here: the current trace is
    the one `pe.trace_to_jaxpr_nounits` records into (not a jit's or a scan's). Flax
    Linen's `nn.scan` traces its body so once, before its `lax.scan`, to check that its
    broadcast variables are constants, and throws that jaxpr away."""
    trace = _core.trace_ctx.trace
    return isinstance(trace, _pe.JaxprTrace) and not isinstance(trace, _pe.DynamicJaxprTrace)

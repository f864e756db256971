"""Every JAX internal that jhooks uses, in one place: this package (the fence).

JAX's public API has no way to define a primitive with a Python transpose rule, to
ask which trace is current, or to leave a library's frames out of tracebacks. What
jhooks needs of those lives here, imported once with the JAX version it was written
against, so that a JAX release that moves one of them breaks this file with a clear
message instead of `import jhooks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

try:  # jax >= 0.4.36 for jax.extend.core.Primitive; ad/batching/mlir are public modules.
    from jax.extend.core import ClosedJaxpr, Literal, Primitive, jaxprs_in_params
    from jax.interpreters import ad, batching, mlir
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"jhooks needs jax.extend.core.Primitive and jax.interpreters.ad/batching/mlir, "
        f"which this JAX ({jax.__version__}) does not have: install jax>=0.10."
    ) from e

try:  # jax 0.10: the trace stack (no public API asks which trace is current).
    from jax._src import core as _core
    from jax._src import traceback_util as _traceback_util
    from jax._src import util as _util
    from jax._src.interpreters import ad as _ad
    from jax._src.interpreters import batching as _batching
    from jax._src.interpreters import partial_eval as _pe
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"jhooks reads JAX's trace stack through jax._src.core, which moved in this JAX "
        f"({jax.__version__}); jhooks supports jax 0.10. Please report it."
    ) from e

__all__ = [
    "ClosedJaxpr",
    "Literal",
    "Primitive",
    "jaxprs_in_params",
    "ad",
    "batching",
    "mlir",
    "is_undefined_primal",
    "zero_like",
    "new_primitive",
    "current_trace",
    "is_staging",
    "parent_of",
    "traced_for",
    "reaches",
    "ShapedArray",
    "at_top_level",
    "hide_frames_of",
    "hold_weakly_in_caches",
    "is_tracer",
    "is_vmapped",
    "trace_path",
    "outside_vmaps",
    "vmapped_between",
    "NeedsConcrete",
    "concrete_only",
]


def is_undefined_primal(x: Any) -> bool:
    """Whether an operand seen by a transpose rule is differentiated (linear)."""
    return ad.is_undefined_primal(x)


def zero_like(undefined_primal: Any) -> Any:
    """The symbolic zero cotangent of a differentiated operand."""
    return ad.Zero(undefined_primal.aval.to_tangent_aval())


def new_primitive(
    name: str,
    impl: Callable[..., Any],
    abstract_eval: Callable[..., Any],
    jvp: Callable[..., Any],
    transpose: Callable[..., Any],
    batch: Callable[..., Any],
) -> Primitive:
    """A primitive with multiple results and the given rules."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = batch
    return prim


def current_trace() -> Any:
    """The trace JAX is recording into now."""
    return _core.trace_ctx.trace


def is_staging(trace: Any) -> bool:
    """Whether `trace` stages a function out to a jaxpr (jit, scan, checkpoint, cond...)."""
    return isinstance(trace, _pe.DynamicJaxprTrace)


def parent_of(trace: Any) -> Any:
    """The trace below `trace` (vmap and grad traces have one), or None."""
    return getattr(trace, "parent_trace", None)


def reaches(base: Any) -> bool:
    """Whether the current trace is `base`, or built on it by transformations that
    trace in place (vmap, grad), with no trace between that stages a function out
    (jit, scan, checkpoint, cond), which JAX may cache and run separately."""
    trace = current_trace()
    while trace is not base:
        if trace is None or is_staging(trace):
            return False
        trace = parent_of(trace)
    return True


def traced_for(trace: Any) -> str | None:
    """What a staging trace traces a function for ("scan", "jit", "while_body"...)."""
    if not is_staging(trace):
        return None
    info = trace.frame.debug_info
    return None if info is None else info.traced_for


ShapedArray = _core.ShapedArray


def under_staging() -> bool:
    """Whether some trace on the stack stages a function out (jit, scan, cond...)."""
    trace = current_trace()
    while trace is not None:
        if is_staging(trace):
            return True
        trace = parent_of(trace)
    return False


def at_top_level() -> bool:
    """Whether no JAX transformation is tracing: code runs eagerly on concrete arrays."""
    return isinstance(current_trace(), _core.EvalTrace)


def hide_frames_of(path: str) -> None:
    """Leaves the frames of files under `path` out of the tracebacks JAX filters."""
    _traceback_util.register_exclusion(path)


def hold_weakly_in_caches(cls: type) -> None:
    """Makes JAX's caches keyed on primitive parameters hold instances of `cls` weakly.

    JAX caches abstract evaluation by primitive parameters (jax 0.10:
    `partial_eval._cached_abstract_eval`); without this, every backward rule made by
    an eager gradient would stay alive in that cache until it evicts it.
    """
    _util.weakref_cache_key_types.add(cls)


# --------------------------------------------------------------------------- jaxprs
# What the jaxpr interpreters (`_staging`, `_per_example`) need to walk a jaxpr: one bind
# step, and which equations are calls (a body run once, inline) by asking JAX for its
# primitives rather than matching their names (jax 0.10 names checkpoint `remat2`).

try:  # jax 0.10
    from jax._src import ad_checkpoint as _ad_checkpoint
    from jax._src import custom_derivatives as _custom
    from jax._src import pjit as _pjit
    from jax._src import shard_map as _shard_map
    from jax._src.lax import control_flow as _control_flow
    from jax.extend.core import Jaxpr
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"jhooks walks jaxprs with jax.extend.core and jax._src's primitives, which moved in "
        f"this JAX ({jax.__version__}); jhooks supports jax 0.10. Please report it."
    ) from e

SCAN = _control_flow.scan_p
REMAT = _ad_checkpoint.remat_p
JIT = _pjit.jit_p
# Primitives holding one jaxpr that are NOT calls: their body runs many times, or with
# a rule of its own for derivatives, or per shard.
_NOT_CALLS = frozenset(
    {
        _control_flow.scan_p,
        _control_flow.while_p,
        _control_flow.cond_p,
        _control_flow.linear_solve_p,
        _custom.custom_jvp_call_p,
        _custom.custom_vjp_call_p,
        _custom.linear_call_p,
        _shard_map.shard_map_p,
    }
)


def is_literal(v: Any) -> bool:
    """Whether a jaxpr operand is a literal (its value is `v.val`)."""
    return isinstance(v, Literal)


def inner_jaxprs(eqn: Any) -> list[Any]:
    """The open jaxprs an equation's parameters hold (a call's body, a scan's...)."""
    return [j.jaxpr if isinstance(j, ClosedJaxpr) else j for j in jaxprs_in_params(eqn.params)]


def call_body(eqn: Any) -> tuple[Any, list[Any]] | None:
    """`(jaxpr, consts)` of an equation that calls one jaxpr once on its operands (jit,
    `closed_call`, any version's checkpoint...), or `None` for any other equation."""
    if eqn.primitive in _NOT_CALLS:
        return None
    # The parameters' jaxprs, closed ones whole: `jaxprs_in_params` opens them, which
    # drops their constants (a nested `jit` closing over an array).
    found = [
        v
        for value in eqn.params.values()
        for v in (value if isinstance(value, tuple) else (value,))
        if isinstance(v, Jaxpr | ClosedJaxpr)
    ]
    if len(found) != 1:
        return None
    (sub,) = found
    jaxpr, consts = (sub.jaxpr, list(sub.consts)) if isinstance(sub, ClosedJaxpr) else (sub, [])
    if not isinstance(jaxpr, Jaxpr):
        return None
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr, consts


def remat_like(eqn: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` wrapped as `eqn` wraps its body: `jax.checkpoint` with its policy for a
    checkpoint equation, `fn` itself for any other call."""
    if eqn.primitive is not REMAT:
        return fn
    p = eqn.params
    return jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])


def bind_equation(eqn: Any, invals: list[Any]) -> list[Any]:
    """Runs one equation on `invals` as `jax.core.eval_jaxpr` does; returns its outputs."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: list[Any] = []
    if isinstance(params, tuple):  # JAX versions that return (subfuns, params)
        subfuns, params = params
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def differentiates(trace: Any) -> bool:
    """Whether `trace` is the forward pass of a differentiation (`jax.jvp`, `jax.grad`'s
    linearisation): code under it runs forward, and its backward pass comes later."""
    return isinstance(trace, (_ad.JVPTrace, _ad.LinearizeTrace))


def path_to(base: Any) -> list[Any] | None:
    """The traces from the current one down to `base` (excluded), or None if `base` is
    not below the current trace."""
    trace, path = current_trace(), []
    while trace is not base:
        if trace is None:
            return None
        path.append(trace)
        trace = parent_of(trace)
    return path


# Where a value is reached in a trace, and the vmaps around it (for `_runs/_points.py`).


def _equations_so_far(trace: Any) -> int:
    """How many equations the staging trace at or below `trace` holds so far."""
    while trace is not None and not is_staging(trace):
        trace = parent_of(trace)
    return -1 if trace is None else len(trace.frame.tracing_eqns)


def trace_path(base: Any) -> tuple[tuple[Any, int, str | None], ...] | None:
    """The traces from `base` (excluded) up to the current one, outermost first, each as
    `(trace, equations its parent held when it was reached, what it was traced for)`;
    `None` when `base` is not below the current trace.

    Two traces with one parent, one count and one kind ("cond") are the branches of
    one `lax.cond` (or two traces of one loop body): nothing was added between them."""
    path = path_to(base)
    if path is None:
        return None
    return tuple((t, _equations_so_far(parent_of(t)), traced_for(t)) for t in reversed(path))


def outside_vmaps(base: Any, fn: Callable[[Any], Any], tree: Any) -> Any:
    """`fn(tree)` run outside the `jax.vmap`s between `base` and the current trace.

    Each leaf batched by one of those vmaps reaches `fn` with its batch axis first (the
    outermost vmap's first); the leaves of `fn`'s output (same structure, same
    shapes) are batched back along that axis. Only the vmaps traced directly around
    the current code are peeled (a jit or scan between leaves the rest in place)."""
    trace = current_trace()
    if trace is base or not isinstance(trace, _batching.BatchTrace):
        return fn(tree)
    leaves, treedef = jax.tree.flatten(tree)
    infos = [trace.to_batch_info(leaf) for leaf in leaves]
    with _core.set_current_trace(trace.parent_trace):
        vals = [v if d is None else jax.numpy.moveaxis(v, d, 0) for v, d in infos]
        out = outside_vmaps(base, fn, jax.tree.unflatten(treedef, vals))
    out_leaves = jax.tree.leaves(out)
    if len(out_leaves) != len(infos):  # pragma: no cover - `fn` checks its output
        raise ValueError("a hook outside the vmap returned another structure.")
    batched = [
        v if d is None else _batching.BatchTracer(trace, v, 0)
        for v, (_, d) in zip(out_leaves, infos)
    ]
    return jax.tree.unflatten(treedef, batched)


def out_of_vmaps(base: Any, leaves: list[Any]) -> list[Any] | None:
    """`leaves`, values of the current trace, as values of `base`, each with the batch
    axes of the `jax.vmap`s between first (one left unbatched stays as it is); `None`
    unless only vmaps lie between."""
    trace = current_trace()
    if trace is base:
        return leaves
    if not isinstance(trace, _batching.BatchTrace):
        return None
    infos = [trace.to_batch_info(leaf) for leaf in leaves]
    with _core.set_current_trace(trace.parent_trace):
        vals = [v if d is None else jax.numpy.moveaxis(v, d, 0) for v, d in infos]
        return out_of_vmaps(base, vals)


def vmapped_between(base: Any) -> bool:
    """Whether a `jax.vmap` lies between `base` and the current trace."""
    return any(isinstance(t, _batching.BatchTrace) for t in path_to(base) or ())


# Where an equation was made, for operation addresses: `_equations.py` beside this file.
from ._anchors import body_argument as body_argument  # noqa: E402
from ._batch_axes import BATCH_AXES_FILE as BATCH_AXES_FILE  # noqa: E402
from ._batch_axes import UNKNOWN as UNKNOWN_AXIS  # noqa: E402, F401
from ._batch_axes import BatchAxes as BatchAxes  # noqa: E402
from ._batch_axes import recording_batch_axes as recording_batch_axes  # noqa: E402
from ._equations import COND as COND  # noqa: E402
from ._equations import CUSTOM_CALLS as CUSTOM_CALLS  # noqa: E402
from ._equations import VMAP_SCOPE as VMAP_SCOPE  # noqa: E402
from ._equations import WHILE as WHILE  # noqa: E402
from ._equations import custom_function_name as custom_function_name  # noqa: E402
from ._equations import equation_frames as equation_frames  # noqa: E402
from ._equations import equation_scopes as equation_scopes  # noqa: E402
from ._equations import with_source_of as with_source_of  # noqa: E402
from ._host_call import as_arrays as as_arrays  # noqa: E402
from ._host_call import host_avals as host_avals  # noqa: E402
from ._host_call import host_call as host_call  # noqa: E402
from ._leaks import concrete_value as concrete_value  # noqa: E402
from ._leaks import held_in as held_in  # noqa: E402
from ._leaks import of_ended_program as of_ended_program  # noqa: E402
from ._numbers import NeedsConcrete as NeedsConcrete  # noqa: E402
from ._numbers import concrete_only as concrete_only  # noqa: E402
from ._tracing import Traced as Traced  # noqa: E402
from ._tracing import _register as register_callback  # noqa: E402, F401
from ._tracing import differentiated_primal as differentiated_primal  # noqa: E402
from ._tracing import ended_differentiation_primal as ended_differentiation_primal  # noqa: E402
from ._tracing import eval_traced as eval_traced  # noqa: E402
from ._tracing import get_aval as get_aval  # noqa: E402
from ._tracing import is_array_like as is_array_like  # noqa: E402
from ._tracing import is_batched as is_batched  # noqa: E402
from ._tracing import is_dead_tracer as is_dead_tracer  # noqa: E402
from ._tracing import is_differentiated as is_differentiated  # noqa: E402
from ._tracing import is_tracer as is_tracer  # noqa: E402
from ._tracing import is_vmapped as is_vmapped  # noqa: E402
from ._tracing import partial_evaluating as partial_evaluating  # noqa: E402
from ._tracing import registered as registered  # noqa: E402
from ._tracing import trace_context as trace_context  # noqa: E402
from ._tracing import trace_hook as trace_hook  # noqa: E402
from ._tracing import trace_program as trace_program  # noqa: E402
from ._tracing import unregister as unregister  # noqa: E402

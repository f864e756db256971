"""A host call: Python that a compiled program calls with the values it reached.

It is JAX's `io_callback` lowering (a custom call XLA keeps, as it has a side effect),
with two differences (issue 42), each a cost of a hook on values:

- no JAX effect: a program with an effect is dispatched by jit's Python path, about
  90 µs a call more than its C++ one. What the effect gave, the caller keeps otherwise:
  JAX does not remove the call where its outputs are unused only in a program jitted
  with `keep_unused=True` (jhooks' runs: `_runs/_program.py`), and the calls keep their
  order by data (`_runs/_host_order.py` makes each wait for the one before it);
- no `jax.device_put` per operand (60-130 µs of Python a call): the operands reach the
  callback as NumPy arrays, the callback asks for the ones it hands to Python code as
  `jax.Array`s (`as_arrays`, one call into XLA's client each, as `jax.device_put` makes
  in the end), and a number (which hook) is read as a number.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

try:  # jax 0.10: io_callback's effect and lowering helpers, the client's device_put.
    from jax._src import callback as _callback
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src.interpreters import ad as _ad
    from jax._src.interpreters import batching as _batching
    from jax._src.interpreters import mlir as _mlir
    from jax._src.interpreters import pxla as _pxla

    _emit = _callback.emit_python_callback
    _op_sharding = _callback._callback_op_sharding
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"jhooks calls hooks on values through io_callback's internals, which moved in this "
        f"JAX ({jax.__version__}); jhooks supports jax 0.10. Please report it."
    ) from e

host_call_p = _core.Primitive("jhooks_host_call")
host_call_p.multiple_results = True
host_call_p.def_impl(functools.partial(_dispatch.apply_primitive, host_call_p))


@host_call_p.def_abstract_eval
def _abstract_eval(*avals: Any, callback: Callable, result_avals: tuple) -> tuple:
    del avals, callback
    return result_avals


def _refuse(*args: Any, **params: Any) -> Any:
    raise ValueError("a jhooks host call is differentiated through its custom_jvp only")


_ad.primitive_jvps[host_call_p] = _refuse
_ad.primitive_transposes[host_call_p] = _refuse


def _batch(args: Sequence, dims: Sequence, *, callback: Callable, result_avals: tuple) -> Any:
    # As io_callback's rule: one call per example, in a loop.
    batched = [d is not None for d in dims]
    args = [a if d is None else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    fixed = [a for a, b in zip(args, batched) if not b]
    mapped = [a for a, b in zip(args, batched) if b]

    def one(mapped: list) -> Any:
        it_fixed, it_mapped = iter(fixed), iter(mapped)
        merged = [next(it_mapped) if b else next(it_fixed) for b in batched]
        return host_call_p.bind(*merged, callback=callback, result_avals=result_avals)

    outs = jax.lax.map(one, mapped)
    return outs, (0,) * len(outs)


_batching.primitive_batchers[host_call_p] = _batch


def _lower(ctx: Any, *args: Any, callback: Callable, result_avals: tuple) -> Any:
    del result_avals
    sharding = _op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)

    def call(*operands: np.ndarray) -> tuple:
        with jax.default_device(_cpu()):
            return tuple(callback(*operands))

    result, _, _ = _emit(
        ctx,
        call,
        None,
        list(args),
        ctx.avals_in,
        ctx.avals_out,
        has_side_effect=True,
        returns_token=False,
        sharding=sharding,
    )
    return result


_mlir.register_lowering(host_call_p, _lower, cacheable=False)


def host_call(callback: Callable, operands: list, shapes: list) -> list:
    """`callback(*operands)` when the program reaches it, with NumPy arrays, returning
    arrays of `shapes` (`jax.ShapeDtypeStruct`s)."""
    result_avals = tuple(_core.ShapedArray(s.shape, s.dtype) for s in shapes)
    return host_call_p.bind(*operands, callback=callback, result_avals=result_avals)


@functools.cache
def _cpu() -> Any:
    return jax.local_devices(backend="cpu")[0]


@functools.cache
def _cpu_sharding() -> Any:
    return jax.sharding.SingleDeviceSharding(_cpu())


def host_avals(values: Sequence[Any]) -> list:
    """The abstract values of the arrays `as_arrays` makes of NumPy arrays like `values`
    (arrays or abstract values): their shapes and dtypes, never weakly typed."""
    return [_core.ShapedArray(v.shape, v.dtype) for v in values]


def as_arrays(values: Sequence[np.ndarray], avals: Sequence[Any] | None = None) -> list:
    """`jax.Array`s of `values` on the host's CPU (what `jax.device_put` gives);
    `avals`: `host_avals(values)`, where the caller has them."""
    device, sharding = _cpu(), _cpu_sharding()
    if avals is None:
        avals = host_avals(values)
    return [_pxla.batched_device_put(a, sharding, [v], [device]) for v, a in zip(values, avals)]

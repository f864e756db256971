"""The primitives a staged run finds in its jaxpr: cached points and loop indices.

`point_p` marks the value of a point (of a run, by its tag); `loop_index_p` stands for
the indices of the loops around a call to `jhooks.loop_index()`. Both are read and
replaced by `_harvest.Harvester`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._core import Primitive, ShapedArray, ad, batching, mlir

# A cached point: an identity on the leaves of its value, named.
point_p = Primitive("jhooks_point")
point_p.multiple_results = True


@point_p.def_impl
def _point_impl(*leaves, **params):
    return list(leaves)


@point_p.def_abstract_eval
def _point_abstract(*avals, **params):
    return list(avals)


mlir.register_lowering(point_p, lambda ctx, *values, **params: [[v] for v in values])


def _point_jvp(primals, tangents, **params):
    return point_p.bind(*primals, **params), list(tangents)


ad.primitive_jvps[point_p] = _point_jvp


def _point_batch(leaves, dims, **params):
    # A point under a vmap inside the run's function is stacked along the batch axis.
    size = next(x.shape[d] for x, d in zip(leaves, dims) if d is not None)
    front = [
        jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(leaves, dims)
    ]
    return point_p.bind(*front, **params), [0] * len(front)


batching.primitive_batchers[point_p] = _point_batch


def bind_point(value: Any, name: str, tag: int) -> Any:
    """Marks `value` as point `name` of the run with tag `tag` (its place in the run stack)."""
    leaves, treedef = jax.tree.flatten(value)
    if not leaves:
        return value
    leaves = [jnp.asarray(x) for x in leaves]
    floating = all(jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves)
    out = point_p.bind(*leaves, name=name, tag=tag, treedef=treedef, floating=floating)
    return jax.tree.unflatten(treedef, out)


# The indices of the loops around a call to `jhooks.loop_index()`, outermost first.
loop_index_p = Primitive("jhooks_loop_index")
loop_index_p.multiple_results = True


@loop_index_p.def_abstract_eval
def _loop_index_abstract(*, depth):
    return [ShapedArray((), jnp.int32)] * depth


def _loop_index_missing(*args, **params):
    raise ValueError(
        "jhooks.loop_index() was evaluated outside the run that traced it (a function "
        "jitted inside a run and called again outside one?). Call it within "
        "jhooks.run_with_hooks or jhooks.run_with_cache."
    )


loop_index_p.def_impl(_loop_index_missing)
mlir.register_lowering(loop_index_p, _loop_index_missing)

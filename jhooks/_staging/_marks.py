"""The primitives a staged run finds in its jaxpr: cached points and loop indices.

`point_p` marks the value of a point (of a run, by its tag); `loop_index_p` stands for
the indices of the loops around a call to `jhooks.loop_index()`. Both are read and
replaced by `_harvest.Harvester`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
    # A leaf that is the same for every example (the state of a stateful layer under
    # `vmap(..., out_axes=(0, None))`) stays one value: not copied per example, and
    # still unmapped for the vmap's `out_axes=None`.
    front = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(leaves, dims)]
    dims_out = [None if d is None else 0 for d in dims]
    return point_p.bind(*front, **params), dims_out


batching.primitive_batchers[point_p] = _point_batch


class PointLayout:
    """The structure of a point's value, with the leaves that are not arrays (a Python
    int or str in a module's output), kept as they are: the point marks the arrays only.
    `jax.tree.unflatten(layout, arrays)` rebuilds the value, as with a treedef."""

    def __init__(self, treedef: Any, static: tuple[Any, ...]):
        self.treedef = treedef
        self.static = static  # per leaf: None for an array, `(value,)` otherwise

    def unflatten(self, arrays: Any) -> Any:
        it = iter(arrays)
        return jax.tree.unflatten(
            self.treedef, [next(it) if s is None else s[0] for s in self.static]
        )

    def without_static(self) -> PointLayout:
        """The layout of the point's gradient: `None` where the value is not an array."""
        return PointLayout(self.treedef, tuple(None if s is None else (None,) for s in self.static))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PointLayout) or self.treedef != other.treedef:
            return False
        try:
            return bool(self.static == other.static)
        except Exception:  # values that do not compare: the same objects only
            return all(a is b for a, b in zip(self.static, other.static))

    def __hash__(self) -> int:
        return hash(self.treedef)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def bind_point(value: Any, name: str, tag: int) -> Any:
    """Marks `value` as point `name` of the run with tag `tag` (its place in the run stack)."""
    leaves, treedef = jax.tree.flatten(value)
    arrays = [jnp.asarray(x) for x in leaves if _is_array(x)]
    if not arrays:
        return value
    static = tuple(None if _is_array(x) else (x,) for x in leaves)
    layout = PointLayout(treedef, static)
    floating = all(jnp.issubdtype(x.dtype, jnp.inexact) for x in arrays)
    out = point_p.bind(*arrays, name=name, tag=tag, treedef=layout, floating=floating)
    return layout.unflatten(out)


# The indices of the loops around a call to `jhooks.loop_index()`, outermost first. Its
# operands (anchors: an argument of each loop body around it, see `_core.body_argument`)
# are not read: they keep JAX's partial evaluation (`jax.grad` of a scan) from hoisting
# the equation out of its loop as loop-invariant.
loop_index_p = Primitive("jhooks_loop_index")
loop_index_p.multiple_results = True


@loop_index_p.def_abstract_eval
def _loop_index_abstract(*anchors, depth):
    return [ShapedArray((), jnp.int32)] * depth


def _loop_index_jvp(primals, tangents, *, depth):
    out = loop_index_p.bind(*primals, depth=depth)
    return out, [ad.Zero(ShapedArray((), jax.dtypes.float0))] * depth


ad.primitive_jvps[loop_index_p] = _loop_index_jvp


def _loop_index_batch(anchors, dims, *, depth):
    # The same iteration for every example: anchors taken out of the batch, index unmapped.
    front = [a if d is None else jnp.take(a, 0, axis=d) for a, d in zip(anchors, dims)]
    return loop_index_p.bind(*front, depth=depth), [None] * depth


batching.primitive_batchers[loop_index_p] = _loop_index_batch


def _loop_index_missing(*args, **params):
    raise ValueError(
        "jhooks.loop_index() was evaluated outside the run that traced it (a function "
        "jitted inside a run and called again outside one?). Call it within "
        "jhooks.run_with_hooks or jhooks.run_with_cache."
    )


loop_index_p.def_impl(_loop_index_missing)
mlir.register_lowering(loop_index_p, _loop_index_missing)

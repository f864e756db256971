"""Nodes inside loops (a `lax.scan` over layers): what attribution refuses there, by name.

A run's cache stacks a point inside loops along them (one axis per loop, outermost
first) and its hooks see one iteration. AtP, AtP*'s scores points and integrated
gradients with `interpolate` score such a node from the two runs' caches and gradients,
so its scores carry the loop axes, one row per layer. Patching the node alone (layer
integrated gradients, AtP*'s queries and keys) or dropping the gradient at one of its
layers (GradDrop) would take one run per layer with a hook that reads
[`jhooks.loop_index`][]; a run differentiated inside attribution's program (itself a
run) refuses such a hook, so these are refused here first, naming the node and what
to do instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._runs import Selector, run_with_cache, run_with_hooks

UNROLL = "write the layers unrolled (a Python loop over them, one point per layer)"


def patched_whole(stacked: Any, value: Any, node: str, refusal: str) -> Any:
    """`stacked` (a node's value from a cache), to patch in for `value` (what its hook
    sees), or a `ValueError` naming the node where the cache stacked it along a loop.

    **Arguments:**

    - `stacked`, `value`: the value to patch in, and the hook's value.
    - `node`: the node's name.
    - `refusal`: the start of the message: what is refused and what to do instead is
        said after the shapes.
    """
    have = [jnp.shape(a) for a in jax.tree.leaves(stacked)]
    want = [jnp.shape(a) for a in jax.tree.leaves(value)]
    if have != want:
        raise ValueError(
            f"{refusal}: {node!r} is reached inside a loop (a lax.scan "
            f"over layers): its cache stacks it along the loop, {_shapes(have)}, and one "
            f"iteration is {_shapes(want)}. {_REMEDIES[refusal]}"
        )
    return stacked


IG = (
    "attribution(method='ig') without interpolate= patches each node alone, moving it "
    "along its path"
)
QK = "attribution(method='atp*') patches each node of queries= and keys= in a run of its own"
_REMEDIES = {
    IG: "Patching it alone would be one layer at a time, which attribution does not do "
    "inside a loop: pass interpolate= (a point before the loop, the embedding: every "
    "node's gradient integrated along one path, its scores per layer), use "
    f"method='atp', or {UNROLL}.",
    QK: "Patching it in one run would patch every layer at once, which is not AtP*'s "
    f"exact score: {UNROLL}, or score it with method='atp'.",
}


def _shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join(str(s) for s in shapes) if len(shapes) != 1 else str(shapes[0])


def loop_shapes(
    fn: Callable, x: Any, names: Sequence[str] | Callable[[str], bool]
) -> dict[str, tuple[int, ...]]:
    """The loops each point selected by `names` is stacked along in a cache of `fn(x)`.

    **Arguments:**

    - `fn`, `x`: the function and its input (traced abstractly: nothing is computed).
    - `names`: names or patterns (or a predicate), as `run_with_cache`'s `names_filter`
        takes them.

    **Returns:**

    A dict from each point's name (in the order reached) to the lengths of its loops,
    outermost first: `()` for a point outside any loop, `(layers,)` in a scan over layers.
    A point holding no array has `()`.
    """
    seen: dict[str, int] = {}

    def record(value: Any, name: str) -> None:
        arrays = [a for a in jax.tree.leaves(value) if isinstance(a, jax.Array)]
        if arrays:
            seen[str(name)] = jnp.ndim(arrays[0])

    hooks = [(names, record)] if callable(names) else [(n, record) for n in names]

    def run(x: Any) -> Any:
        return run_with_hooks(fn, x, fwd_hooks=hooks)

    def cached(x: Any) -> dict:
        select = names if callable(names) else list(names)
        return run_with_cache(run, x, names_filter=select, return_output=False)[1]

    shapes = {}
    for name, value in jax.eval_shape(cached, x).items():
        arrays = [a for a in jax.tree.leaves(value) if hasattr(a, "shape")]
        stacked = tuple(arrays[0].shape) if arrays and name in seen else ()
        shapes[name] = stacked[: len(stacked) - seen.get(name, 0)]
    return shapes


def refuse_looped_drops(fn: Callable, x: Any, graddrop: Sequence[str]) -> None:
    """Raises a `ValueError` naming the first point of `graddrop` inside a loop."""
    loops = loop_shapes(fn, x, graddrop)
    for layer in graddrop:
        selector = Selector(layer, "graddrop")
        for name, shape in loops.items():
            if shape and selector(name):
                raise ValueError(
                    f"attribution(graddrop=): point {name!r} (selected by {layer!r}) is "
                    f"reached inside a loop (a lax.scan over layers, stacked {shape} in a "
                    "cache): dropping the gradient there drops it in every layer at once, "
                    "not one layer in turn as GradDrop does. Name one point per layer: "
                    f"{UNROLL}."
                )


def refuse_looped_edges(fn: Callable, x: Any, select: Any, writers: Any, readers: Any) -> None:
    """Raises a `ValueError` naming the first writer or reader inside a loop."""
    for name, shape in loop_shapes(fn, x, select).items():
        role = "writer" if writers(name) else "reader" if readers(name) else None
        if shape and role:
            raise ValueError(
                f"attribution(edges=True): {role} {name!r} is reached inside a loop (a "
                f"lax.scan over layers, stacked {shape} in a cache): one point for every "
                "layer cannot tell the edges of one layer from another's (nor which comes "
                f"first). Edges need one point per layer: {UNROLL}."
            )

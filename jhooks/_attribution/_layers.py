"""Nodes inside loops (a `lax.scan` over layers): one layer at a time, and what is refused.

A run's cache stacks a point inside loops along them (one axis per loop, outermost
first) and its hooks see one iteration. AtP, AtP*'s scores points and integrated
gradients with `interpolate` score such a node from the two runs' caches and gradients,
so its scores carry the loop axes, one row per layer. Layer integrated gradients patch
one layer of the node at a time, and GradDrop drops the gradient through one layer at a
time: one run per iteration, with a forward hook that reads [`jhooks.loop_index`][] and
acts in that iteration only (`patched_row`, `dropped_row`). AtP*'s queries and keys
(patching every layer in one run is not AtP*'s score) and edges are refused here, by
name, with what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runs import Selector, loop_index, run_with_cache, run_with_hooks

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


QK = "attribution(method='atp*') patches each node of queries= and keys= in a run of its own"
_REMEDIES = {
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


def rows(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The iterations of loops of lengths `shape`, outermost first: one row per layer."""
    return [tuple(int(i) for i in row) for row in np.ndindex(*shape)]


def in_row(row: tuple[int, ...]) -> jax.Array:
    """In a forward hook: whether the innermost `len(row)` loops around it (the model's
    loops over layers, inside any loop of attribution's own) are at iteration `row`."""
    index = loop_index()[-len(row) :]
    hit = jnp.array(True)
    for i, r in zip(index, row):
        hit = hit & (i == r)
    return hit


def patched_row(stacked: Any, value: Any, row: tuple[int, ...]) -> Any:
    """In a forward hook: `stacked[row]` (a node's value from a cache) in iteration `row`,
    the hook's `value` in every other."""
    hit = in_row(row)
    return jax.tree.map(lambda s, v: jnp.where(hit, s[row], v), stacked, value)


def dropped_row(row: tuple[int, ...]) -> Callable[[Any, str], Any]:
    """A forward hook that stops the gradient through its point in iteration `row`."""

    def drop(value: Any, name: str) -> Any:
        hit = in_row(row)
        return jax.tree.map(lambda v: jnp.where(hit, jax.lax.stop_gradient(v), v), value)

    return drop


class Drop:
    """One GradDrop layer: a point whose gradient is dropped (a backward hook zeroes it),
    or one iteration `row` of points inside loops (a forward hook stops the gradient
    through them there, and their own gradients' row `row` is zeroed, as the backward
    hook zeroes a point's gradient)."""

    def __init__(self, layer: str, row: tuple[int, ...] | None = None):
        self.layer, self.row = layer, row

    def hooks(self, zero: Callable) -> tuple[list, list]:
        """`(fwd_hooks, bwd_hooks)` for the run."""
        if self.row is None:
            return [], [(self.layer, zero)]
        return [(self.layer, dropped_row(self.row))], []

    def gradient(self, name: str, grad: Any) -> Any:
        """The gradient of node `name`, with its row zeroed where this drop selects it."""
        if self.row is None or not Selector(self.layer, "graddrop")(name):
            return grad
        row = self.row
        return jax.tree.map(lambda g: g.at[row].set(0), grad)


def layer_drops(fn: Callable, x: Any, graddrop: Sequence[str]) -> list[Drop]:
    """The layers GradDrop drops in turn: an entry of `graddrop` outside any loop is one;
    an entry whose points are inside loops is one per iteration (a `lax.scan` over `L`
    layers: `L`). An entry selecting points with different loops raises a `ValueError`."""
    loops = loop_shapes(fn, x, graddrop)
    drops = []
    for layer in graddrop:
        selector = Selector(layer, "graddrop")
        shapes = {name: shape for name, shape in loops.items() if selector(name)}
        if not any(shapes.values()):
            drops.append(Drop(layer))
            continue
        if len(set(shapes.values())) > 1:
            found = ", ".join(f"{n!r} {s}" for n, s in shapes.items())
            raise ValueError(
                f"attribution(graddrop=): {layer!r} selects points inside different loops "
                f"({found}: the lengths of the loops around each), so its layers are not "
                "one per iteration. Name the points of one loop in an entry of their own."
            )
        (shape,) = set(shapes.values())
        drops += [Drop(layer, row) for row in rows(shape)]
    return drops


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

"""Node attribution: AtP, AtP* (the attention softmax recomputed, GradDrop) and
integrated gradients, each a function of one example, traced in `attribution`'s program.

A node is any name a run selects. Its score is `(clean - corrupt) * gradient`, summed
over `sum_axes` (the feature axis by default), leaf by leaf for a pytree value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._runs import Selector
from ._caches import activations, difference, interpolated, names_filter, with_gradients
from ._layers import Drop, layer_drops, loop_shapes, patched_row, rows
from ._paths import integrate
from ._plan import Plan
from ._qk import query_key_scores, softmax_exact


def scored(delta: Any) -> bool:
    """Whether a node has a score: a floating-point leaf (token ids have none)."""
    return bool(jax.tree.leaves(delta))


def contract(delta: Any, grad: Any, sum_axes: tuple[int, ...] | None) -> Any:
    """`delta * grad` summed over `sum_axes` (every axis for `None`), leaf by leaf
    (`None` for a leaf that is not floating-point); exactly 0 where `delta` is (an
    entry masked with `-inf` in both runs, whose gradient may be NaN)."""

    def one(d: Any, g: Any) -> Any:
        if d is None or g is None:
            return None
        return summed(jnp.where(d == 0, jnp.zeros_like(d), d * g), sum_axes)

    return jax.tree.map(one, delta, grad, is_leaf=lambda x: x is None)


def summed(x: jax.Array, sum_axes: tuple[int, ...] | None) -> jax.Array:
    """`x` summed over `sum_axes` (every axis for `None`; negative axes count from the end)."""
    if sum_axes is None:
        return jnp.sum(x)
    return jnp.sum(x, axis=tuple(sorted({a % x.ndim for a in sum_axes})) if x.ndim else ())


def node_scores(plan: Plan, objective: Callable, fn: Callable, clean: Any, corrupt: Any) -> dict:
    """The scores of `plan.nodes` for one example (see `jhooks.attribution`)."""
    if plan.method == "ig":
        return _integrated(plan, objective, fn, clean, corrupt)
    if not plan.graddrop:
        return _atp(plan, objective, fn, clean, corrupt, None)
    # GradDrop (Kramar et al. 2024): AtP with the gradient through each layer dropped in
    # turn, |.| summed over the layers and divided by (layers - 1). A point inside a scan
    # over layers is one layer per iteration (`_layers.layer_drops`).
    drops = layer_drops(fn, corrupt, plan.graddrop)
    total: dict = {}
    for drop in drops:
        scores = _atp(plan, objective, fn, clean, corrupt, drop)
        for name, s in scores.items():
            s = jax.tree.map(jnp.abs, s)
            total[name] = s if name not in total else jax.tree.map(jnp.add, total[name], s)
    n = len(drops) - 1
    return {name: jax.tree.map(lambda s: s / n, s) for name, s in total.items()}


def _zero(grad: Any, name: str) -> Any:
    return jax.tree.map(jnp.zeros_like, grad)


def _selected(plan: Plan, cache: dict) -> list[str]:
    selector = Selector(plan.nodes, "nodes")
    return [name for name in cache if selector(name)]


def _atp(
    plan: Plan, objective: Callable, fn: Callable, clean: Any, corrupt: Any, drop: Drop | None
) -> dict:
    pairs = [*plan.softmax, *plan.queries, *plan.keys] if plan.exact_qk else []
    select = names_filter(plan.nodes, [name for pair in pairs for name in pair])
    clean_values = activations(fn, clean, select)
    fwd_hooks, bwd_hooks = drop.hooks(_zero) if drop is not None else ([], [])
    _, values, grads = with_gradients(objective, corrupt, select, fwd_hooks, bwd_hooks)
    if drop is not None:
        grads = {n: drop.gradient(n, g) for n, g in grads.items()}
    scores = {}
    for name in _selected(plan, values):
        delta = difference(clean_values[name], values[name], name)
        if scored(delta):
            scores[name] = contract(delta, grads[name], plan.sum_axes)
    if plan.exact_qk:
        pattern = dict(plan.softmax)
        for s in pattern:
            if s in scores:
                exact = softmax_exact(clean_values[s], values[s], grads[pattern[s]])
                scores[s] = summed(exact, plan.sum_axes)
        scores.update(query_key_scores(plan, fn, corrupt, clean_values, values, grads, scores))
    return scores


def _integrated(plan: Plan, objective: Callable, fn: Callable, clean: Any, corrupt: Any) -> dict:
    """Integrated gradients from the corrupted to the clean value.

    Without `plan.interpolate`, each node's own value moves along the path while the
    rest of the corrupted run follows (layer integrated gradients: the scores of a node
    sum to the effect of patching it, up to the quadrature). With it, that one point
    moves and every node's gradient is integrated along the same runs (EAP-IG's inputs).
    """
    extra = [plan.interpolate] if plan.interpolate else []
    select = names_filter(plan.nodes, extra)
    clean_values = activations(fn, clean, select)
    values = activations(fn, corrupt, select)
    names = _selected(plan, values)
    if plan.interpolate:
        grads = along_path(plan, objective, corrupt, select, clean_values, values, names)
        deltas = {n: difference(clean_values[n], values[n], n) for n in names}
        return {n: contract(deltas[n], grads[n], plan.sum_axes) for n in names if scored(deltas[n])}
    loops = loop_shapes(fn, corrupt, names) if names else {}
    scores = {}
    for n in names:
        delta = difference(clean_values[n], values[n], n)
        if scored(delta):
            grad = _layer_path(plan, objective, corrupt, n, values[n], delta, loops.get(n, ()))
            scores[n] = contract(delta, grad, plan.sum_axes)
    return scores


def _layer_path(
    plan: Plan,
    objective: Callable,
    corrupt: Any,
    n: str,
    value: Any,
    delta: Any,
    shape: tuple[int, ...],
) -> Any:
    """Node `n`'s gradient integrated while it moves from its corrupted value `value` by
    `delta`; inside loops of lengths `shape` (a scan over layers), one iteration at a
    time, the others following the corrupted run, stacked as the cache stacks it."""

    def row_path(row: tuple[int, ...] | None) -> Any:
        def grad_at(alpha: jax.Array) -> Any:
            def patch(live: Any, name: str) -> Any:
                moved = interpolated(value, delta, alpha)
                return moved if row is None else patched_row(moved, live, row)

            grad = with_gradients(objective, corrupt, [n], fwd_hooks=[(n, patch)])[2][n]
            return grad if row is None else jax.tree.map(lambda g: g[row], grad)

        return integrate(grad_at, plan.steps, plan.rule, plan.batch_size)

    if not shape:
        return row_path(None)
    per_row = [row_path(row) for row in rows(shape)]
    return jax.tree.map(lambda *r: jnp.stack(r).reshape(*shape, *r[0].shape), *per_row)


def along_path(
    plan: Plan,
    objective: Callable,
    corrupt: Any,
    select: Any,
    clean_values: dict,
    values: dict,
    names: list[str],
) -> dict:
    """The gradients at `names`, integrated while `plan.interpolate` moves from its
    corrupted to its clean value (the rest of the run is the corrupted one)."""
    point = plan.interpolate
    assert point is not None
    delta = difference(clean_values[point], values[point], point)

    def grad_at(alpha: jax.Array) -> dict:
        def patch(value: Any, name: str) -> Any:
            return interpolated(values[point], delta, alpha)

        grads = with_gradients(objective, corrupt, select, fwd_hooks=[(point, patch)])[2]
        return {n: grads[n] for n in names}

    return integrate(grad_at, plan.steps, plan.rule, plan.batch_size)

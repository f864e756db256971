"""The runs attribution is made of: activations, and activations with gradients.

Everything here is a [`jhooks.run_with_cache`][] (around a [`jhooks.run_with_hooks`][]
when a point is patched or a gradient dropped), traced inline in the one program of
`jhooks.attribution`, so any name a run can select is a node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runs import Selector, run_with_cache, run_with_hooks


def names_filter(nodes: Any, extra: Sequence[str]) -> Any:
    """A `names_filter` selecting `nodes` (names, patterns or a predicate) and `extra`.

    Names and patterns stay a list, so that a run still refuses one that matches no
    point; a predicate is widened to the extra names.
    """
    extra = [n for n in dict.fromkeys(extra)]
    if nodes is None or callable(nodes):
        selector = Selector(nodes, "nodes")  # type: ignore[arg-type]
        wanted = frozenset(extra)
        return lambda name: selector(name) or name in wanted
    listed = [nodes] if isinstance(nodes, str) else list(nodes)
    return listed + [n for n in extra if n not in listed]


def activations(fn: Callable, x: Any, select: Any, fwd_hooks: Sequence = ()) -> dict[str, Any]:
    """The selected points' values in `fn(x)`, in the order they were reached (with
    `fwd_hooks`, [`jhooks.run_with_hooks`][]' hooks, active in the run)."""
    run = fn
    if fwd_hooks:

        def run(x: Any) -> Any:
            return run_with_hooks(fn, x, fwd_hooks=fwd_hooks)

    _, cache = run_with_cache(run, x, names_filter=select, return_output=False)
    return cache


def with_gradients(
    objective: Callable,
    x: Any,
    select: Any,
    fwd_hooks: Sequence = (),
    bwd_hooks: Sequence = (),
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """`objective(x)` (a scalar), the selected points' values and their gradients.

    **Arguments:**

    - `objective`: `x -> scalar` (the metric of the function's output).
    - `x`: the input.
    - `select`: a `names_filter`.
    - `fwd_hooks`, `bwd_hooks`: [`jhooks.run_with_hooks`][]' hooks, active in the run
        (the values cached are those after the forward hooks, the gradients those
        after the backward hooks).

    **Returns:**

    `(value, values, grads)`, the two dicts keyed by point name in the order reached.
    """
    run = objective
    if fwd_hooks or bwd_hooks:

        def run(x: Any) -> Any:
            return run_with_hooks(objective, x, fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks)

    value, cache = run_with_cache(run, x, names_filter=select, incl_bwd=True)
    values = {n: v for n, v in cache.items() if not _is_gradient(n, cache)}
    # A run differentiates the points whose leaves are all floating-point; a point with
    # integer leaves too (token ids beside a float) is differentiated here, by a probe.
    grads, mixed = {}, {}
    for n, v in values.items():
        if n + "_grad" in cache:
            grads[n] = cache[n + "_grad"]
        elif not any(map(_inexact, jax.tree.leaves(v))):  # token ids: no gradient
            grads[n] = jax.tree.map(lambda a: None, v)
        elif not all(map(_inexact, jax.tree.leaves(v))):
            mixed[n] = v
        else:
            grads[n] = cache[n + "_grad"]  # raises, as before (a point with no gradient)
    if mixed:
        grads.update(_probed(objective, x, mixed, fwd_hooks, bwd_hooks))
    return value, values, {n: grads[n] for n in values}


def _probed(
    objective: Callable, x: Any, values: dict[str, Any], fwd_hooks: Sequence, bwd_hooks: Sequence
) -> dict[str, Any]:
    """The gradients of `objective(x)` at the floating leaves of points `values`
    (`None` at the others), through a probe added to them by a forward hook (after
    `fwd_hooks`): for the points holding integer leaves too, which a run does not
    differentiate."""
    # Negative zeros: x + (-0.0) is x for every x, -0.0 included.
    probes = {
        n: jax.tree.map(lambda a: jnp.full(a.shape, -0.0, a.dtype) if _inexact(a) else None, v)
        for n, v in values.items()
    }

    def probed(probes: dict[str, Any]) -> jax.Array:
        def add(value: Any, name: str) -> Any:
            return jax.tree.map(
                lambda a, p: a if p is None else a + p,
                value,
                probes[name],
                is_leaf=lambda a: a is None,
            )

        hooks = [*fwd_hooks, *((n, add) for n in probes)]
        return run_with_hooks(objective, x, fwd_hooks=hooks, bwd_hooks=bwd_hooks)

    return jax.grad(probed)(probes)


def _is_gradient(name: str, cache: dict[str, Any]) -> bool:
    return name.endswith("_grad") and name[: -len("_grad")] in cache


def difference(clean: Any, corrupt: Any, name: str) -> Any:
    """`clean - corrupt` at point `name`, leaf by leaf (`None` where a leaf is not
    floating-point), exactly 0 where the two are equal (entries masked with `-inf` in
    both runs too, whose difference would be NaN).

    Raises a `ValueError` naming the point and both shapes where the two runs give it
    different shapes (inputs of different lengths).
    """

    def one(path: Any, a: Any, b: Any) -> Any:
        if not _inexact(a):
            return None
        if jnp.shape(a) != jnp.shape(b):
            leaf = jax.tree_util.keystr(path)
            raise ValueError(
                f"attribution: node {name!r}{f' (leaf {leaf})' if leaf else ''} is "
                f"{tuple(jnp.shape(a))} in the clean run and {tuple(jnp.shape(b))} in the "
                "corrupted run: attribution compares the two runs node by node, so each "
                "node must have one shape in both. Give clean and corrupt the same shape "
                "(pad the shorter prompt to the longer one's length, masking the padding "
                "if the model takes a mask)."
            )
        return jnp.where(a == b, jnp.zeros_like(a), a - b)

    return jax.tree_util.tree_map_with_path(one, clean, corrupt)


def zero_if_same(clean: Any, corrupt: Any, scores: dict) -> dict:
    """`scores` (leaves `None` kept, keys in their order), exactly 0 where the inputs
    `clean` and `corrupt` are equal, leaf for leaf.

    Each run is its own program (the clean one a forward pass, the corrupted one with its
    gradient), which XLA may round differently: equal inputs can give node values a bit
    apart, and scores of 1e-7 where patching changes nothing.
    """
    pairs = zip(jax.tree.leaves(clean), jax.tree.leaves(corrupt))
    if jax.tree.structure(clean) != jax.tree.structure(corrupt):
        return scores
    same = jnp.asarray(True)
    for a, b in pairs:
        if not (isinstance(a, jax.Array | np.ndarray) and isinstance(b, jax.Array | np.ndarray)):
            if not (a is b or _equal_objects(a, b)):
                return scores
            continue
        if jnp.shape(a) != jnp.shape(b):
            return scores
        same = same & jnp.all(a == b)

    def zeroed(score: Any) -> Any:
        return jax.tree.map(
            lambda s: None if s is None else jnp.where(same, jnp.zeros_like(s), s),
            score,
            is_leaf=lambda x: x is None,
        )

    # Node by node, not one tree.map over the dict, which would sort its keys: the
    # scores stay in the order the points were reached.
    return {name: zeroed(score) for name, score in scores.items()}


def _equal_objects(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects that do not compare: not known equal
        return False


def interpolated(corrupt: Any, delta: Any, alpha: jax.Array) -> Any:
    """`corrupt + alpha * delta`, leaf by leaf (leaves that are not floats unchanged)."""
    return jax.tree.map(
        lambda c, d: c if d is None else c + alpha.astype(d.dtype) * d,
        corrupt,
        delta,
        is_leaf=lambda x: x is None,
    )


def _inexact(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)

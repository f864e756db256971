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
    grads = {n: cache[n + "_grad"] for n in values}
    return value, values, grads


def _is_gradient(name: str, cache: dict[str, Any]) -> bool:
    return name.endswith("_grad") and name[: -len("_grad")] in cache


def difference(clean: Any, corrupt: Any) -> Any:
    """`clean - corrupt`, leaf by leaf (`None` where a leaf is not floating-point)."""
    return jax.tree.map(lambda a, b: a - b if _inexact(a) else None, clean, corrupt)


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

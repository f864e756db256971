"""A run's backward hooks that read traced values: the values travel to the backward pass.

A backward hook runs when JAX transposes the run's program, after the forward trace
has ended and the values it put in the hook's cells, dicts and attributes have been
taken out again. So the arrays (and changing numbers) a backward hook reads are
residuals of a `jax.custom_vjp` identity on the point's value: its backward rule puts
them back where the hook reads them (`_closures.install`), calls the hooks in order,
and takes them out. The program stays one per structure, and the hook never sees a
stale value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._core import check_like, install, restore
from ._programs import NamedCall


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def as_gradient(new: Any, grad: Any) -> Any:
    """What a run's backward hook returned, as a gradient: TransformerLens' backward
    hooks may return the point's grad_input, a one-element tuple `(grad,)`."""
    one = isinstance(new, tuple) and len(new) == 1 and not isinstance(grad, tuple)
    return new[0] if one else new


def carried(value: Any, hooks: list[NamedCall], name: str) -> Any:
    """`value`, whose gradient passes through `hooks` (run in order) in the backward pass.

    **Arguments:**

    - `value`: the point's value (an array or a pytree of arrays).
    - `hooks`: the run's backward hooks for this point.
    - `name`: the point's name, passed to the hooks.

    **Returns:**

    `value`, unchanged in the forward pass.
    """
    leaves, treedef = jax.tree.flatten(value)
    index = [i for i, x in enumerate(leaves) if _inexact(x)]
    if not index:
        return value
    positions = sorted({i for hook in hooks for i in hook.sites})
    values = next((hook.values for hook in hooks if hook.sites), [])
    residuals = [values[i] for i in positions]

    @jax.custom_vjp
    def identity(hooked: list, aux: list) -> list:
        return hooked

    def forward(hooked: list, aux: list) -> tuple[list, list]:
        return hooked, aux

    def backward(aux: list, cts: list) -> tuple[list, None]:
        current = list(values)
        for i, x in zip(positions, aux):
            current[i] = x
        full: list[Any] = [None] * len(leaves)
        for i, ct in zip(index, cts):
            full[i] = ct
        grad = jax.tree.unflatten(treedef, full)
        for hook in hooks:
            undo: list = []
            try:
                fn = hook if hook.plan is None else NamedCall(install(hook.plan, current, undo))
                new = as_gradient(fn(grad, name), grad)
            finally:
                restore(undo)
            if new is not None:
                check_like(hook, new, grad, "gradient", f"at hook point {name!r}")
                grad = new
        out = jax.tree.leaves(grad, is_leaf=lambda x: x is None)
        return [out[i] for i in index], None

    identity.defvjp(forward, backward)
    hooked = identity([leaves[i] for i in index], residuals)
    for i, x in zip(index, hooked):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)

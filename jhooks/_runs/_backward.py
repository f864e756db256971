"""A run's backward hooks in its program: traced hook calls, run in the backward pass.

A backward hook's Python runs before the program (`_hookpass.py`), on abstract values
of the gradient; what it computed runs in the program's backward pass, from the
constants it read then (arrays, numbers), which are the program's arguments. Those
constants are residuals of a `jax.custom_vjp` identity on the point's value, whose
backward rule evaluates each hook call in order on the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core import check_like, is_inexact_array


def as_gradient(new: Any, grad: Any) -> Any:
    """What a run's backward hook returned, as a gradient: TransformerLens' backward
    hooks may return the point's grad_input, a one-element tuple `(grad,)`."""
    one = isinstance(new, tuple) and len(new) == 1 and not isinstance(grad, tuple)
    return new[0] if one else new


def replayed(value: Any, hooks: list[tuple[Callable[[Any, list], Any], list]], name: str) -> Any:
    """`value`, whose gradient passes through `hooks` (run in order) in the backward pass.

    **Arguments:**

    - `value`: the point's value (an array or a pytree of arrays).
    - `hooks`: pairs `(fn, consts)`: `fn(grad, consts)` returns the new gradient (or
        `None`), `consts` the values it needs, carried to the backward pass.
    - `name`: the point's name, for errors.

    **Returns:**

    `value`, unchanged in the forward pass.
    """
    leaves, treedef = jax.tree.flatten(value)
    index = [i for i, x in enumerate(leaves) if is_inexact_array(x)]
    if not index:
        return value
    # The rule holds no traced value, only counts and the hooks' functions: the
    # constants reach it as residuals (a closure over them would keep this trace's
    # tracers alive in every jaxpr that holds the rule).
    count = len(leaves)
    fns = [fn for fn, _ in hooks]
    sizes = [len(consts) for _, consts in hooks]
    residuals = [x for _, consts in hooks for x in consts]
    del hooks

    @jax.custom_vjp
    def identity(hooked: list, aux: list) -> list:
        return hooked

    def forward(hooked: list, aux: list) -> tuple[list, list]:
        return hooked, aux

    def backward(aux: list, cts: list) -> tuple[list, None]:
        full: list[Any] = [None] * count
        for i, ct in zip(index, cts):
            full[i] = ct
        grad = jax.tree.unflatten(treedef, full)
        start = 0
        for fn, size in zip(fns, sizes):
            new = fn(grad, list(aux[start : start + size]))
            start += size
            if new is not None:
                check_like(fn, new, grad, "gradient", f"at hook point {name!r}")
                grad = new
        out = jax.tree.leaves(grad, is_leaf=lambda x: x is None)
        return [out[i] for i in index], None

    identity.defvjp(forward, backward)
    hooked = identity([leaves[i] for i in index], residuals)
    out = list(leaves)
    for i, x in zip(index, hooked):
        out[i] = x
    return jax.tree.unflatten(treedef, out)

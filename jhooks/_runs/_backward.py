"""A run's backward hooks in its program: traced hook calls, run in the backward pass.

A backward hook's Python runs before the program (`_hookpass.py`), on abstract values
of the gradient; what it computed runs in the program's backward pass, from the
constants it read then (arrays, numbers), which are the program's arguments. Those
constants are held operands of the hook primitive's identity on the point's value,
whose rule evaluates each hook call in order on the gradient, in every backward pass
through the point (grad of grad runs them twice, as PyTorch's double backward does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._core import (
    BackwardRule,
    Batched,
    axes,
    bind,
    check_like,
    get_aval,
    hook_name,
    is_inexact_array,
    per_example,
)


def as_gradient(new: Any, grad: Any) -> Any:
    """What a run's backward hook returned, as a gradient: TransformerLens' backward
    hooks may return the point's grad_input, a one-element tuple `(grad,)`."""
    one = isinstance(new, tuple) and len(new) == 1 and not isinstance(grad, tuple)
    return new[0] if one else new


def replayed(value: Any, hooks: list[tuple[Callable[[Any, list], Any], list]], name: str) -> Any:
    """`value`, whose gradient passes through `hooks` (run in order) in every backward
    pass through it.

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
    consts = [x for _, c in hooks for x in c]
    rule = _PointHooks(leaves, treedef, index, [(fn, len(c)) for fn, c in hooks], name)
    rule.held = len(consts)
    hooked = bind([*(leaves[i] for i in index), *consts], rule)
    out = list(leaves)
    for i, x in zip(index, hooked):
        out[i] = x
    return jax.tree.unflatten(treedef, out)


class _PointHooks(BackwardRule):
    """The backward hooks of one point of a run's program, in order: the hook
    primitive's rule (`_core/_primitive.py`), so that they run in every backward pass
    through the point (grad of grad: the first backward pass is differentiated through
    the point again), as PyTorch's double backward runs them, and do nothing in forward
    mode. It holds no traced value, only shapes and the hooks' functions: their
    constants are operands of the primitive, held (`BackwardRule.held`), which the
    backward pass gives back (a closure over them would keep this trace's tracers alive
    in every jaxpr that holds the rule)."""

    def __init__(
        self,
        leaves: list,
        treedef: Any,
        index: list[int],
        fns: list[tuple[Callable, int]],
        name: str,
    ):
        self.treedef, self.index, self.fns, self.name = treedef, index, fns, name
        self.count = len(leaves)
        self.avals = [get_aval(leaves[i]) for i in index]

    def transpose(self, cts: list[Any], linear: list[bool], batched: Batched) -> list[Any]:
        return self.transpose_held(cts, linear, batched, [])  # hooks holding no constant

    def transpose_held(
        self, cts: list[Any], linear: list[bool], batched: Batched, held: list[Any]
    ) -> list[Any]:
        n = len(cts)
        levels = [
            ((axes(lv.mask[:n]), axes(lv.mask[n:])), axes(lv.mask[:n]), lv.size) for lv in batched
        ]
        names = ", ".join(hook_name(fn) for fn, _ in self.fns)
        owner = f"backward hook(s) {names} at hook point {self.name!r}"
        out = per_example(self._run, levels, owner)(cts, held)
        return [ct if d else None for ct, d in zip(out, linear)]

    def _run(self, cts: list[Any], held: list[Any]) -> list[Any]:
        full: list[Any] = [None] * self.count
        for i, ct, a in zip(self.index, cts, self.avals):
            full[i] = jnp.zeros(a.shape, a.dtype) if ct is None else ct
        grad = jax.tree.unflatten(self.treedef, full)
        start = 0
        for fn, size in self.fns:
            new = fn(grad, list(held[start : start + size]))
            start += size
            if new is not None:
                check_like(fn, new, grad, "gradient", f"at hook point {self.name!r}")
                grad = new
        out = jax.tree.leaves(grad, is_leaf=lambda x: x is None)
        return [out[i] for i in self.index]

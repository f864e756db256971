"""A program evaluated again with the values of chosen operations passed through a hook.

`AtOperations` evaluates a traced function's jaxpr equation by equation (the one
interpreter, `_core`'s `Interpreter`, with this rule); the value of each chosen equation
(an operation address, `_addresses.py`) goes through `point(value, address)`, the
function a `hook_point` calls (`_runs.named_point`): the runs' forward hooks, the
cache's mark and the backward hooks, one mechanism. The control flow that holds a
chosen equation is staged again around the evaluation of its body: `lax.scan` (whose
marks the staged run then stacks, as for points), `lax.cond`/`switch`,
`lax.while_loop`, `jax.checkpoint` (its policy kept); a nested `jit` is evaluated
inline. Everything else is bound as it was, a `custom_jvp` or `custom_vjp` call with
its rule (an operation is never looked for inside one: the call is one operation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .._core import Interpreter, inner_jaxprs, with_source_of


class AtOperations(Interpreter):
    """Evaluates jaxprs, passing chosen equations' values through `point`.

    `chosen` maps `id(eqn)` to the operation's address and the axis of each output
    that goes first for `point` (a model's own vmap's, `Found.axes`, or `None`);
    `point(value, address)` returns the value to use (a single output as an array,
    several as a list).
    """

    def __init__(
        self, chosen: dict[int, tuple[str, tuple]], point: Callable[[Any, str], Any], caller: str
    ):
        super().__init__()
        self.chosen = chosen
        self.point = point
        self.caller = caller

    def run(self, jaxpr: Any, consts: Any, args: list[Any]) -> list[Any]:
        """Evaluates `jaxpr` on `args`; returns its outputs."""
        return self.run_jaxpr(jaxpr, consts, args)

    def marks(self, eqn: Any) -> int:
        return id(eqn) in self.chosen

    def equation(self, eqn: Any, invals: list[Any], at: tuple) -> list[Any]:
        with with_source_of(eqn):
            outs = super().equation(eqn, invals, at)
        chosen = self.chosen.get(id(eqn))
        if chosen is None:
            return outs
        address, axes = chosen
        seen = [_first(x, a) for x, a in zip(outs, axes)]
        new = [self.point(seen[0], address)] if len(seen) == 1 else self.point(seen, address)
        return [_back(x, a) for x, a in zip(new, axes)]

    def refuse(self, eqn: Any) -> None:
        inside = self.first(inner_jaxprs(eqn), lambda e: (self.chosen.get(id(e)) or (None,))[0])
        raise ValueError(
            f"{self.caller}: operation {inside!r} is inside a `{eqn.primitive.name}` "
            "primitive, which jhooks cannot evaluate again; select an operation outside it."
        )


def _first(x: Any, axis: Any) -> Any:
    return x if axis in (None, 0) else jnp.moveaxis(x, axis, 0)


def _back(x: Any, axis: Any) -> Any:
    return x if axis in (None, 0) else jnp.moveaxis(x, 0, axis)

"""One box for a function traced to a jaxpr over the arrays of its arguments.

A staged run, retained gradients inside loops and values emitted in staged backward
passes all trace a function whose arguments and result mix arrays with other values
(Python numbers used as indices, strings, modules holding functions). The arrays are
the jaxpr's inputs and outputs; everything else is passed through as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def is_array(x: Any) -> bool:
    return isinstance(x, jax.Array)


class Traced:
    """`fn(*args)` traced to `closed` (a `ClosedJaxpr`) over `inputs`, the leaves of `args`
    that `is_dynamic` picks; `output(outs)` rebuilds `fn`'s result from the jaxpr's
    outputs, the non-array leaves of the result as they were when traced."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple, is_dynamic: Callable[[Any], bool] = is_array
    ):
        leaves, tree = jax.tree.flatten(args)
        dynamic = [i for i, x in enumerate(leaves) if is_dynamic(x)]
        self._out: dict[str, Any] = {}

        def traced(*values: Any) -> list[Any]:
            full = list(leaves)
            for i, x in zip(dynamic, values):
                full[i] = x
            out_leaves, out_tree = jax.tree.flatten(fn(*jax.tree.unflatten(tree, full)))
            kept = [i for i, x in enumerate(out_leaves) if isinstance(x, jax.Array)]
            # Only the non-array leaves are kept: the arrays are this trace's.
            static = [None if i in kept else x for i, x in enumerate(out_leaves)]
            self._out.update(leaves=static, tree=out_tree, kept=kept)
            return [out_leaves[i] for i in kept]

        self.inputs = [leaves[i] for i in dynamic]
        self.closed = jax.make_jaxpr(traced)(*self.inputs)

    def output(self, outs: list[Any]) -> Any:
        """`fn`'s result with the jaxpr's outputs `outs` in place of its arrays."""
        full = list(self._out["leaves"])
        for i, x in zip(self._out["kept"], outs):
            full[i] = x
        return jax.tree.unflatten(self._out["tree"], full)

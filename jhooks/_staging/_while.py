"""`lax.while_loop` in a staged run: a step counter for `loop_index`, bounded caches.

A `while` equation (a `lax.while_loop`, or a `lax.fori_loop` with traced bounds) has
no length known when tracing, so the harvest rewrites it with one more carry:

- `n`, the number of completed iterations (an `int32` from 0), the `loop_index` of the
  body (and of the condition, which sees the `n` of the iteration it admits);
- for each point of the run in the body, given a bound `max_steps`, a preallocated
  `(max_steps, ...)` buffer per leaf: iteration `n` writes its row with one
  `dynamic_update_slice` in the carry. An iteration beyond the bound writes nothing.

The run returns each buffer under the point's name, with `name + "_steps"` (the
iterations run, `n` at the end: more than `max_steps` when rows were left out) and
`name + "_valid"` (`(max_steps,)` booleans: the rows written). Gradients through a
while loop do not exist in JAX (reverse mode needs a known number of iterations), so a
point there with `incl_bwd=True` is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from .._core import ShapedArray

if TYPE_CHECKING:
    from ._harvest import Harvester, Point

STEPS, VALID = "_steps", "_valid"  # the suffixes of a bounded cache's extra entries
_LEAF = jax.tree.structure(0)
MAX_STEPS_ADVICE = (
    ", or give the run a bound: run_with_cache(..., max_steps=N) returns each point there "
    "as a (N, ...) buffer written at each step (with name + '_steps' and name + '_valid')"
)


def _refusal(harvester: Harvester, eqn: Any, stacked: str, advice: str) -> ValueError:
    name, where = harvester._refusal(eqn, stacked, advice)
    return ValueError(f"{harvester.caller}: hook point {name!r} is inside {where}.")


def while_points(harvester: Harvester, eqn: Any) -> list[Point]:
    """The points of the run inside the `while` equation `eqn`, as the run returns them:
    each stacked along `max_steps`, with its `_steps` and `_valid` entries."""
    p = eqn.params
    if harvester.points(p["cond_jaxpr"].jaxpr):
        raise _refusal(
            harvester,
            eqn,
            "values",
            "; a point in the loop's condition runs once more than its body. Move it "
            "into the body, or leave it out of names_filter",
        )
    inner = harvester.points(p["body_jaxpr"].jaxpr)
    if not inner:
        return []
    bound = harvester.max_steps
    if bound is None:
        harvester._refuse(eqn)
        raise AssertionError  # _refuse raises
    out: list[Point] = []
    for point in inner.values():
        out.append(point.stacked(bound))
        steps = ShapedArray((), jnp.int32)
        valid = ShapedArray((bound,), jnp.bool_)
        for suffix, aval in ((STEPS, steps), (VALID, valid)):
            extra = point._replace(name=point.name + suffix, avals=(aval,), treedef=_LEAF)
            out.append(extra._replace(floating=False))
    return out


def _write(buffer: jax.Array, row: jax.Array, n: jax.Array) -> jax.Array:
    """`buffer` with row `n` set to `row`; unchanged when `n` is past its end."""
    bound = buffer.shape[0]
    at = jnp.minimum(n, bound - 1)
    old = jax.lax.dynamic_index_in_dim(buffer, at, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(n < bound, row, old), at, 0)


def harvest_while(
    harvester: Harvester, eqn: Any, invals: list, index: tuple, probes: dict | None
) -> tuple[list, dict[str, list]]:
    """Evaluates the `while` equation `eqn` with a step counter and bounded caches."""
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    points = {q.name: q for q in while_points(harvester, eqn)}
    rows = {
        name: q for name, q in harvester.points(body.jaxpr).items() if name in points
    }  # the points themselves, one row each
    if probes is not None and any(name in probes for name in rows):
        name = next(name for name in rows if name in probes)
        raise ValueError(
            f"{harvester.caller}: hook point {name!r} is inside a lax.while_loop (or a "
            "lax.fori_loop with traced bounds), and incl_bwd=True asks for its gradient: "
            "JAX has no reverse-mode derivative of a while loop (its number of iterations "
            "is not known when tracing). Cache it without incl_bwd, or use lax.scan (or "
            "lax.fori_loop with Python int bounds) to differentiate through the loop."
        )
    zeros = {name: [jnp.zeros(a.shape, a.dtype) for a in points[name].avals] for name in rows}

    def cond_fun(state: tuple) -> Any:
        n, carry, _ = state
        outs, _ = harvester.run(cond.jaxpr, cond.consts, [*cond_consts, *carry], (*index, n))
        return outs[0]

    def body_fun(state: tuple) -> tuple:
        n, carry, bufs = state
        outs, reaped = harvester.run(body.jaxpr, body.consts, [*body_consts, *carry], (*index, n))
        bufs = {name: [_write(b, x, n) for b, x in zip(bufs[name], reaped[name])] for name in bufs}
        return n + 1, outs, bufs

    n, carry, bufs = jax.lax.while_loop(cond_fun, body_fun, (jnp.int32(0), list(init), zeros))
    reaped: dict[str, list] = {}
    for name, leaves in bufs.items():
        reaped[name] = leaves
        reaped[name + STEPS] = [n]
        reaped[name + VALID] = [jnp.arange(leaves[0].shape[0]) < n]
    return list(carry), reaped

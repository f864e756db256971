"""Taps: sites whose norm the backward pass computes, returned as a cotangent.

Under `jax.checkpoint` (see `_ghost.two_passes`) a site keeps nothing for its norm: the
identity on its output, a `jax.custom_vjp`, computes the per-example squared norm of
the parameter's gradient at the site in its backward rule, where the output gradient
arrives and the site's input is recomputed, and returns it as the cotangent of `z`, a
zero scalar input (one per example and scan iteration).

A parameter with two sites (a tied embedding: the lookup, then the output layer `h @ E.T`)
has a cross term between them, `⟨G_A, G_B⟩ = Σ_p F1_A,p · R_p` with
`R_p = Σ_q (F0_A,p · F0_B,q) F1_B,q` on the parameter's axes (`F0_A` the forward factor
of the first site A). The first site's tap outputs a zero *carrier*, an input of the
second's; the second's backward rule, given A's forward factor, returns `R` as the
carrier's cotangent, and the first's backward rule, which comes later, adds the cross
term to its own norm. Neither site keeps its output gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._norms import gram, leaf_sq_norm
from ._sites import Loop, Use, factors, leaf_axis_of_first_factor


@dataclasses.dataclass(frozen=True)
class Tap:
    """A tapped site. `by_axes`: its factors are put on the parameter's axes (a tied
    matrix); `first`: for the second site of a pair, the first's `Use`; `pairs`: the
    first site of a pair."""

    use: Use
    by_axes: bool = False
    first: Use | None = None
    pairs: bool = False


def _alone(use: Use) -> Use:
    return dataclasses.replace(use, chain=tuple(s for s in use.chain if not isinstance(s, Loop)))


def forward_side(use: Use, by_axes: bool) -> int:
    """The parameter axis (0 or 1) of the site's forward factor (its input, its ids)."""
    return 1 if by_axes and leaf_axis_of_first_factor(use) == 1 else 0


def _on_axes(use: Use, by_axes: bool, record: tuple, g, dtype) -> tuple[Any, Any]:
    """The site's factors `(F0, F1)` on the parameter's axes, dense ones in `dtype`."""
    f = factors(_alone(use), record, g)
    f = [x if jnp.issubdtype(x.dtype, jnp.integer) else x.astype(dtype) for x in f]
    return (f[1], f[0]) if forward_side(use, by_axes) == 1 else (f[0], f[1])


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _zeros(record: tuple) -> tuple:
    return tuple(_zero_cotangent(x) for x in record)


def _stopped(record: tuple) -> tuple:
    return tuple(lax.stop_gradient(x) for x in record)


def _self_norm(use: Use, record: tuple, g, dtype):
    return leaf_sq_norm([_alone(use)], {use.site: record}, {use.site: g}, (), False, dtype)


def tap(t: Tap, y, record: tuple, z) -> Any:
    """`y`, a site's output for one example, whose backward pass gives `z` the squared
    norm at the site as its cotangent; for the first site of a pair, `(y, carrier)`."""
    use, dtype = t.use, z.dtype
    carrier_shape: tuple = ()
    if t.pairs:
        shapes = jax.eval_shape(lambda r, g: _on_axes(use, t.by_axes, r, g, dtype), record, y)
        carrier_shape = shapes[1 - forward_side(use, t.by_axes)].shape

    # `+ z` (zero) makes `y` one example's: a site whose output is the same for every
    # example (a positional embedding) would otherwise see the batch's summed gradient.
    @jax.custom_vjp
    def through(y, record, z):
        if t.pairs:
            return y + z.astype(y.dtype), jnp.zeros(carrier_shape, dtype) + z
        return y + z.astype(y.dtype)

    def forward(y, record, z):
        return through(y, record, z), record

    def backward(record, cotangents):
        g, r = cotangents if t.pairs else (cotangents, None)
        sq = _self_norm(use, record, g, dtype)
        if r is not None:  # the cross term with the pair's second site
            backward_factor = _on_axes(use, t.by_axes, record, g, dtype)[
                1 - forward_side(use, t.by_axes)
            ]
            sq = sq + 2 * jnp.sum(backward_factor * r)
        return g, _zeros(record), sq.astype(dtype)

    through.defvjp(forward, backward)
    return through(y, _stopped(record), z)


def tap_second(t: Tap, y, record: tuple, z, carrier, first_record: tuple) -> Any:
    """`y`, the second site of a pair: its backward pass gives `z` its own squared norm
    and `carrier` the rows `R` of its gradient the cross term needs (see the module doc)."""
    use, first, dtype = t.use, t.first, z.dtype
    assert first is not None
    side = forward_side(first, t.by_axes)
    first_out = first.eqn.outvars[0].aval

    @jax.custom_vjp
    def through(y, record, z, carrier, first_record):
        return y + z.astype(y.dtype)

    def forward(y, record, z, carrier, first_record):
        return through(y, record, z, carrier, first_record), (record, first_record)

    def backward(res, g):
        record, first_record = res
        sq = _self_norm(use, record, g, dtype)
        mine = _on_axes(use, t.by_axes, record, g, dtype)
        zero_g = jnp.zeros(first_out.shape, first_out.dtype)
        theirs = _on_axes(first, t.by_axes, first_record, zero_g, dtype)[side]
        rows = jnp.einsum("spq,sqd->spd", gram(theirs, mine[side], dtype), mine[1 - side])
        return g, _zeros(record), sq.astype(dtype), rows.astype(dtype), _zeros(first_record)

    through.defvjp(forward, backward)
    return through(y, _stopped(record), z, carrier, _stopped(first_record))


def can_pair(first: Use, second: Use, by_axes: bool) -> bool:
    """Whether two sites of one parameter can be tapped as a pair: outside any scan, in
    the same jaxpr (the carrier passes from one to the other), the second's factor that
    meets the first's output gradient dense (not a lookup's row ids)."""
    if first.loops or second.loops or (first.site or ())[:-1] != (second.site or ())[:-1]:
        return False
    side = forward_side(first, by_axes)
    return not (second.kind == "gather" and forward_side(second, by_axes) == 1 - side)

"""Ghost norms and the clipped sum, from the sites' factors.

Example `i`'s gradient of a parameter is `G = Σ_p F0_p ⊗ F1_p` over every position `p` of
every site of the parameter (the iterations of a scan that shares it are positions too;
a scan that slices it gives each slice its own sum). So

    ‖G‖² = Σ_{p,q in one slice} (F0_p·F0_q)(F1_p·F1_q)

a sum of Gram products, cross terms between sites included (a tied embedding: the
lookup's one-hot rows against the output layer's gradients). When the Gram matrix would
be larger than `G` itself (`P² > d0·d1`), `G` is formed instead, one example at a time.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import bind_equation
from ._gathered import Gathered, gathered_sq_norm
from ._sites import (
    Loop,
    Region,
    Use,
    by_region,
    disjoint,
    factors,
    leaf_axis_of_first_factor,
    region_key,
)


def wide(dtype):
    """`dtype` if at least 32-bit, else float32: norms are summed in it."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype("float32")


def _is_index(f) -> bool:
    return jnp.issubdtype(f.dtype, jnp.integer)


def gram(x, y, dtype):
    """(S, P, Q): the inner products of x's and y's positions, slice by slice."""
    if _is_index(x) and _is_index(y):
        return (x[:, :, None] == y[:, None, :]).astype(dtype)
    if _is_index(x):  # one-hot rows of x against dense y: y's entries at x's rows
        picked = jnp.take_along_axis(
            y, jnp.broadcast_to(x[:, None, :], y.shape[:2] + x.shape[1:]), 2
        )
        return jnp.swapaxes(picked, 1, 2)
    if _is_index(y):
        return jnp.swapaxes(gram(y, x, dtype), 1, 2)
    return jnp.einsum("spk,sqk->spq", x, y)


def _outer(f0, f1, d0: int, d1: int):
    """(S, d0, d1): Σ_p F0_p ⊗ F1_p, slice by slice."""
    s = f0.shape[0]
    if _is_index(f0):
        ids = (jnp.arange(s)[:, None] * d0 + f0).reshape(-1)
        return jax.ops.segment_sum(f1.reshape(-1, d1), ids, s * d0).reshape(s, d0, d1)
    if _is_index(f1):
        return jnp.swapaxes(_outer(f1, f0, d1, d0), 1, 2)
    return jnp.einsum("spa,spb->sab", f0, f1)


def _parts(uses: list[Use], records: dict, probe_grads: dict, by_axes: bool, dtype):
    """Every site's factors, (F0, F1) over the same parameter axes, grouped by which are
    row ids, and concatenated along the positions within a group."""
    groups: dict[tuple[bool, bool], list] = {}
    for u in uses:
        f0, f1 = factors(u, records[u.site], probe_grads[u.site])
        if by_axes and leaf_axis_of_first_factor(u) == 1:
            f0, f1 = f1, f0
        f0 = f0 if _is_index(f0) else f0.astype(dtype)
        f1 = f1 if _is_index(f1) else f1.astype(dtype)
        groups.setdefault((_is_index(f0), _is_index(f1)), []).append((f0, f1))
    return [
        (jnp.concatenate([f0 for f0, _ in ps], 1), jnp.concatenate([f1 for _, f1 in ps], 1))
        for ps in groups.values()
    ]


def factor_sizes(uses: list[Use], leaf_shape: tuple, by_axes: bool) -> tuple[int, int]:
    """(d0, d1): the sizes of the two factors' axes."""
    u = uses[0]
    n_slices = len(u.slices)
    if by_axes:
        return leaf_shape[n_slices], leaf_shape[n_slices + 1]
    view = u.eqn.invars[u.operand].aval.shape
    if u.kind == "gather":
        return view[0], view[1]
    if u.kind == "dot":
        _, _, pc, pf, _ = u.signature
        return int(np.prod([view[d] for d in pc])), int(np.prod([view[d] for d in pf]))
    rhs_spec, groups = u.signature[2], u.signature[4]  # conv: O, I / groups, spatial...
    return int(np.prod(view)) // view[rhs_spec[0]], view[rhs_spec[0]] // groups


def leaf_sq_norm(uses, records, probe_grads, leaf_shape, by_axes, dtype):
    """Squared norm of one example's gradient of a parameter whose uses are all sites:
    the sum over the disjoint regions it is sliced into (one, the whole, if none)."""
    regions = by_region(uses)
    if len(regions) > 1:
        sq = [leaf_sq_norm(r, records, probe_grads, leaf_shape, by_axes, dtype) for r in regions]
        return jnp.sum(jnp.stack(sq))
    if uses[0].kind == "gdot":  # experts picked by index: one masked Gram sum
        fs = [factors(u, records[u.site], probe_grads[u.site]) for u in uses]
        rows, a, g = (jnp.concatenate([f[k] for f in fs], 1) for k in range(3))
        n_rows = next(s for s in uses[0].chain if isinstance(s, Gathered)).eqn.invars[0]
        norm = partial(gathered_sq_norm, n_rows=n_rows.aval.shape[0], dtype=dtype)
        return jnp.sum(jax.vmap(norm)(rows, a, g))
    parts = _parts(uses, records, probe_grads, by_axes, dtype)
    d0, d1 = factor_sizes(uses, leaf_shape, by_axes)
    positions = sum(f0.shape[1] for f0, _ in parts)
    if positions * positions <= d0 * d1:
        per_slice = jnp.zeros((), dtype)
        for i, (a0, a1) in enumerate(parts):
            for j, (b0, b1) in enumerate(parts[i:], i):
                term = jnp.sum(gram(a0, b0, dtype) * gram(a1, b1, dtype), axis=(1, 2))
                per_slice = per_slice + (term if i == j else 2 * term)
        # Each slice's sum is a squared norm, but one that cancels to (near) zero can round
        # below it: clamped, as `sqrt` of a negative is NaN.
        return jnp.sum(jnp.maximum(per_slice, 0))
    g = sum(_outer(f0, f1, d0, d1) for f0, f1 in parts)
    return jnp.sum(jnp.square(g))


def _site_value(view, use: Use, steps: tuple, record: tuple):
    """The site's output for one example, from a parameter value `view` and the chain's
    remaining `steps` (a scan's axis is mapped over, the parameter sliced or shared)."""
    for k, step in enumerate(steps):
        if isinstance(step, Loop):
            rest = steps[k + 1 :]

            def inner(v, r, rest=rest):
                return _site_value(v, use, rest, r)

            return jax.vmap(inner, in_axes=(0 if step.sliced else None, 0))(view, record)
        if isinstance(step, Gathered):
            view = step.apply(view, record[-2])
        else:
            view = step.apply(view) if isinstance(step, Region) else bind_equation(step, [view])[0]
    operands = list(record[:-2] if use.kind == "gdot" else record[:-1])
    operands.insert(use.operand, view)
    return bind_equation(use.eqn, operands)[0] * record[-1]


def leaf_grad(uses: list[Use], leaf, records: dict, probe_grads: dict, weights):
    """Σ_i w_i · (example i's gradient of a parameter whose uses are all sites).

    Each site is linear in the parameter, so this is the transpose of the site, batched
    over the examples with the parameter shared, at the output gradients scaled by `w_i`:
    the weight gradient of a backward pass, from what the first backward pass gave.
    """

    def total(p):
        out = jnp.zeros((), wide(leaf.dtype))
        for u in uses:
            y = jax.vmap(lambda r, u=u: _site_value(p, u, u.chain, r))(records[u.site])
            g = probe_grads[u.site]
            g = g * weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)
            out = out + jnp.sum(y * lax.stop_gradient(g)).astype(out.dtype)
        return out

    return jax.grad(total)(leaf)


def plan_leaf(uses: list[Use]) -> tuple[bool, bool, str]:
    """(ghost, by_axes, why not): whether the uses have a ghost rule together, and how."""
    if any(u.site is None for u in uses):
        bad = sorted({u.label for u in uses if u.site is None})
        return False, False, ", ".join(bad)
    keys = [region_key(r[0]) for r in by_region(uses)]
    regions = [k for k in keys if k is not None]
    if len(keys) > 1:
        if len(regions) < len(keys) or not all(
            disjoint(a, b) for i, a in enumerate(regions) for b in regions[i + 1 :]
        ):
            names = ", ".join(sorted({u.eqn.primitive.name for u in uses}))
            return False, False, f"{names} through slices that overlap"
        ok = [plan_leaf(r) for r in by_region(uses)]
        bad = [why for good, _, why in ok if not good]
        return (False, False, bad[0]) if bad else (True, False, "")
    if len({u.slices for u in uses}) != 1:
        return False, False, "scans that slice it differently"
    if len({u.signature for u in uses}) == 1:
        return True, False, ""
    if all(leaf_axis_of_first_factor(u) is not None for u in uses):
        return True, True, ""  # a tied matrix: its sites' factors aligned on its axes
    return False, False, ", ".join(sorted({u.label for u in uses})) + " in different layouts"

"""Matrices of a parameter picked by index, then used by a matrix product: the experts of
a mixture of experts (`W[expert_ids]`, `jnp.take(W, ids, axis=0)`, `W[i]` with a traced
`i` under the model's `jax.vmap` over tokens), `W` of shape `(experts, d, f)`.

The `gather` of whole matrices is a step of the parameter's chain (`Gathered`), and the
`dot_general` that uses the gathered value a site of kind "gdot". Its dimensions are
*index* dimensions (one matrix per entry of the ids) and *weight* dimensions (those of one
matrix); the product must contract weight dimensions only and batch over index dimensions
only. Example `i`'s gradient of expert `e` is `Σ_{p: id_p = e} a_p ⊗ g_p` over the
positions `p` (the product's batch and free dimensions), so its squared norm, over every
expert, is

    Σ_{p,q} [id_p = id_q] (a_p·a_q)(g_p·g_q)

or, when that is larger, `‖Σ_p onehot(id_p) ⊗ a_p ⊗ g_p‖²`: per-expert ghost norms, no
per-example copy of the experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import bind_equation


@dataclasses.dataclass(frozen=True)
class Gathered:
    """A `gather` of whole matrices of a parameter view (rows of its first axis)."""

    eqn: Any

    def apply(self, view: Any, ids: Any) -> Any:
        return bind_equation(self.eqn, [view, ids])[0]


def gathers_matrices(eqn: Any) -> bool:
    """Whether `eqn`, a `gather` whose operand 0 is the parameter view, reads whole slices
    of its first axis (the experts of `W[ids]`), the other starts only clamped to 0."""
    view = eqn.invars[0].aval
    p = eqn.params
    dn = p["dimension_numbers"]
    return (
        view.ndim >= 3
        and tuple(p["slice_sizes"]) == (1, *view.shape[1:])
        and dn.start_index_map[:1] == (0,)
        and set(dn.collapsed_slice_dims) <= {0}
        and not dn.operand_batching_dims
        and eqn.invars[1].aval.ndim >= 1
        and eqn.invars[1].aval.shape[-1] == len(dn.start_index_map)
    )


def _labels(chain: tuple) -> list | None:
    """The dimensions of the value after the chain's `Gathered` step and the views after
    it: `("index", k)` (the gather's `k`-th index dimension) or `("weight",)`; None if
    a view does not keep them apart."""
    k = next(i for i, s in enumerate(chain) if isinstance(s, Gathered))
    eqn = chain[k].eqn
    offset = set(eqn.params["dimension_numbers"].offset_dims)
    n_index = 0
    labels: list = []
    for d in range(eqn.outvars[0].aval.ndim):
        labels.append(("weight",) if d in offset else ("index", n_index))
        n_index += d not in offset
    for step in chain[k + 1 :]:
        name = getattr(getattr(step, "primitive", None), "name", "")
        if name == "squeeze":
            labels = [x for d, x in enumerate(labels) if d not in step.params["dimensions"]]
        elif name == "transpose":
            labels = [labels[d] for d in step.params["permutation"]]
        elif name not in ("convert_element_type", "copy", "copy_p"):
            return None
    return labels


def classify_gathered(eqn: Any, index: int, chain: tuple) -> tuple | None:
    """The signature of a `dot_general` of a gathered view (operand `index`), or None."""
    if eqn.primitive.name != "dot_general" or not any(isinstance(s, Gathered) for s in chain):
        return None
    labels = _labels(chain)
    if labels is None:
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contract, batch = (lc, lb) if index == 0 else (rc, rb)
    if any(labels[d][0] != "weight" for d in contract) or any(
        labels[d][0] != "index" for d in batch
    ):
        return None
    return ("gdot", tuple(labels), eqn.invars[index].aval.shape)


def gathered_factors(use: Any, other, g, ids) -> tuple[Any, Any, Any]:
    """`(rows, a, g)` of one example at a "gdot" site: `(P,)`, `(P, K)`, `(P, N)` over the
    positions `P` (the product's batch dimensions, the other operand's free ones, the
    gathered value's free index ones); `g` is zero where the gather read no matrix."""
    eqn, j = use.eqn, use.operand
    labels = list(use.signature[1])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    vc, vb, xc, xb = (lc, lb, rc, rb) if j == 0 else (rc, rb, lc, lb)
    n_v = len(labels)
    vf = [d for d in range(n_v) if d not in vc and d not in vb]
    vf_index = [d for d in vf if labels[d][0] == "index"]
    vf_weight = [d for d in vf if labels[d][0] == "weight"]
    xf = [d for d in range(other.ndim) if d not in xc and d not in xb]
    nb, nxf = len(vb), len(xf)
    # The output's dimensions: batch, then the lhs' free ones, then the rhs'.
    out_v = [nb + nxf + k for k in range(len(vf))] if j == 1 else [nb + k for k in range(len(vf))]
    out_x = [nb + k for k in range(nxf)] if j == 1 else [nb + len(vf) + k for k in range(nxf)]
    pos_v = {d: out_v[k] for k, d in enumerate(vf)}
    size = [other.shape[d] for d in xb]
    n_b, n_xf = int(np.prod(size, dtype=int)), int(np.prod([other.shape[d] for d in xf]))
    n_i = int(np.prod([g.shape[pos_v[d]] for d in vf_index], dtype=int))
    a = jnp.transpose(other, list(xb) + xf + list(xc)).reshape(n_b, n_xf, 1, -1)
    g = jnp.transpose(
        g, list(range(nb)) + out_x + [pos_v[d] for d in vf_index + vf_weight]
    ).reshape(n_b, n_xf, n_i, -1)
    rows, valid = _rows(use, ids, labels, list(vb) + vf_index)
    a = jnp.broadcast_to(a, (n_b, n_xf, n_i, a.shape[-1]))
    g = jnp.where(valid.reshape(n_b, 1, n_i, 1), g, jnp.zeros((), g.dtype))
    rows = jnp.broadcast_to(rows.reshape(n_b, 1, n_i), (n_b, n_xf, n_i))
    return rows.reshape(-1), a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])


def _rows(use: Any, ids, labels: list, order: list) -> tuple[Any, Any]:
    """The matrix each index position of the gathered view reads, and whether it reads
    one, in the order of `order` (dimensions of the view, index ones)."""
    gather = next(s for s in use.chain if isinstance(s, Gathered)).eqn
    dn, mode = gather.params["dimension_numbers"], str(gather.params["mode"])
    n_rows = gather.invars[0].aval.shape[0]
    starts = ids
    rows = starts[..., 0]
    valid = jnp.ones(rows.shape, bool)
    if "CLIP" not in mode and "PROMISE" not in mode:  # out of range: no matrix read
        valid = (rows >= 0) & (rows < n_rows)
        for k in range(1, len(dn.start_index_map)):
            valid = valid & (starts[..., k] == 0)
    kept = [labels[d][1] for d in order]
    dropped = [k for k in range(rows.ndim) if k not in kept]  # squeezed: of size 1
    rows, valid = (jnp.squeeze(x, dropped) if dropped else x for x in (rows, valid))
    remaining = [k for k in range(rows.ndim + len(dropped)) if k not in dropped]
    perm = [remaining.index(k) for k in kept]
    return jnp.transpose(jnp.clip(rows, 0, n_rows - 1), perm), jnp.transpose(valid, perm)


def gathered_sq_norm(rows, a, g, n_rows: int, dtype) -> jax.Array:
    """`Σ_{p,q} [rows_p = rows_q] (a_p·a_q)(g_p·g_q)` for one example, or the norm of the
    per-expert sums when `P² > experts·K·N`."""
    a, g = a.astype(dtype), g.astype(dtype)
    p, k, n = a.shape[0], a.shape[1], g.shape[1]
    if p * p <= n_rows * k * n:
        same = (rows[:, None] == rows[None, :]).astype(dtype)
        return jnp.maximum(jnp.sum(same * (a @ a.T) * (g @ g.T)), 0)
    onehot = (rows[:, None] == jnp.arange(n_rows)).astype(dtype)
    return jnp.sum(jnp.square(jnp.einsum("pe,pk,pn->ekn", onehot, a, g)))

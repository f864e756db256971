"""The machinery of `jhooks.clipped_grad`: a walk over the per-example loss's jaxpr.

The per-example loss is traced once to a jaxpr whose first inputs are the model's
parameters. A parameter flows through *views* (reshape, transpose, squeeze,
broadcast, dtype conversion) into the operations that *use* it. Each use of a
parameter by a `dot_general` (every `eqx.nn.Linear`, and the projections of
`eqx.nn.MultiheadAttention`), a `conv_general_dilated` (`eqx.nn.Conv1d/2d/3d`) or a
row `gather` (`eqx.nn.Embedding`) is a *site*: when the loss is evaluated again
(`evaluate`), a zero probe is added to the site's output and the site's other
operand (the layer's input activations, or the token ids) is recorded. The
gradient with respect to the probe is the output gradient `g` of that example, and
the squared norm of the parameter's per-example gradient follows from `a` and `g`
without forming it (`site_sq_norms`).

A parameter with any other use (LayerNorm's scale and offset, a bias, a positional
embedding, or anything without a rule) gets exact per-example gradients instead: it
enters the per-example function batched, so its cotangent is one gradient per
example. Only the jaxpr's own structure is read: no jhooks internals.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import Literal

# Operations that only relabel (or broadcast) a parameter: followed, not uses.
VIEWS = frozenset(
    {
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
        "copy_p",
        "reduce_precision",
    }
)
# Calls whose body is walked as if inlined.
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat"})
# Uses whose per-example gradient is no larger than the activation they make:
# per-example gradients for these are the rule, not a fallback (no warning).
ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "neg", "max", "min", "add_any", "select_n"})


@dataclasses.dataclass(frozen=True)
class Tag:
    """A value that is a view of parameter `leaf` through the view equations `chain`."""

    leaf: int
    chain: tuple = ()

    def key(self) -> tuple:
        return tuple((e.primitive.name, repr(sorted(e.params.items()))) for e in self.chain)


@dataclasses.dataclass
class Use:
    leaf: int
    kind: str  # "dot", "conv", "gather", or the primitive's name for any other use
    site: tuple | None  # the equation's path, for a site
    signature: Any = None
    eqn: Any = None
    operand: int = 0
    tag_chain: tuple = ()


def _sub_jaxpr(eqn):
    for name in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(name)
        if sub is None:
            continue
        if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
            return sub.jaxpr, list(sub.consts)
        if hasattr(sub, "eqns"):
            return sub, []
    return None


def _bind(eqn, invals):
    """Runs one equation on `invals`, as `jax.core.eval_jaxpr` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = []
    if isinstance(params, tuple):  # JAX versions that return (subfuns, params)
        subfuns, params = params
    ctx = getattr(eqn, "ctx", None)
    with ctx.manager if ctx is not None else contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _classify(eqn, index: int, tag: Tag, leaf_shape) -> tuple[str, Any]:
    """(kind, signature) of a use of a parameter view by one equation."""
    name = eqn.primitive.name
    view = eqn.invars[index].aval
    bijective = int(np.prod(view.shape)) == int(np.prod(leaf_shape))
    if len(eqn.outvars) != 1 or not bijective:
        return name, None
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if lb or rb:
            return name, None
        pc = tuple(int(d) for d in (lc if index == 0 else rc))
        pf = tuple(d for d in range(len(view.shape)) if d not in pc)
        return "dot", ("dot", tag.key(), pc, pf, view.shape)
    if name == "conv_general_dilated" and index == 1:
        p = eqn.params
        if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
            return name, None
        rhs_spec = tuple(p["dimension_numbers"].rhs_spec)
        return "conv", ("conv", tag.key(), rhs_spec, view.shape)
    if name == "gather" and index == 0 and len(view.shape) == 2:
        p = eqn.params
        dn = p["dimension_numbers"]
        ok = (
            tuple(p["slice_sizes"]) == (1, view.shape[1])
            and 0 in dn.start_index_map
            and not dn.operand_batching_dims
            and set(dn.collapsed_slice_dims) <= {0}
            and eqn.invars[1 - index].aval.ndim >= 1
            and eqn.invars[1 - index].aval.shape[-1] == len(dn.start_index_map)
        )
        if ok:
            return "gather", ("gather", tag.key(), view.shape)
    if name == "dynamic_slice" and index == 0 and len(view.shape) == 2:
        # `weight[i]` with a traced scalar `i`: one row, its start clamped into range.
        if tuple(eqn.params["slice_sizes"]) == (1, view.shape[1]):
            return "gather", ("gather", tag.key(), view.shape)
    return name, None


class Walker:
    """Walks (`analyse`) or evaluates (`evaluate`) a jaxpr, following parameter views.

    `analyse` collects every use of every tagged parameter. `evaluate` runs the
    equations and, at each site in `sites`, adds `probes[site]` to the output and
    records the other operand in `records[site]`.
    """

    def __init__(self, sites=(), probes=None):
        self.sites = set(sites)
        self.probes = probes or {}
        self.uses: list[Use] = []
        self.records: dict[tuple, Any] = {}
        self.leaf_shapes: dict[int, tuple] = {}

    def run(self, jaxpr, consts, args, tags, path=(), evaluate=True):
        env: dict = {}
        tagenv: dict = {}

        def read(v):
            return v.val if isinstance(v, Literal) else env.get(v)

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x, t in zip(jaxpr.invars, args, tags):
            env[v] = x
            if t is not None:
                tagenv[v] = t
        for i, eqn in enumerate(jaxpr.eqns):
            key = path + (i,)
            invals = [read(v) for v in eqn.invars]
            intags = [None if isinstance(v, Literal) else tagenv.get(v) for v in eqn.invars]
            name = eqn.primitive.name
            tagged = [j for j, t in enumerate(intags) if t is not None]
            outtags = [None] * len(eqn.outvars)
            sub = _sub_jaxpr(eqn) if name in CALLS else None
            if tagged and sub is not None:
                outs, outtags = self.run(sub[0], sub[1], invals, intags, key, evaluate)
            else:
                outs = _bind(eqn, invals) if evaluate else [None] * len(eqn.outvars)
                if name == "stop_gradient":
                    pass  # no gradient flows back through it: not a use
                elif tagged and name in VIEWS and len(eqn.invars) == 1:
                    t = intags[0]
                    assert t is not None
                    outtags = [Tag(t.leaf, t.chain + (eqn,))]
                elif tagged and not evaluate:
                    self._record_uses(eqn, key, intags, tagged)
                elif key in self.sites:
                    # The other operands: the layer's input (or the token ids) first.
                    others = [x for k, x in enumerate(invals) if k != tagged[0]]
                    self.records[key] = tuple(jnp.asarray(x) for x in others)
                    outs[0] = outs[0] + self.probes[key]
            for v, x, t in zip(eqn.outvars, outs, outtags):
                if type(v).__name__ == "DropVar":
                    continue
                env[v] = x
                if t is not None:
                    tagenv[v] = t
        outvals = [read(v) for v in jaxpr.outvars]
        outtags = [None if isinstance(v, Literal) else tagenv.get(v) for v in jaxpr.outvars]
        if not path:
            for t in outtags:
                if t is not None:  # a parameter (view) returned as the loss itself
                    self.uses.append(Use(t.leaf, "output", None))
        return outvals, outtags

    def _record_uses(self, eqn, key, intags, tagged):
        if len(tagged) > 1:
            for j in tagged:
                self.uses.append(Use(intags[j].leaf, eqn.primitive.name, None))
            return
        j = tagged[0]
        tag = intags[j]
        kind, signature = _classify(eqn, j, tag, self.leaf_shapes[tag.leaf])
        site = key if signature is not None else None
        self.uses.append(Use(tag.leaf, kind, site, signature, eqn, j, tag.chain))


# --------------------------------------------------------------------------- norms


def wide(dtype):
    """`dtype` if at least 32-bit, else float32: norms are summed in it."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype("float32")


def _gram_or_direct(a, g):
    """‖aᵀg‖² for a: (T, K), g: (T, N): Σ_{t,s}(a_t·a_s)(g_t·g_s) when T² ≤ K·N, else direct."""
    t, k = a.shape
    n = g.shape[1]
    if t * t <= k * n:
        return jnp.sum((a @ a.T) * (g @ g.T))
    return jnp.sum(jnp.square(a.T @ g))


def _dot_rows(use: Use, other, g):
    """(a, g) of one dot_general site as (T, K), (T, N) in the parameter view's layout."""
    eqn, j = use.eqn, use.operand
    (lc, rc), _ = eqn.params["dimension_numbers"]
    pc = [int(d) for d in (lc if j == 0 else rc)]
    xc = [int(d) for d in (rc if j == 0 else lc)]
    xf = [d for d in range(other.ndim) if d not in xc]
    a = jnp.transpose(other, xf + xc)
    t = int(np.prod([other.shape[d] for d in xf]))
    k = int(np.prod([other.shape[d] for d in xc]))
    n_pf = use.eqn.invars[j].aval.ndim - len(pc)
    if j == 0:  # output = (parameter free dims..., other free dims...)
        g = jnp.transpose(g, list(range(n_pf, g.ndim)) + list(range(n_pf)))
    return a.reshape(t, k), g.reshape(t, -1)


def _conv_rows(use: Use, lhs, g):
    """(patches, g) of one conv site as (T, C·k), (T, O) via im2col."""
    p = use.eqn.params
    dn = p["dimension_numbers"]
    rhs_shape = use.eqn.invars[1].aval.shape
    lhs = jnp.transpose(lhs, tuple(dn.lhs_spec))  # N, C, spatial...
    g = jnp.transpose(g, tuple(dn.out_spec))  # N, O, spatial...
    filter_shape = [rhs_shape[d] for d in dn.rhs_spec[2:]]
    patches = lax.conv_general_dilated_patches(
        lhs,
        filter_shape,
        p["window_strides"],
        p["padding"],
        lhs_dilation=p["lhs_dilation"],
        rhs_dilation=p["rhs_dilation"],
        precision=lax.Precision.HIGHEST,
    )
    ck, o = patches.shape[1], g.shape[1]
    patches = jnp.moveaxis(patches, 1, -1).reshape(-1, ck)
    return patches.astype(g.dtype), jnp.moveaxis(g, 1, -1).reshape(-1, o)


def _gather_rows(use: Use, indices, g):
    """(row ids, validity, g) of one embedding-row lookup, as (T,), (T,), (T, D)."""
    p = use.eqn.params
    vocab, width = use.eqn.invars[0].aval.shape
    if use.eqn.primitive.name == "dynamic_slice":
        rows = jnp.clip(jnp.reshape(indices, (1,)), 0, vocab - 1)
        return rows, jnp.ones((1,), bool), g.reshape(1, width)
    dn = p["dimension_numbers"]
    offset = list(dn.offset_dims)
    batch = [d for d in range(g.ndim) if d not in offset]
    g = jnp.transpose(g, batch + offset).reshape(-1, width)
    idx = indices.reshape(-1, indices.shape[-1])
    rows = idx[:, list(dn.start_index_map).index(0)]
    valid = jnp.ones(rows.shape, bool)
    if "CLIP" in str(p["mode"]):
        rows = jnp.clip(rows, 0, vocab - 1)
    else:
        valid = (rows >= 0) & (rows < vocab)
        if 1 in dn.start_index_map:
            valid = valid & (idx[:, list(dn.start_index_map).index(1)] == 0)
    return rows, valid, g


def leaf_sq_norm(uses: list[Use], records: dict, probe_grads: dict):
    """Squared norm of one example's gradient of a parameter whose uses are all sites."""
    kind = uses[0].kind
    if kind == "gather":
        parts = [_gather_rows(u, records[u.site][0], probe_grads[u.site]) for u in uses]
        rows = jnp.concatenate([r for r, _, _ in parts])
        valid = jnp.concatenate([v for _, v, _ in parts])
        g = jnp.concatenate([x for _, _, x in parts])
        g = jnp.where(valid[:, None], g, jnp.zeros((), g.dtype))
        vocab, width = uses[0].eqn.invars[0].aval.shape
        if rows.shape[0] ** 2 <= vocab * width:
            same = (rows[:, None] == rows[None, :]).astype(g.dtype)
            return jnp.sum(same * (g @ g.T))
        return jnp.sum(jnp.square(jax.ops.segment_sum(g, rows, vocab)))
    rows = _dot_rows if kind == "dot" else _conv_rows
    parts = [rows(u, records[u.site][0], probe_grads[u.site]) for u in uses]
    a = jnp.concatenate([x for x, _ in parts]).astype(wide(parts[0][1].dtype))
    g = jnp.concatenate([x for _, x in parts]).astype(a.dtype)
    return _gram_or_direct(a, g)


def leaf_grad(uses: list[Use], leaf, records: dict, probe_grads: dict, weights):
    """Σ_i w_i · (example i's gradient of a parameter whose uses are all sites).

    Each site is linear in the parameter, so this is the transpose of the site, batched over
    the examples with the parameter shared, at the output gradients scaled by `w_i`: the
    weight gradient of a backward pass, from what the first backward pass already gave.
    """

    def total(p):
        out = jnp.zeros((), wide(leaf.dtype))
        for u in uses:
            view = p
            for eqn in u.tag_chain:
                (view,) = _bind(eqn, [view])

            def apply(*others, u=u, view=view):
                operands = list(others)
                operands.insert(u.operand, view)
                return _bind(u.eqn, operands)[0]

            y = jax.vmap(apply)(*records[u.site])
            g = probe_grads[u.site]
            g = g * weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)
            out = out + jnp.sum(y * lax.stop_gradient(g)).astype(out.dtype)
        return out

    return jax.grad(total)(leaf)

"""The computation behind `jhooks.clipped_grad`: plan, one forward and backward pass, norms,
the weighted sum."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp

from ._norms import leaf_grad, leaf_sq_norm, plan_leaf, wide
from ._sites import Use, by_region
from ._taps import Tap, can_pair
from ._walk import Tag, Walker, pack, unpack

# Uses whose per-example gradient is no larger than the activation they meet (a bias, a
# LayerNorm scale, a ViT's class token joined to the patches): per-example gradients for
# these are the rule, not a fallback.
ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "neg", "max", "min", "add_any", "select_n", "concatenate"}
)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def plan(uses: list[Use], leaves: list, paths: list[str], size: int):
    """`(ghost, by_axes, per_example)`: the parameters with a ghost rule (their sites, and
    whether tied sites are aligned on the matrix's axes) and the rest; warns for every
    parameter whose per-example gradients cost more than the activations it meets."""
    by_leaf: dict[int, list[Use]] = collections.defaultdict(list)
    for use in uses:
        by_leaf[use.leaf].append(use)
    ghost: dict[int, list[Use]] = {}
    by_axes: dict[int, bool] = {}
    per_example: list[int] = []
    costly: list[str] = []
    for leaf, leaf_uses in sorted(by_leaf.items()):
        ok, axes, why = plan_leaf(leaf_uses)
        if ok:
            ghost[leaf], by_axes[leaf] = leaf_uses, axes
            continue
        per_example.append(leaf)
        if all(u.kind in ELEMENTWISE and u.meets_example for u in leaf_uses):
            continue  # a bias, a scale: the rule
        x = leaves[leaf]
        cost = size * x.size * x.dtype.itemsize
        costly.append(
            f"{paths[leaf]} (used by {why or ', '.join(sorted({u.label for u in leaf_uses}))}): "
            f"{_bytes(cost)} ({size} x {x.dtype.name}{list(x.shape)})"
        )
    if costly:
        warnings.warn(
            "clipped_grad: no ghost-norm rule for these parameters, so their per-example "
            "gradients are materialised (batch size x parameter size): " + "; ".join(costly),
            stacklevel=4,
        )
    return ghost, by_axes, per_example


def clipped(
    per_example_loss: Callable,
    max_norms: Any,
    group_of: Callable[[str], Any] | None,
    weigh: Callable,
    in_axes: tuple,
    model: Any,
    batch: tuple,
    padding: Any,
    passes: int | None = None,
):
    """`(grads, norms)`: see `clipped_grad`. `max_norms[group]`, the clipping norm of a
    group (`None` without groups); `weigh(norms, max_norm)` the examples' weights;
    `passes`, the backward passes asked for (`None`: see `two_passes`)."""
    dyn, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(dyn)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dyn)[0]]
    groups = [None if group_of is None else group_of(p) for p in paths]
    example_axes = tuple(in_axes[1:])
    # Batch leaves that are not arrays (a Python float, a string) stay Python values.
    batch, batch_static = eqx.partition(tuple(batch), eqx.is_array)

    # One example's shapes, from vmap itself (so in_axes errors are vmap's).
    captured = {}

    def capture(*example):
        captured["avals"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example)
        return jnp.zeros(())

    size = jax.eval_shape(jax.vmap(capture, in_axes=example_axes), *batch).shape[0]
    example_avals = captured["avals"]

    def flat_loss(params, *example):
        m = eqx.combine(jax.tree.unflatten(treedef, params), static)
        return per_example_loss(m, *eqx.combine(example, batch_static))

    leaf_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    closed = jax.make_jaxpr(flat_loss)(leaf_avals, *example_avals)
    (out_aval,) = closed.out_avals if len(closed.out_avals) == 1 else (None,)
    if out_aval is None or out_aval.shape != () or not jnp.issubdtype(out_aval.dtype, jnp.inexact):
        got = ", ".join(str(a) for a in closed.out_avals)
        raise ValueError(
            "clipped_grad: per_example_loss must return a scalar (shape ()) of a float dtype "
            f"for ONE example; got {got}. It is called on one example at a time (in_axes "
            "strips the batch axis): reduce over the example's positions, not the batch"
        )

    n = len(leaves)
    n_in = len(closed.jaxpr.invars)
    walker = Walker(False, leaf_shapes={i: x.shape for i, x in enumerate(leaves)})
    tags = [Tag(i) for i in range(n)] + [None] * (n_in - n)
    taints = [False] * n + [True] * (n_in - n)
    _, out_tags, _ = walker.run(closed.jaxpr, closed.consts, [None] * n_in, tags, taints)
    for t in out_tags:
        if t is not None:  # a parameter (view) returned as the loss itself
            walker.uses.append(Use(t.leaf, "output", None))
    ghost, by_axes, per_example = plan(walker.uses, leaves, paths, size)
    site_uses = {u.site: u for uses in ghost.values() for u in uses if u.site is not None}
    dtype = wide(out_aval.dtype)
    names = list(dict.fromkeys(groups))
    taps = tapped(ghost, by_axes) if two_passes(site_uses, names, passes) else {}
    sites = {s: u.operand for s, u in site_uses.items() if s not in taps}

    def probe(s: tuple, u: Use):
        loops = tuple(lp.length for lp in u.loops)
        if s in taps:  # the norm's cotangent: one scalar per application of the site
            return jnp.zeros((size, *loops), dtype)
        out = u.eqn.outvars[0].aval
        return jnp.zeros((size, *loops, *out.shape), out.dtype)

    probes = {s: probe(s, u) for s, u in site_uses.items()}
    shared = {i: leaves[i] for i in range(n) if i not in per_example}
    batched = {i: jnp.broadcast_to(leaves[i], (size, *leaves[i].shape)) for i in per_example}

    def one_example(shared, batched, probes, example):
        params = [shared[i] if i in shared else batched[i] for i in range(n)]
        w = Walker(True, sites=sites, probes=probes, taps=taps, passages=walker.passages)
        args = jax.tree.leaves((params, *example))
        run_tags = [Tag(i) if i in ghost else None for i in range(n)]
        run_tags += [None] * (len(args) - n)
        (loss,), _, _ = w.run(closed.jaxpr, closed.consts, args, run_tags)
        return loss, pack({s: w.records[s] for s in sites}, layout)

    per_batch = jax.vmap(one_example, in_axes=(None, 0, 0, example_axes))
    layout: dict = {}
    # The backward pass: output gradients at the recorded sites, norms at the tapped ones,
    # per-example gradients elsewhere.
    losses, vjp, packed = jax.vjp(
        lambda s, b, p: per_batch(s, b, p, batch), shared, batched, probes, has_aux=True
    )
    _, grads_b, probe_grads = vjp(jnp.ones_like(cast(jax.Array, losses)))
    records = unpack(packed, layout)
    losses = cast(jax.Array, losses)

    def sq_norms(records, probe_grads, grads_b):
        totals = {g: jnp.zeros((), dtype) for g in names}
        for leaf, uses in ghost.items():
            if uses[0].site in taps:  # a pair's cross term may round its sum below zero
                sq = jnp.sum(jnp.stack([jnp.sum(probe_grads[u.site]) for u in uses]))
                sq = jnp.maximum(sq, 0)
            else:
                shape, axes = leaves[leaf].shape, by_axes[leaf]
                sq = leaf_sq_norm(uses, records, probe_grads, shape, axes, dtype)
            totals[groups[leaf]] = totals[groups[leaf]] + sq.astype(dtype)
        for leaf, g in grads_b.items():
            totals[groups[leaf]] = totals[groups[leaf]] + jnp.sum(jnp.square(g.astype(dtype)))
        return totals

    sq = jax.vmap(sq_norms)(records, probe_grads, grads_b)
    norms = {g: safe_sqrt(x) for g, x in sq.items()}
    weights = {}
    for g, norm in norms.items():
        limit = jnp.asarray(max_norms[g], dtype)
        w = jnp.asarray(weigh(norm, limit), dtype)
        if padding is not None:
            w = jnp.where(jnp.asarray(padding, bool), jnp.zeros((), dtype), w)
        weights[g] = jax.lax.stop_gradient(w)
    if taps:
        # The second backward pass of the same `jax.vjp`: the gradient of Σ_i w_i loss_i
        # (one group). (A separate `jax.grad` of the loss, after the first pass, measured
        # 1.11x the plain gradient's memory instead of 1.03x on the GPT shape at batch 32.)
        (w,) = weights.values()
        weighted = _second_pass(vjp, w.astype(losses.dtype), shared)
        out = [weighted[i] if i in weighted else jnp.zeros_like(leaves[i]) for i in range(n)]
        for i, g in grads_b.items():
            out[i] = jnp.tensordot(w.astype(g.dtype), g, 1)
        return jax.tree.unflatten(treedef, out), (norms[None] if group_of is None else norms)
    # Else from the first pass: at each site, the weight gradient of a backward pass with
    # the output gradients scaled by w_i (they scale with the cotangent).
    out = []
    for i in range(n):
        w = weights[groups[i]]
        if i in ghost:
            out.append(leaf_grad(ghost[i], leaves[i], records, probe_grads, w))
        elif i in grads_b:
            out.append(jnp.tensordot(w.astype(grads_b[i].dtype), grads_b[i], 1))
        else:
            out.append(jnp.zeros_like(leaves[i]))  # not used by the loss
    grads = jax.tree.unflatten(treedef, out)
    return grads, (norms[None] if group_of is None else norms)


def _second_pass(vjp: Callable, w: jax.Array, shared: dict) -> dict:
    """`vjp(w)[0]`, the clipped sum of the shared parameters, in a branch of its own: XLA
    cannot then merge its buffers with the first pass's (the zeros a row lookup's
    gradient is scattered into, the size of the logits, were merged and kept alive from one
    pass to the next: 1.79x the plain gradient's memory on the GPT shape at batch 128,
    1.39x in a branch). The condition is true, hidden from XLA by a barrier."""
    taken = jax.lax.optimization_barrier(jnp.ones((), bool))
    return jax.lax.cond(taken, lambda: vjp(w)[0], lambda: jax.tree.map(jnp.zeros_like, shared))


def two_passes(site_uses: dict[tuple, Use], groups: list, passes: int | None) -> bool:
    """Whether the norms are computed in the backward pass and the clipped sum in a second
    one. Asked for (`passes`), or by default when a site is under a checkpoint (its
    activations are recomputed, not kept: so must the sites' records be). Either way one
    weight must serve every parameter (one group)."""
    if passes is not None:
        if passes == 2 and len(groups) > 1:
            raise ValueError(
                "clipped_grad: passes=2 needs one clipping norm for the whole model, but "
                f"groups= made {len(groups)} groups; the second backward pass weighs each "
                "example once. Use passes=1 (or None) with groups"
            )
        return passes == 2
    return len(groups) == 1 and any(u.under_checkpoint for u in site_uses.values())


def tapped(ghost: dict[int, list[Use]], by_axes: dict[int, bool]) -> dict[tuple, Tap]:
    """The sites whose norm the backward pass computes: the one site of a parameter, in
    scans that slice it (one Gram sum per slice, no cross terms), and the two sites of a
    parameter outside scans (a tied embedding; the cross term passes from one to the
    other). The others (a weight shared by a scan's iterations) keep their records."""
    taps: dict[tuple, Tap] = {}
    for leaf, uses in ghost.items():
        regions = by_region(uses)  # a slice of the parameter each (one: the whole)
        if any(u.kind == "gdot" for u in uses):
            continue  # experts picked by index: the records' route
        if all(len(r) == 1 and all(lp.sliced for lp in r[0].loops) for r in regions):
            taps.update({cast(tuple, u.site): Tap(u) for u in uses})
        elif len(uses) == 2 and len(regions) == 1:
            first, second = sorted(uses, key=lambda u: cast(tuple, u.site))
            if can_pair(first, second, by_axes[leaf]):
                taps[cast(tuple, first.site)] = Tap(first, by_axes[leaf], pairs=True)
                taps[cast(tuple, second.site)] = Tap(second, by_axes[leaf], first=first)
    return taps


def safe_sqrt(x):
    """`sqrt(x)` for `x >= 0`, 0 (and a zero gradient, not an infinite one) at `x <= 0`."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1)), 0)


def weigh_fn(clipping: Any) -> Callable:
    """The examples' weights from their norms: `clipping` by name, or the callable."""
    if callable(clipping):
        return clipping
    if clipping == "hard":
        # min(1, c / norm), with no division by a zero norm
        return lambda norm, c: c / jnp.maximum(norm, c)
    if clipping == "automatic":  # fastDP's AUTO-S, stability constant 0.01
        return lambda norm, c: c / (norm + 0.01)
    if clipping == "normalize":  # fastDP's AUTO-V; a zero gradient stays zero
        return lambda norm, c: jnp.where(norm > 0, c / jnp.where(norm > 0, norm, 1), 0)
    raise ValueError(
        f"clipped_grad: clipping must be 'hard', 'automatic', 'normalize' or a function "
        f"(norms, max_norm) -> weights; got {clipping!r}"
    )

"""`jhooks.clipped_grad`: per-example gradient clipping without per-example gradients."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp

from .._modules import framework_of
from . import _rules as R

_GHOST_KINDS = ("dot", "conv", "gather")


def _plan(uses: list[R.Use], n_leaves: int):
    """Splits the parameters into ghost ones (every use a site of one signature) and the rest."""
    by_leaf: dict[int, list[R.Use]] = collections.defaultdict(list)
    for use in uses:
        by_leaf[use.leaf].append(use)
    ghost: dict[int, list[R.Use]] = {}
    per_example: list[int] = []
    costly: dict[int, list[str]] = {}
    for leaf in range(n_leaves):
        leaf_uses = by_leaf.get(leaf, [])
        if not leaf_uses:
            continue  # unused: a zero gradient for every example
        signatures = {u.signature for u in leaf_uses}
        if leaf_uses[0].kind in _GHOST_KINDS and len(signatures) == 1 and None not in signatures:
            ghost[leaf] = leaf_uses
            continue
        per_example.append(leaf)
        kinds = sorted({u.kind for u in leaf_uses})
        if any(k not in R.ELEMENTWISE for k in kinds):
            costly[leaf] = kinds
    return ghost, per_example, costly


def _check_in_axes(in_axes, n_args):
    if not isinstance(in_axes, tuple | list):
        raise TypeError(
            "clipped_grad: in_axes must be a tuple with one entry per argument of the returned "
            f"function, (None, 0, 0) for (model, xs, ys); got {in_axes!r}"
        )
    if len(in_axes) != n_args:
        raise ValueError(
            f"clipped_grad: in_axes={tuple(in_axes)!r} has {len(in_axes)} entries but the "
            f"function was called with {n_args} arguments (the model and {n_args - 1} batch "
            "arguments); expected one entry per argument"
        )
    if in_axes[0] is not None:
        raise ValueError(
            "clipped_grad: in_axes[0] must be None: the model is shared by every example "
            f"(got {in_axes[0]!r})"
        )
    if not jax.tree.leaves(tuple(in_axes[1:])):
        raise ValueError(
            f"clipped_grad: in_axes={tuple(in_axes)!r} batches no argument; expected an integer "
            "axis (e.g. 0) for at least one batch argument, the axis that indexes the examples"
        )


def clipped_grad(
    per_example_loss: Callable[..., Any],
    max_norm: float,
    *,
    in_axes: tuple = (None, 0, 0),
) -> Callable[..., tuple[Any, jax.Array]]:
    """Per-example clipped gradients, summed, without ever holding a per-example gradient.

    PyTorch: Opacus' `GradSampleModule(model, grad_sample_mode="ghost")` ("ghost clipping"),
    the core of DP-SGD. With `g_i` the gradient of example `i`'s loss with respect to all
    the parameters:

    - `norms[i] = ‖g_i‖₂`, the global L2 norm over every inexact array leaf of `model`
      (the leaves `eqx.filter_grad` differentiates);
    - `grads = Σ_i g_i · min(1, max_norm / norms[i])`, shaped like `eqx.filter_grad`'s
      result (`None` where a leaf is not an inexact array).

    Add Gaussian noise to `grads` and divide by the batch size for DP-SGD.

    **How.** One forward pass and one backward pass. The per-example loss is traced to a
    jaxpr once. Every use of a parameter by a matrix product (`eqx.nn.Linear`, the
    projections of `eqx.nn.MultiheadAttention`), a convolution (`eqx.nn.Conv1d/2d/3d`) or a
    row lookup (`eqx.nn.Embedding`) becomes a *site*: the loss is evaluated per example with
    a zero probe added to each site's output and the site's input recorded, so the backward
    pass gives every site's output gradient `g` and input `a`, per example (the weight
    gradients themselves are not formed). A weight's per-example squared gradient norm is
    then `Σ_{t,s} (a_t·a_s)(g_t·g_s)` over the positions `t, s` at which it was applied
    (tokens; pixels, through im2col; repeated calls of the same layer add positions), or
    `‖aᵀg‖²` when that is cheaper (`T² > K·N`); for an embedding,
    `Σ_{t,s} [i_t = i_s] (g_t·g_s)`. Every other parameter (biases, LayerNorm's scale and
    offset, a positional array) gets exact per-example gradients, no larger than the
    activation it is added to or multiplies. Then, with the stopped weights
    `w_i = min(1, max_norm / norms[i])`, the gradient of `Σ_i w_i · loss_i`: since a
    per-example output gradient scales with its example's loss weight, each site's weight
    gradient is the transpose of the site at the output gradients `w_i · g_i`, batched over
    the examples with the weight shared (the weight-gradient step of a backward pass; no
    second backward pass, unlike Opacus). The result is exact:
    `jax.vmap(eqx.filter_grad(...))` then clipping, up to rounding.

    A parameter used in any other way (a matrix product inside `lax.scan` or a
    `custom_jvp`, a weight used by two kinds of operation such as a tied embedding, a
    grouped convolution) falls back to per-example gradients for that parameter alone, and
    a `UserWarning` names it. Jit the returned function: under `jax.jit` XLA drops what is
    not needed (the weight gradients of the backward pass); eagerly, nothing is dropped.

    **Arguments:**

    - `per_example_loss`: `per_example_loss(model, *example) -> scalar`, the loss of ONE
      example. It may call layers under `jax.vmap` (over tokens, say).
    - `max_norm`: the clipping norm `C > 0` (a number, or a traced scalar).
    - `in_axes`: as `jax.vmap`'s, one entry per argument of the returned function; the
      model's entry must be `None`, and at least one batch argument must be batched.

    **Returns:**

    A function `(model, *batch) -> (grads, norms)`: `grads` like `eqx.filter_grad(...)(model,
    ...)`, `norms` of shape `(batch_size,)`, the unclipped per-example gradient norms.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, jhooks

    model = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(0))

    def loss(model, x, y):
        return jnp.sum((model(x) - y) ** 2)

    xs, ys = jnp.ones((8, 4)), jnp.zeros((8, 2))
    grads, norms = eqx.filter_jit(jhooks.clipped_grad(loss, max_norm=1.0))(model, xs, ys)
    assert norms.shape == (8,)
    ```
    """
    _check_max_norm(max_norm)
    in_axes = tuple(in_axes) if isinstance(in_axes, list) else in_axes

    def clipped(model, *batch):
        _check_in_axes(in_axes, 1 + len(batch))
        framework = framework_of(model)
        if framework is not None:
            # A Flax NNX model: its `nnx.Param`s are differentiated, as by `nnx.grad`.
            params, rebuild = framework.differentiable(model)

            def params_loss(params, *example):
                return per_example_loss(rebuild(params), *example)

            return _clipped(params_loss, max_norm, in_axes, params, batch)
        return _clipped(per_example_loss, max_norm, in_axes, model, batch)

    return clipped


def _check_max_norm(max_norm):
    try:
        value = float(max_norm)
    except jax.errors.ConcretizationTypeError:
        return  # traced: cannot be checked before it runs
    except (TypeError, ValueError):
        raise TypeError(f"clipped_grad: max_norm must be a number > 0; got {max_norm!r}") from None
    if not value > 0:
        raise ValueError(f"clipped_grad: max_norm must be a number > 0; got {max_norm!r}")


def _clipped(per_example_loss, max_norm, in_axes, model, batch):
    dyn, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(dyn)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dyn)[0]]
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

    walker = R.Walker()
    walker.leaf_shapes = {i: x.shape for i, x in enumerate(leaves)}
    n = len(leaves)
    tags = [R.Tag(i) for i in range(n)] + [None] * (len(closed.jaxpr.invars) - n)
    walker.run(closed.jaxpr, closed.consts, [None] * len(tags), tags, evaluate=False)
    ghost, per_example, costly = _plan(walker.uses, n)
    if costly:
        names = "; ".join(f"{paths[i]} (used by {', '.join(k)})" for i, k in costly.items())
        warnings.warn(
            "clipped_grad: no ghost-norm rule for these parameters, so their per-example "
            f"gradients are materialised (batch_size x parameter size): {names}",
            stacklevel=3,
        )
    sites = [u.site for leaf in ghost for u in ghost[leaf] if u.site is not None]
    site_avals = {}
    for leaf in ghost:
        for u in ghost[leaf]:
            site_avals[u.site] = u.eqn.outvars[0].aval
    probes = {s: jnp.zeros((size, *a.shape), a.dtype) for s, a in site_avals.items()}
    shared = {i: leaves[i] for i in range(n) if i not in per_example}
    batched = {i: jnp.broadcast_to(leaves[i], (size, *leaves[i].shape)) for i in per_example}

    def one_example(shared, batched, probes, example):
        params = [shared[i] if i in shared else batched[i] for i in range(n)]
        w = R.Walker(sites, probes)
        args = jax.tree.leaves((params, *example))
        run_tags = [R.Tag(i) if i in ghost else None for i in range(n)]
        run_tags += [None] * (len(args) - n)
        (loss,), _ = w.run(closed.jaxpr, closed.consts, args, run_tags)
        return loss, {s: w.records[s] for s in sites}

    per_batch = jax.vmap(one_example, in_axes=(None, 0, 0, example_axes))
    losses, vjp, records = jax.vjp(
        lambda s, b, p: per_batch(s, b, p, batch), shared, batched, probes, has_aux=True
    )
    losses = cast(jax.Array, losses)
    # Backward pass 1: output gradients at the sites, per-example gradients elsewhere.
    _, grads_b, probe_grads = vjp(jnp.ones_like(losses))
    norm_dtype = R.wide(losses.dtype)

    def sq_norm(records, probe_grads, grads_b):
        total = jnp.zeros((), norm_dtype)
        for uses in ghost.values():
            total = total + R.leaf_sq_norm(uses, records, probe_grads).astype(norm_dtype)
        for g in grads_b.values():
            total = total + jnp.sum(jnp.square(g.astype(norm_dtype)))
        return total

    norms = jnp.sqrt(jax.vmap(sq_norm)(records, probe_grads, grads_b))
    limit = jnp.asarray(max_norm, norm_dtype)
    weights = jax.lax.stop_gradient(jnp.minimum(1, limit / norms))
    # The gradient of Σ_i w_i loss_i: at each site, the weight gradient of a backward pass
    # with the output gradients of pass 1 scaled by w_i (they scale with the cotangent).
    out = []
    for i in range(n):
        if i in ghost:
            out.append(R.leaf_grad(ghost[i], leaves[i], records, probe_grads, weights))
        elif i in grads_b:
            out.append(jnp.tensordot(weights.astype(grads_b[i].dtype), grads_b[i], 1))
        else:
            out.append(jnp.zeros_like(leaves[i]))  # not used by the loss
    grads = jax.tree.unflatten(treedef, out)
    return grads, norms

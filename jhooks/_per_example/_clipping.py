"""`jhooks.clipped_grad`: per-example gradient clipping without per-example gradients."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax

from .._modules import framework_of
from ._ghost import clipped as _run
from ._ghost import weigh_fn


def _check_in_axes(in_axes, n_args):
    if not isinstance(in_axes, tuple | list):
        raise TypeError(
            "clipped_grad: in_axes must be a tuple with one entry per argument of the returned "
            f"function, (None, 0, 0) for (model, xs, ys), or None; got {in_axes!r}"
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


def _check_inferred(in_axes: tuple, batch: tuple) -> None:
    """The inferred `in_axes` batch every argument on its first axis: their sizes must
    agree, or `jax.vmap` would refuse them with "inconsistent sizes"; say which differ."""
    leading = []  # per argument: the first-axis size of each array leaf (None: a scalar)
    for arg in batch:
        arrays = [x for x in jax.tree.leaves(arg) if eqx.is_array(x)]
        leading.append([x.shape[0] if x.ndim else None for x in arrays])
    sizes = [set(s) for s in leading if s]
    if not sizes or (
        len(sizes[0]) == 1 and None not in sizes[0] and all(s == sizes[0] for s in sizes)
    ):
        return
    first = next(iter(sizes[0]))
    described: list[str] = []
    suggested: list[int | None] = [None]
    for k, (arg, s) in enumerate(zip(batch, leading), 1):
        arrays = [x for x in jax.tree.leaves(arg) if eqx.is_array(x)]
        shapes = ", ".join(f"{x.dtype}{list(x.shape)}" for x in arrays) or "no array"
        described.append(f"argument {k}: {shapes}")
        suggested.append(0 if s and set(s) == {first} else None)
    raise ValueError(
        f"clipped_grad: in_axes was not given, so it was inferred from the call as {in_axes} "
        "(None for the model, 0 for every other argument: each batched on its first axis), "
        "but the arguments' first axes do not have one size (the batch size): "
        + "; ".join(described)
        + ". An argument shared by every example (a target, a key, a mask) or batched on "
        "another axis needs in_axes given, one entry per argument, e.g. "
        f"jhooks.clipped_grad(loss, max_norm, in_axes={tuple(suggested)})"
    )


def clipped_grad(
    per_example_loss: Callable[..., Any],
    max_norm: float | dict[Hashable, float],
    *,
    in_axes: tuple | None = None,
    clipping: str | Callable[[jax.Array, jax.Array], jax.Array] = "hard",
    groups: Callable[[str], Hashable] | None = None,
    passes: int | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """Per-example clipped gradients, summed, without ever holding a per-example gradient.

    PyTorch: Opacus' `GradSampleModule(model, grad_sample_mode="ghost")` ("ghost clipping"),
    the core of DP-SGD. With `g_i` the gradient of example `i`'s loss with respect to all
    the parameters:

    - `norms[i] = ‖g_i‖₂`, the global L2 norm over every inexact array leaf of `model`
      (the leaves `eqx.filter_grad` differentiates);
    - `grads = Σ_i g_i · w_i`, shaped like `eqx.filter_grad`'s result (`None` where a leaf
      is not an inexact array), with `w_i = min(1, max_norm / norms[i])` (`clipping="hard"`).

    Add Gaussian noise to `grads` and divide by the batch size for DP-SGD.

    **How.** The per-example loss is traced to a jaxpr once. Every use of a parameter by a
    matrix product (`eqx.nn.Linear`, the projections of `eqx.nn.MultiheadAttention`), a
    convolution (`eqx.nn.Conv1d/2d/3d`, grouped too) or a row lookup (`eqx.nn.Embedding`)
    becomes a *site*, also inside `lax.scan` (a weight shared by the iterations, or one
    slice per iteration: scan-over-layers), nested `jax.jit` and `jax.checkpoint`, and
    through a view, a scalar factor (`(0.5 * W) @ x`) or a shift (`x @ (1 + W)`). A static
    slice of a weight (`W[:, :d]`, `jnp.split(W, 3, axis=-1)`: a fused QKV weight) has
    sites of its own, its squared norm adding to the other slices'; matrices picked by
    index from a stacked weight and multiplied (`W[expert_ids]`: a mixture of experts) get
    per-expert Gram sums, `[id_t = id_s]` times the products below. A weight's per-example squared
    gradient norm is `Σ_{t,s} (a_t·a_s)(g_t·g_s)` over the positions `t, s` at which it was
    applied (tokens; pixels, through im2col; the iterations of a scan), with `a` the site's
    input and `g` its output gradient, cross terms between sites included (a tied
    embedding), or `‖Σ_t a_t ⊗ g_t‖²` when that is cheaper. Every other parameter (biases,
    LayerNorm's scale and offset, Gemma's `x * (1 + scale)`) gets exact per-example
    gradients, no larger than the activation it meets (also through an elementwise function
    of the parameter, Mamba's `exp(A_log)`, or joined to the example by `concatenate`, a
    ViT's class token).
    The clipped sum is the gradient of `Σ_i w_i · loss_i` with stopped weights `w_i`. A
    squared norm that cancels to zero, or rounds below it, gives norm 0 and weight 1.

    - Without a checkpoint: one forward and one backward pass. The backward pass gives
      every site's per-example `g` (as the cotangent of a zero probe on its output) and the
      recorded `a`; the norms follow, and each weight's clipped sum is its sites' weight
      gradient at the output gradients `w_i · g_i`, with no second backward pass.
    - When a site is under `jax.checkpoint` (and without `groups`): the norms are computed
      inside the backward pass, where `a` is recomputed and `g` arrives (a `custom_vjp`
      at each site returns its norm as a cotangent), and a second backward pass with
      cotangent `w` gives the clipped sum: the checkpoint's memory, for a second pass.

    `passes` chooses between the two routes, a trade of time for memory: `passes=1`
    keeps every site's `a` and `g` for the batch (under a checkpoint too: the memory the
    checkpoint saved is spent again), `passes=2` computes the norms in the backward pass
    and the clipped sum in a second one (on a checkpointed GPT-shaped model, about the
    plain gradient's memory and 1.7x its time); `None` picks two under a checkpoint and
    one elsewhere. A site no tap serves (a weight shared by a scan's iterations) keeps its
    `a` and `g` in either route.

    The result is exact: `jax.vmap(eqx.filter_grad(...))` then clipping, up to rounding.

    A parameter with no ghost rule (used inside `lax.cond` or a `custom_jvp`, through an
    elementwise product with an array (`(W * mask) @ x`), a function (`exp(W) @ x`), slices
    that overlap, or a normalisation (`eqx.nn.WeightNorm`)) falls back to per-example
    gradients for that parameter alone, and a `UserWarning` names it, the operations (with
    the slice, gather or function they went through), and the memory.
    Jit the returned function: under `jax.jit` XLA drops what is not needed (the weight
    gradients of the backward pass); eagerly, nothing is dropped.

    **Arguments:**

    - `per_example_loss`: `per_example_loss(model, *example) -> scalar`, the loss of ONE
      example. It may call layers under `jax.vmap` (over tokens, say).
    - `max_norm`: the clipping norm `C > 0` (a number, or a traced scalar); with `groups`,
      a number for every group or a dict from group to its norm.
    - `in_axes`: as `jax.vmap`'s, one entry per argument of the returned function; the
      model's entry must be `None`, and at least one batch argument must be batched.
      `None` (the default): inferred from the call, `None` for the model and `0` for
      every other argument, `(None, 0)` for `(model, xs)` and `(None, 0, 0)` for
      `(model, xs, ys)`. Give it for an argument shared by every example (a key, a
      mask) or batched on another axis; inferred axes whose arguments' first axes differ
      raise a `ValueError` naming each argument's shape and the `in_axes` to give.
    - `clipping`: the weight of an example from its norm `n`: `"hard"` `min(1, C / n)`;
      `"automatic"` `C / (n + 0.01)` (fastDP's automatic clipping, AUTO-S); `"normalize"`
      `C / n` (AUTO-V, 0 for a zero gradient); or a function `(norms, max_norm) -> weights`.
    - `groups`: per-layer (group) clipping: a function from a parameter's path (as
      `jax.tree_util.keystr` writes it, `".layers[0].weight"`) to its group's name; each
      group's gradient is clipped by its own norm.
    - `passes`: `1` or `2` backward passes, or `None` (the default) for two when a
      site is under `jax.checkpoint` and one elsewhere (see above). `passes=2` needs one
      group: the second pass weighs each example once.

    **Returns:**

    A function `(model, *batch, is_padding_example=None) -> (grads, norms)`: `grads` like
    `eqx.filter_grad(...)(model, ...)`, `norms` of shape `(batch_size,)`, the unclipped
    per-example gradient norms (with `groups`, a dict from group to such norms).
    `is_padding_example`, a boolean array of shape `(batch_size,)`, marks examples that
    do not count (`jax_privacy`'s name): their weight is 0.

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
    weigh = weigh_fn(clipping)
    if passes is not None and (type(passes) is not int or passes not in (1, 2)):
        raise ValueError(f"clipped_grad: passes must be 1, 2 or None; got {passes!r}")
    if groups is None or not isinstance(max_norm, dict):
        _check_max_norm(max_norm)
    else:
        for value in max_norm.values():
            _check_max_norm(value)
    given_axes = tuple(in_axes) if isinstance(in_axes, list) else in_axes

    def clipped(model, *batch, is_padding_example=None):
        # Inferred: the model shared, every other argument batched on its first axis.
        in_axes = (None,) + (0,) * len(batch) if given_axes is None else given_axes
        _check_in_axes(in_axes, 1 + len(batch))
        if given_axes is None:
            _check_inferred(in_axes, batch)
        framework = framework_of(model)
        loss = per_example_loss
        if framework is not None:
            # A Flax NNX model: its `nnx.Param`s are differentiated, as by `nnx.grad`.
            model, rebuild = framework.differentiable(model)

            def loss(params, *example):
                return per_example_loss(rebuild(params), *example)

        return _run(
            loss,
            _MaxNorms(max_norm, groups is not None),
            groups,
            weigh,
            in_axes,
            model,
            batch,
            is_padding_example,
            passes,
        )

    return clipped


class _MaxNorms:
    """The clipping norm of each group."""

    def __init__(self, max_norm: Any, grouped: bool):
        self.max_norm, self.grouped = max_norm, grouped

    def __getitem__(self, group: Hashable) -> Any:
        if self.grouped and isinstance(self.max_norm, dict):
            if group not in self.max_norm:
                raise ValueError(
                    f"clipped_grad: max_norm has no entry for group {group!r}; it has "
                    f"{', '.join(sorted(map(repr, self.max_norm)))}. Give one per group."
                )
            return self.max_norm[group]
        return self.max_norm


def _check_max_norm(max_norm):
    try:
        value = float(max_norm)
    except jax.errors.ConcretizationTypeError:
        return  # traced: cannot be checked before it runs
    except (TypeError, ValueError):
        raise TypeError(f"clipped_grad: max_norm must be a number > 0; got {max_norm!r}") from None
    if not value > 0:
        raise ValueError(f"clipped_grad: max_norm must be a number > 0; got {max_norm!r}")

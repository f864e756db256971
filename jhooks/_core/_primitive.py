"""The one mechanism: an identity primitive whose transpose runs Python code.

`bind(leaves, rule)` returns `leaves` unchanged. In forward mode the primitive is
linear and passes tangents through untouched (hooks are a no-op there); when JAX
transposes it in the backward pass it calls `rule.transpose`, which may read or
replace the cotangents. Value hooks, multi-grad hooks, node hooks and module hooks
are all rules for this one primitive.

The rule is a parameter of the primitive, so it lives in every jaxpr JAX caches: it
holds only what is true for every call (the hooks, shapes, names), never tracers or
per-call state. What one backward pass needs to know (which operands are
differentiated, which are batched by `jax.vmap`) reaches the rule as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._emit import forward_emits, mapped_with_emits
from ._jax_compat import (
    ad,
    hold_weakly_in_caches,
    is_undefined_primal,
    mlir,
    new_primitive,
    zero_like,
)


class Level(NamedTuple):
    """One `jax.vmap` level the operands of the primitive went through."""

    mask: tuple[bool, ...]
    """Whether each operand is batched at this level (its batch dimension is then
    leading)."""
    size: int
    """The size of the mapped axis."""


# The `jax.vmap` levels the operands went through, innermost first.
Batched = tuple[Level, ...]


class BackwardRule:
    """What the primitive calls in the backward pass: subclass it.

    Rules compare by identity, and JAX's caches hold them weakly, so a rule lives as
    long as the traced program that holds it.
    """

    token: bool = False
    """Whether the last operand is a token, differentiated whenever another one is."""
    # `(name, tag)` for each value that `retain_grad` named on this rule's operands
    # inside a staged function under the `jhooks.grad` call of that tag: the harvester
    # (`_staging`) brings their gradients out (with `treedef`, the operands' structure).
    retained: Sequence[tuple[str, int]] = ()
    treedef: Any = None
    held: int = 0
    """How many operands, last, are values the rule reads rather than hooks: their
    outputs are themselves, never differentiated through the rule, and the backward
    pass gives their values to `transpose_held` (a run's hook calls' constants)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        hold_weakly_in_caches(cls)

    def transpose(self, cts: list[Any], linear: list[bool], batched: Batched) -> list[Any]:
        """Maps the cotangents of the outputs (`None` for a symbolic zero) to those of
        the inputs (`None` again for a zero). `linear[i]` says whether operand `i` is
        differentiated in this backward pass; `batched` which operands carry a
        leading batch dimension per `jax.vmap` level: map per-example code over them
        with `per_example`.

        An operand that is not differentiated (its tangent is a symbolic zero: a
        constant, an argument `jax.grad` does not differentiate, a value through
        `jax.lax.stop_gradient`) has `linear[i]` False and its cotangent `None`, as
        PyTorch's `requires_grad=False`: rules report `None` for it."""
        raise NotImplementedError

    def transpose_held(
        self, cts: list[Any], linear: list[bool], batched: Batched, held: list[Any]
    ) -> list[Any]:
        """`transpose` of a rule with `held` values: `cts` and `linear` are those of the
        other operands, `held` the values (batched as the levels of `batched` say, after
        the other operands)."""
        raise NotImplementedError


def bind(leaves: Sequence[Any], rule: BackwardRule) -> list[Any]:
    """Wraps `leaves` (a flat list of arrays) in one identity node with `rule`."""
    if not leaves:
        return []
    return hook_p.bind(*leaves, rule=rule, batched=())


def axes(mask: Sequence[bool]) -> list[int | None]:
    """`jax.vmap` axes for the operands of one level: 0 where batched, else None."""
    return [0 if b else None for b in mask]


def per_example(
    fn: Callable[..., Any], levels: Sequence[tuple[Any, Any, int]], owner: str
) -> Callable[..., Any]:
    """`fn` mapped with `jax.vmap(fn, in_axes, out_axes, axis_size=size)` for each
    `(in_axes, out_axes, size)` of `levels`, innermost level first. An output whose
    axis is None must not depend on a batched input; `owner` names the hooks in the
    error when it does. Values that hooks emit inside `fn` come back batched, leading."""
    if not levels:
        return fn
    inner = mapped_with_emits(fn)
    for in_axes, out_axes, size in levels:
        inner = jax.vmap(inner, in_axes=in_axes, out_axes=(out_axes, 0), axis_size=size)

    def mapped(*args: Any) -> Any:
        try:
            out, emitted = inner(*args)
        except ValueError as e:
            if "out_axes" not in str(e):
                raise
            raise ValueError(
                f"{owner}: under jax.vmap, a hook returned a per-example gradient for a "
                "value that is not batched (passed with in_axes=None, or closed over). "
                "Such a value is shared by every example, so its hooks see, and must "
                "return, its total gradient: compute the replacement from that gradient "
                "alone."
            ) from e
        forward_emits(emitted)
        return out

    return mapped


def _impl(*leaves: Any, rule: BackwardRule, batched: Batched) -> list[Any]:
    del rule, batched
    return list(leaves)


def _abstract_eval(*avals: Any, rule: BackwardRule, batched: Batched) -> list[Any]:
    del rule, batched
    return list(avals)


def _jvp(primals: Any, tangents: Any, *, rule: BackwardRule, batched: Batched) -> Any:
    # The primal output is wrapped again, so that a higher-order derivative, which
    # differentiates the first backward pass through this value, runs the hooks too,
    # as PyTorch's double backward does.
    out = hook_p.bind(*primals, rule=rule, batched=batched)
    if rule.held:
        return out, _held_tangents(primals, tangents, rule, batched)
    if all(type(t) is ad.Zero for t in tangents):
        return out, list(tangents)
    # An operand whose tangent is a symbolic zero is not differentiated: it enters the
    # tangent node as a constant zero, so the transpose sees it as not `linear`, and its
    # output tangent stays a symbolic zero, so no cotangent reaches it: rules tell hooks
    # `None` for it, as PyTorch does for a tensor that does not require grad.
    # A rule with `token` set gets its last output differentiated whenever any operand
    # is: it tells a later node whether this one is reached (see `_backward_hooks`).
    out_tangents = hook_p.bind(*map(ad.instantiate_zeros, tangents), rule=rule, batched=batched)
    zero = [type(t) is ad.Zero for t in tangents]
    if rule.token:
        zero[-1] = False
    return out, [t if z else o for t, z, o in zip(tangents, zero, out_tangents)]


def _held_tangents(primals: Any, tangents: Any, rule: BackwardRule, batched: Batched) -> list:
    # The tangent node holds the values themselves (not their tangents), so that the
    # backward pass reads them; their own tangents pass by it, unchanged.
    n = len(primals) - rule.held
    if all(type(t) is ad.Zero for t in tangents[:n]):
        return list(tangents)
    ins = [*map(ad.instantiate_zeros, tangents[:n]), *primals[n:]]
    out = hook_p.bind(*ins, rule=rule, batched=batched)
    return [*(t if type(t) is ad.Zero else o for t, o in zip(tangents[:n], out)), *tangents[n:]]


def _transpose(cotangents: Any, *leaves: Any, rule: BackwardRule, batched: Batched) -> list[Any]:
    cts = [None if type(ct) is ad.Zero else ct for ct in cotangents]
    linear = [is_undefined_primal(leaf) for leaf in leaves]
    if rule.held:
        n = len(leaves) - rule.held
        held = [None if b else x for x, b in zip(leaves[n:], linear[n:])]
        new = [*rule.transpose_held(cts[:n], linear[:n], batched, held), *[None] * rule.held]
    else:
        new = rule.transpose(cts, linear, batched)
    out = []
    for leaf, ct in zip(leaves, new):
        if not is_undefined_primal(leaf):
            out.append(None)
        elif ct is None:
            out.append(zero_like(leaf))
        else:
            out.append(ct)
    return out


def _batch(args: Any, dims: Any, *, rule: BackwardRule, batched: Batched) -> Any:
    # Hooks see per-example values: the batch dimension goes to the front of every
    # batched operand and the backward pass maps the rule over it. An operand that
    # is not batched (a parameter under `in_axes=None`) stays whole, so its hooks see
    # its total gradient, as the one shared value it is.
    moved = [x if d is None or d == 0 else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    mask = tuple(d is not None for d in dims)
    size = next(x.shape[0] for x, b in zip(moved, mask) if b)
    out = hook_p.bind(*moved, rule=rule, batched=(*batched, Level(mask, size)))
    return out, axes(mask)


hook_p = new_primitive("jhooks_hook", _impl, _abstract_eval, _jvp, _transpose, _batch)
mlir.register_lowering(hook_p, mlir.lower_fun(lambda *xs, **_: list(xs), multiple_results=True))

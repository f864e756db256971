"""The one mechanism: an identity primitive whose transpose runs Python code.

`bind(leaves, rule)` returns `leaves` unchanged. In forward mode the primitive is
linear and passes tangents through untouched (hooks are a no-op there); when JAX
transposes it in the backward pass it calls `rule.backward(cotangents)`, which may
read or replace them. Value hooks, multi-grad hooks, node hooks and module hooks
are all rules for this one primitive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


class BackwardRule(Protocol):
    """What the primitive calls in the backward pass."""

    def transpose(self, cotangents: list[Any], vmap_levels: int) -> list[Any]:
        """Maps the cotangents of the outputs (`None` for a symbolic zero) to those of
        the inputs (`None` again for a zero). Each cotangent has `vmap_levels` leading
        batch dimensions: map per-example code over them with `vmapped`."""

    def differentiated(self) -> None:
        """Called when the forward pass is differentiated (a non-zero tangent)."""


def vmapped(fn: Callable, levels: int) -> Callable:
    """`fn` mapped over `levels` leading batch dimensions of every argument."""
    for _ in range(levels):
        fn = jax.vmap(fn)
    return fn


hook_p = Primitive("jhooks_hook")
hook_p.multiple_results = True


def bind(leaves: Sequence[Any], rule: BackwardRule) -> list[Any]:
    """Wraps `leaves` (a flat list of arrays) in one identity node with `rule`."""
    if not leaves:
        return []
    return hook_p.bind(*leaves, rule=rule, vmap_levels=0)


@hook_p.def_impl
def _impl(*leaves, rule, vmap_levels):
    del rule, vmap_levels
    return list(leaves)


@hook_p.def_abstract_eval
def _abstract_eval(*avals, rule, vmap_levels):
    del rule, vmap_levels
    return list(avals)


def _lowering(ctx, *values, rule, vmap_levels):
    del ctx, rule, vmap_levels
    return [[v] for v in values]


mlir.register_lowering(hook_p, _lowering)


def _jvp(primals, tangents, *, rule, vmap_levels):
    if all(type(t) is ad.Zero for t in tangents):
        return list(primals), list(tangents)
    rule.differentiated()
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return list(primals), hook_p.bind(*tangents, rule=rule, vmap_levels=vmap_levels)


ad.primitive_jvps[hook_p] = _jvp


def _transpose(cotangents, *leaves, rule, vmap_levels):
    cts = [None if type(ct) is ad.Zero else ct for ct in cotangents]
    new = cts if all(ct is None for ct in cts) else rule.transpose(cts, vmap_levels)
    out = []
    for leaf, ct in zip(leaves, new):
        if not ad.is_undefined_primal(leaf):
            out.append(None)
        elif ct is None:
            out.append(ad.Zero(leaf.aval.to_tangent_aval()))
        else:
            out.append(ct)
    return out


ad.primitive_transposes[hook_p] = _transpose


def _batch(leaves, dims, *, rule, vmap_levels):
    # Hooks must see per-example values, so the batch dimension goes to the front of
    # every leaf and the backward pass maps the rule over it.
    size = next(x.shape[d] for x, d in zip(leaves, dims) if d is not None)
    front = []
    for x, d in zip(leaves, dims):
        if d is None:
            front.append(jnp.broadcast_to(x, (size, *jnp.shape(x))))
        else:
            front.append(jnp.moveaxis(x, d, 0))
    out = hook_p.bind(*front, rule=rule, vmap_levels=vmap_levels + 1)
    return out, [0] * len(out)


batching.primitive_batchers[hook_p] = _batch

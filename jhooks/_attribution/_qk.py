"""AtP*'s exact attention softmax (Kramar et al. 2024, the "QK fix"), for the nodes that
make the attention scores: the scores themselves, queries and keys.

The metric's dependence on a score through the softmax is where AtP's linear estimate
fails (a saturated softmax has a vanishing gradient). AtP* recomputes the softmax
exactly with the node patched and propagates the change of the pattern linearly, through
the gradient at the pattern (`G`):

- a score `[..., q, t]`: row `q` of the corrupted scores with that entry patched;
- a query at position `p` (and head): row `p` of the scores, recomputed from the patched
  query, changes as a whole;
- a key at position `p` (and head): column `p` of the scores changes; each row's
  softmax is recomputed with its one entry patched, and the rows' changes add up.

The scores with a query (key) node patched come from one run of the corrupted input with
that node patched everywhere: row (column) `p` of head `h` depends on the query (key) at
position `p` and head `h` alone, so that run holds every position's patched scores at
once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._caches import activations
from ._layers import QK, patched_whole
from ._plan import Plan


def query_key_scores(
    plan: Plan,
    fn: Callable,
    corrupt: Any,
    clean_values: dict,
    values: dict,
    grads: dict,
    atp: dict,
) -> dict:
    """AtP*'s scores of the query and key nodes of `plan` among `atp` (their AtP scores).

    **Arguments:**

    - `plan`: its `queries` and `keys` map nodes to scores points, its `softmax` the
        scores points to their patterns.
    - `fn`, `corrupt`: the function and the corrupted input.
    - `clean_values`: the clean run's values; `values`, `grads`: the corrupted run's
        values and the metric's gradients there.
    - `atp`: the AtP scores of the nodes (their shapes are the scores').

    **Returns:**

    A dict from each query or key node among `atp` to its scores.
    """
    pattern = dict(plan.softmax)
    scores = {}
    for role, exact_of, nodes in (
        ("query", query_exact, plan.queries),
        ("key", key_exact, plan.keys),
    ):
        for n, s in nodes:
            if n not in atp:
                continue
            if not isinstance(values[n], jax.Array):
                raise TypeError(
                    f"attribution(method='atp*'): the {role} node {n!r} must be one "
                    f"array, got {jax.tree.structure(values[n])}."
                )
            # The corrupted run with the node patched everywhere: each position's row
            # (query) or column (key) of the scores, as if patched alone.
            patch = [(n, lambda value, name, n=n: patched_whole(clean_values[n], value, n, QK))]
            patched = activations(fn, corrupt, [s], fwd_hooks=patch)[s]
            effect = exact_of(patched, values[s], grads[pattern[s]])
            where = (s, tuple(values[s].shape))
            scores[n] = per_position(effect, jnp.shape(atp[n]), role, n, where)
    return scores


def softmax_exact(clean_scores: jax.Array, scores: jax.Array, pattern_grad: jax.Array) -> jax.Array:
    """AtP*'s attention-score term: each score element patched alone, the softmax (over
    the last axis) recomputed exactly, times the gradient at the pattern.

    **Arguments:**

    - `clean_scores`, `scores`: the attention scores (before the softmax) of the clean
        (or patched) and the corrupted run, `[..., query, key]`.
    - `pattern_grad`: the metric's gradient at `softmax(scores, axis=-1)` in the
        corrupted run.

    **Returns:**

    `[..., query, key]`: element `[..., q, t]` is `sum_j (A'_qj - A_qj) G_qj` with `A` the
    softmax of the corrupted row `q` and `A'` that of the same row whose entry `t` takes
    its clean value. Costs `O(key**2)` per row.
    """
    delta = clean_scores - scores
    delta = jnp.where(jnp.isfinite(delta), delta, 0.0)  # masked entries (-inf in both runs)
    keys = scores.shape[-1]
    eye = jnp.eye(keys, dtype=scores.dtype)
    # patched[..., q, t, j]: row q with entry t moved by delta[..., q, t].
    patched = scores[..., None, :] + delta[..., :, None] * eye
    change = jax.nn.softmax(patched, axis=-1) - jax.nn.softmax(scores, axis=-1)[..., None, :]
    effect = jnp.einsum("...tj,...j->...t", change, pattern_grad)
    # An entry left as it was changes nothing: exactly 0 (XLA may round two softmaxes of
    # the same row differently).
    return jnp.where(delta == 0, 0.0, effect)


def query_exact(patched_scores: jax.Array, scores: jax.Array, pattern_grad: jax.Array) -> jax.Array:
    """The queries' term: `[..., query]`, `sum_j (softmax(S'_q)_j - softmax(S_q)_j) G_qj`
    for each row `q`, `S'` the scores with the queries patched."""
    change = jax.nn.softmax(patched_scores, axis=-1) - jax.nn.softmax(scores, axis=-1)
    effect = jnp.sum(change * pattern_grad, axis=-1)
    return jnp.where(jnp.any(patched_scores != scores, axis=-1), effect, 0.0)


def key_exact(patched_scores: jax.Array, scores: jax.Array, pattern_grad: jax.Array) -> jax.Array:
    """The keys' term: `[..., key]`, for each key `t` the rows' exact changes with entry
    `t` taken from `S'` (the scores with the keys patched), summed over the rows."""
    return jnp.sum(softmax_exact(patched_scores, scores, pattern_grad), axis=-2)


def per_position(
    effect: jax.Array, shape: tuple[int, ...], role: str, node: str, scores: tuple[str, tuple]
) -> jax.Array:
    """A query's or key's effect `[*heads, position]` laid out as its node's scores.

    **Arguments:**

    - `effect`: `query_exact`'s or `key_exact`'s result.
    - `shape`: the shape of the node's AtP scores (its value summed over `sum_axes`):
        `[position, *heads]` (a node `[position, *heads, features]` summed over the
        features), `[position]` (heads summed) or `()` (everything summed).
    - `role`, `node`, `scores`: for the error: `"query"` or `"key"`, the node's name, the
        scores point's name and shape.

    **Returns:**

    The effect in `shape`. Raises `ValueError` for any other shape.
    """
    moved = jnp.moveaxis(effect, -1, 0)
    if moved.shape == shape:
        return moved
    if shape == moved.shape[:1]:
        return jnp.sum(moved, axis=tuple(range(1, moved.ndim)))
    if shape == ():
        return jnp.sum(moved)
    name, scores_shape = scores
    raise ValueError(
        f"attribution(method='atp*'): the {role} node {node!r} has scores of shape "
        f"{shape} (its value summed over sum_axes), but its scores point {name!r} "
        f"{scores_shape} gives one score per {role} position and head, {moved.shape}: "
        "a query or key node must be laid out [position, *heads, features] and its "
        "scores [*heads, query, key] (TransformerLens' hook_q, hook_k and "
        "hook_attn_scores), its features summed (sum_axes=(-1,), the default)."
    )

"""Integration along the path from the corrupted to the clean value.

`alphas_and_weights(steps, rule)` gives the points of the path (0 is corrupted, 1 is
clean) and their weights, by captum's names for the rules; `integrate(grad_at, ...)`
sums `weight * grad_at(alpha)` over them in a `lax.scan` over chunks of `batch_size`
points, each chunk under `jax.vmap`: the program holds one chunk of gradients at a time,
so its memory does not grow with the number of steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

RULES = ("riemann_right", "riemann_left", "riemann_middle", "riemann_trapezoid")


def alphas_and_weights(steps: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """The points `alpha` in [0, 1] of the path and their weights (summing to 1).

    **Arguments:**

    - `steps`: how many points (gradient evaluations).
    - `rule`: `"riemann_left"` (`(k - 1) / steps`, k = 1..steps: the EAP-IG
        repository's `range(0, steps)`), `"riemann_right"` (`k / steps`: its 2024 code),
        `"riemann_middle"` (`(k - 1/2) / steps`) or
        `"riemann_trapezoid"` (`k / (steps - 1)`, k = 0..steps-1, ends weighted by half).

    **Returns:**

    `(alphas, weights)`, two float32 NumPy arrays of length `steps`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"attribution: steps must be a positive int, got {steps!r}.")
    k = np.arange(steps, dtype=np.float64)
    weights = np.full(steps, 1.0 / steps)
    if rule == "riemann_right":
        alphas = (k + 1) / steps
    elif rule == "riemann_left":
        alphas = k / steps
    elif rule == "riemann_middle":
        alphas = (k + 0.5) / steps
    elif rule == "riemann_trapezoid":
        if steps < 2:
            raise ValueError("attribution: rule='riemann_trapezoid' needs steps >= 2.")
        alphas = k / (steps - 1)
        weights = np.full(steps, 1.0 / (steps - 1))
        weights[[0, -1]] /= 2
    else:
        raise ValueError(f"attribution: rule must be one of {RULES}, got {rule!r}.")
    return alphas.astype(np.float32), weights.astype(np.float32)


def integrate(grad_at: Callable[[jax.Array], Any], steps: int, rule: str, batch_size: int) -> Any:
    """`sum_k weight_k * grad_at(alpha_k)` over the path, `batch_size` points at a time.

    **Arguments:**

    - `grad_at`: `alpha -> pytree of arrays` (traced; called under `jax.vmap`).
    - `steps`, `rule`: see `alphas_and_weights`.
    - `batch_size`: how many points each iteration of the scan evaluates together
        (the last chunk is padded with points of weight 0).

    **Returns:**

    The weighted sum, shaped like `grad_at`'s result.
    """
    alphas, weights = alphas_and_weights(steps, rule)
    chunk = max(1, min(batch_size, steps))
    pad = -steps % chunk
    alphas = np.concatenate([alphas, np.zeros(pad, np.float32)]).reshape(-1, chunk)
    weights = np.concatenate([weights, np.zeros(pad, np.float32)]).reshape(-1, chunk)
    shapes = jax.eval_shape(grad_at, jnp.zeros((), jnp.float32))
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def body(total: Any, chunk_of: tuple[jax.Array, jax.Array]) -> tuple[Any, None]:
        a, w = chunk_of
        grads = jax.vmap(grad_at)(a)
        return jax.tree.map(
            lambda t, g: t + jnp.tensordot(w.astype(g.dtype), g, axes=1), total, grads
        ), None

    total, _ = jax.lax.scan(body, init, (jnp.asarray(alphas), jnp.asarray(weights)))
    return total

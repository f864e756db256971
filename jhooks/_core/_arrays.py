"""What a gradient can reach, and the zero that brings a gradient out."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_inexact_array(x: Any) -> bool:
    """Whether `x` is an array of a floating or complex dtype: what has a gradient.

    As Equinox's `eqx.is_inexact_array`: JAX and NumPy arrays and NumPy scalars, not
    Python numbers. Call `jnp.asarray` first where a Python float counts as an array.
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        x.dtype, jnp.inexact
    )


def zero_probe(like: Any) -> jax.Array:
    """A zero of `like`'s shape and dtype to add to a value whose gradient is wanted:
    the gradient with respect to the probe is the value's.

    It is a negative zero: `x + (-0.0)` is `x` for every `x`, `-0.0` included, where
    `x + 0.0` turns `-0.0` into `0.0`.
    """
    return jnp.full(like.shape, -0.0, like.dtype)

"""Cache helpers: `stack_activation` (per-layer entries stacked, as TransformerLens'
ActivationCache) and `Cast` (`run_with_cache(dtype=...)`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._core import describe
from ._select import did_you_mean


def _layer_of(key: str, name: str) -> tuple[str, int] | None:
    """`(prefix, layer)` when `key` names `name` in one layer, else `None`."""
    if "*" in name:
        pattern = "^" + re.escape(name).replace(r"\*", r"(\d+)") + "$"
        found = re.match(pattern, key)
        if found is None or len(found.groups()) != 1:
            return None
        return name, int(found.group(1))
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            rest = ".".join(parts[i + 1 :])
            if rest == name or rest.endswith("." + name):
                return ".".join(parts[:i]) + "|" + rest, int(part)
            return None
    return None


def _activation_of(key: str) -> str:
    """What follows the layer index in `key` (`"attn.hook_z"`), or `key` without one."""
    parts = key.split(".")
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[digits[0] + 1 :]) if digits else key


def stack_activation(cache: Mapping[str, Any], name: str, layer: int | None = None) -> Any:
    """Stacks one activation of every layer along a new leading axis.

    TransformerLens' `cache.stack_activation("resid_post")`, for the dict that
    [`jhooks.run_with_cache`][] returns.

    **Arguments:**

    - `cache`: a dict from point name to value.
    - `name`: which activation. Either the end of the names after their layer index
        (`"hook_resid_post"` or `"attn.hook_z"` match `"blocks.3.attn.hook_z"`: the
        first all-digit part of a name is its layer, and what follows it must be
        `name` or end with `"." + name`), or a pattern with `*` standing for the layer
        (`"blocks.*.attn.hook_z"`).
    - `layer`: stack only the layers below it (TransformerLens' `layer`); all by default.

    **Returns:**

    The values of layers `0, 1, ..., n-1` stacked along axis 0 (each leaf, for a
    pytree value).

    Raises a `ValueError` when nothing matches (listing close names), when two names
    match in one layer, or when a layer below the last is missing.

    **Example:**

    ```python
    _, cache = jhooks.run_with_cache(model, tokens, names_filter=lambda n: "resid_post" in n)
    resid = jhooks.stack_activation(cache, "hook_resid_post")  # (n_layers, seq, d_model)
    ```
    """
    if not isinstance(name, str):
        raise TypeError(f"stack_activation takes an activation name (a str), got {name!r}.")
    by_layer: dict[int, str] = {}
    prefixes: set[str] = set()
    for key in cache:
        found = _layer_of(key, name)
        if found is None:
            continue
        prefix, i = found
        if i in by_layer:
            raise ValueError(
                f"stack_activation: {name!r} matches both {by_layer[i]!r} and {key!r} in "
                f"layer {i}. Pass a longer name or a pattern such as 'blocks.*.{name}'."
            )
        by_layer[i] = key
        prefixes.add(prefix)
    if layer is not None:
        by_layer = {i: k for i, k in by_layer.items() if i < layer}
    if not by_layer:
        raise ValueError(
            f"stack_activation: no cached point of the form '<prefix>.<layer>.…{name}' "
            "in the cache. " + did_you_mean(name, map(_activation_of, cache), "activations cached")
        )
    if len(prefixes) > 1:
        raise ValueError(
            f"stack_activation: {name!r} matches points of different kinds: "
            f"{sorted(by_layer.values())[:6]}. Pass a pattern such as 'blocks.*.{name}'."
        )
    missing = [i for i in range(max(by_layer) + 1) if i not in by_layer]
    if missing:
        raise ValueError(
            f"stack_activation: {name!r} is cached for layers {sorted(by_layer)} but not for "
            f"layers {missing}; cache every layer up to the last (names_filter) to stack them."
        )
    values = [cache[by_layer[i]] for i in range(len(by_layer))]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *values)


class Cast:
    """`run_with_cache(dtype=...)`: casts the floating-point values of a cache."""

    def __init__(self, dtype: Any):
        try:
            self.dtype = None if dtype is None else jnp.dtype(dtype)
        except TypeError as err:
            raise TypeError(f"run_with_cache: dtype must be a NumPy dtype, got {dtype!r}.") from err
        if self.dtype is not None and not jnp.issubdtype(self.dtype, jnp.inexact):
            raise TypeError(
                f"run_with_cache: dtype casts floating-point activations and must be a "
                f"floating dtype, got {self.dtype.name}."
            )
        self.key = None if self.dtype is None else self.dtype.name

    def __call__(self, cache: dict[str, Any]) -> dict[str, Any]:
        if self.dtype is None:
            return cache

        def one(x: Any) -> Any:
            return x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x

        return {name: jax.tree.map(one, value) for name, value in cache.items()}


def differentiated(out: Any) -> Any:
    """What `run_with_cache(..., incl_bwd=True)` differentiates: `fn`'s output if it is
    a scalar; else, as `jax.grad(..., has_aux=True)` reads it, the first element of a
    tuple or list output (`(loss, aux)`), or the `"loss"` entry of a dict output."""
    if _scalar(out):
        return out
    if isinstance(out, (tuple, list)) and out and _scalar(out[0]):
        return out[0]
    if isinstance(out, dict) and _scalar(out.get("loss")):
        return out["loss"]
    raise ValueError(
        "run_with_cache(..., incl_bwd=True) differentiates fn's output, which must be a "
        "scalar, a tuple or list whose first element is one (`(loss, aux)`, as "
        f"jax.grad(..., has_aux=True) reads it), or a dict with a scalar 'loss'; fn returned "
        f"{describe(out)}. Return the scalar to differentiate first (a model returning "
        "`(logits, cache)`: wrap it, `lambda x: (metric(model(x)[0]), ...)`)."
    )


def _scalar(x: Any) -> bool:
    return x is not None and hasattr(x, "shape") and jnp.shape(x) == ()

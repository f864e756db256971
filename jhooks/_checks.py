"""Validation shared by every hook kind: each error names the hook and what was expected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def hook_name(hook: Any) -> str:
    """The name errors use for `hook`: its `__qualname__`, or its repr."""
    inner = getattr(hook, "__wrapped__", hook)
    return getattr(inner, "__qualname__", None) or repr(inner)


def check_callable(hook: Any, what: str = "hook") -> None:
    """Raises a `TypeError` unless `hook` is callable."""
    if not callable(hook):
        raise TypeError(
            f"{what} must be callable, got {hook!r} of type {type(hook).__name__}. "
            "Pass a function such as `lambda grad: grad * 2`."
        )


def describe(tree: Any) -> str:
    """A short description of a pytree of arrays: `f32[3,4]` or a structure of those."""

    def one(x: Any) -> str:
        if x is None:
            return "None"
        if not hasattr(x, "shape"):
            return type(x).__name__
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}".replace(" ", "")

    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
    if treedef.num_nodes == 1 and len(leaves) == 1:
        return one(leaves[0])
    return str(jax.tree.unflatten(treedef, [one(x) for x in leaves])).replace("'", "")


def check_like(hook: Callable, new: Any, old: Any, what: str, where: str = "") -> None:
    """Raises a `ValueError` unless `new` has the pytree structure, shapes and dtypes of `old`.

    `None` entries of `old` accept `None` or anything; `None` entries of `new` are
    accepted where `old` has an array only when the caller allows it (`old` None).
    """
    new_leaves, new_def = jax.tree.flatten(new, is_leaf=lambda x: x is None)
    old_leaves, old_def = jax.tree.flatten(old, is_leaf=lambda x: x is None)
    ok = new_def == old_def
    if ok:
        for n, o in zip(new_leaves, old_leaves):
            if o is None:
                continue
            if n is None or not hasattr(n, "shape") or not hasattr(n, "dtype"):
                ok = False
            elif jnp.shape(n) != jnp.shape(o) or jnp.dtype(n.dtype) != jnp.dtype(o.dtype):
                ok = False
    if not ok:
        place = f" {where}" if where else ""
        raise ValueError(
            f"hook {hook_name(hook)}{place} returned {what} {describe(new)}, expected "
            f"{describe(old)}: a hook must return None or a {what} of the same "
            "structure, shape and dtype as the one it was given."
        )

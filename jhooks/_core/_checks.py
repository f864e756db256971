"""Validation shared by every hook kind: each error names the hook and what was expected."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


def hook_name(hook: Any) -> str:
    """The name errors use for `hook`: its `__qualname__`, or its repr (for a
    `functools.partial`, its function's: not the repr of all that it holds)."""
    inner = getattr(hook, "__wrapped__", hook)
    if isinstance(inner, functools.partial):
        return f"functools.partial({hook_name(inner.func)}, ...)"
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
        if isinstance(x, eqx.nn.State):  # its repr shows nothing
            return "State"
        if not hasattr(x, "shape"):
            return type(x).__name__
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}".replace(" ", "")

    leaves, treedef = jax.tree.flatten(
        tree, is_leaf=lambda x: x is None or isinstance(x, eqx.nn.State)
    )
    if treedef.num_nodes == 1 and len(leaves) == 1:
        return one(leaves[0])
    return str(jax.tree.unflatten(treedef, [one(x) for x in leaves])).replace("'", "")


def _same_aval(new: Any, old: Any) -> bool:
    """Whether `new` is an array of `old`'s shape and dtype: the one rule for every
    value a hook returns in place of a gradient or an activation."""
    if not hasattr(new, "shape") or not hasattr(new, "dtype"):
        return False
    return jnp.shape(new) == jnp.shape(old) and jnp.dtype(new.dtype) == jnp.dtype(old.dtype)


def _same_leaf(new: Any, old: Any) -> bool:
    """An array leaf must keep its shape and dtype; a leaf that is not an array (a
    Python int or str in a module's output) may be replaced by one of its type."""
    if old is None:
        return True
    if not hasattr(old, "shape") or not hasattr(old, "dtype"):
        return not hasattr(new, "shape") and isinstance(new, type(old))
    return _same_aval(new, old)


def check_like(hook: Callable, new: Any, old: Any, what: str, where: str = "") -> Any:
    """Returns `new`, or raises a `ValueError` unless it has the pytree structure,
    shapes and dtypes of `old`.

    `None` entries of `old` accept `None` or anything; `None` entries of `new` are
    accepted where `old` has an array only when the caller allows it (`old` None).
    Leaves of `old` that are not arrays (a Python int, a str) accept a value of
    their type.
    """
    new_leaves, new_def = jax.tree.flatten(new, is_leaf=lambda x: x is None)
    old_leaves, old_def = jax.tree.flatten(old, is_leaf=lambda x: x is None)
    ok = new_def == old_def
    if ok:
        ok = all(_same_leaf(n, o) for n, o in zip(new_leaves, old_leaves))
    if not ok:
        place = f" {where}" if where else ""
        article = "an" if what[:1] in "aeiou" else "a"
        raise ValueError(
            f"hook {hook_name(hook)}{place} returned {what} {describe(new)}, expected "
            f"{describe(old)}: a hook must return None or {article} {what} of the same "
            "structure, shape and dtype as the one it was given."
        )
    return new


def check_grads(hook: Callable, new: Any, expected: Sequence[Any], what: str, owner: str) -> tuple:
    """Checks a tuple of gradients returned by a node or module hook.

    `expected` holds a `jax.ShapeDtypeStruct` per differentiable entry and `None`
    elsewhere; an entry of `new` may be `None` (no gradient) or match.
    """
    if not isinstance(new, (tuple, list)) or len(new) != len(expected):
        got = f"{len(new)} {what} entries" if isinstance(new, (tuple, list)) else describe(new)
        raise ValueError(
            f"hook {hook_name(hook)} of {owner} returned {got}, expected None or a tuple of "
            f"{len(expected)} {what} entries like {describe(tuple(expected))}."
        )
    for i, (n, e) in enumerate(zip(new, expected)):
        if n is None:
            continue
        if e is None or not _same_aval(n, e):
            want = "None (it is not differentiable)" if e is None else describe(e)
            raise ValueError(
                f"hook {hook_name(hook)} of {owner} returned {describe(n)} as {what}[{i}], "
                f"expected {want}."
            )
    return tuple(new)

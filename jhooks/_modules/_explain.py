"""Opt-in: `JHOOKS_EXPLAIN_MISSING_HOOKS=1` gives `eqx.Module` a `__getattr__` (with a
warning saying so) whose error for a `register_*` name on a module that is not hookable
says to call `jhooks.hookable` first (see `_hookable.py`)."""

from __future__ import annotations

import warnings
from typing import Any

import equinox as eqx

from ._hookable import Module

_METHODS = frozenset(name for name in vars(Module) if name.startswith("register_"))


def _missing_attribute(self: Any, name: str) -> Any:
    # Only reached when normal lookup fails: turns "'Linear' object has no attribute
    # 'register_forward_hook'" into an error that says what to call first.
    if name in _METHODS:
        raise AttributeError(
            f"{type(self).__name__}.{name}: this module is not hookable. Call "
            "`model = jhooks.hookable(model)` on the whole model first and use the model "
            "it returns (or subclass `jhooks.Module` instead of `eqx.Module`).",
            name=name,
            obj=self,
        )
    raise AttributeError(
        f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
    )


def explain_missing_hooks() -> None:
    """Gives `eqx.Module` a `__getattr__` that explains missing `register_*` methods."""
    if "__getattr__" in vars(eqx.Module):
        return
    warnings.warn(
        "JHOOKS_EXPLAIN_MISSING_HOOKS is set: jhooks gives eqx.Module a __getattr__, whose "
        "error for a register_* method on a module that is not hookable says to call "
        "jhooks.hookable. Unset it to leave Equinox's classes unchanged.",
        stacklevel=2,
    )
    eqx.Module.__getattr__ = _missing_attribute  # type: ignore[attr-defined]

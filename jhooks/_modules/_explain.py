"""The explanation of a missing `register_*` method, on by default: the first `hookable` call
(or the first `jhooks.Module` built), not `import jhooks`, gives `eqx.Module` a `__getattr__`,
reached only when normal attribute lookup fails, whose error for a `register_*` name says to
call `jhooks.hookable` first, or to use the model it returned. `JHOOKS_EXPLAIN_MISSING_HOOKS=0`
leaves Equinox's classes unchanged."""

from __future__ import annotations

import os
import weakref
from typing import Any

import equinox as eqx

# The names of the hook-registering methods of a hookable module, set when installed.
_methods: frozenset[str] = frozenset()
# The models given to `hookable` (which returns a new one), by id, for the error.
given_to_hookable: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _missing_attribute(self: Any, name: str) -> Any:
    # Only reached when normal lookup fails: turns "'Linear' object has no attribute
    # 'register_forward_hook'" into an error that says what to call first.
    if name in _methods:
        if given_to_hookable.get(id(self)) is self:
            fix = (
                "this is the model that was given to `jhooks.hookable`, which returns a new, "
                "hookable model (Equinox modules are immutable): use the model it returns, "
                "`model = jhooks.hookable(model)`."
            )
        else:
            fix = (
                "this module is not hookable. Call `model = jhooks.hookable(model)` on the "
                "whole model first and use the model it returns (or subclass `jhooks.Module` "
                "instead of `eqx.Module`)."
            )
        raise AttributeError(f"{type(self).__name__}.{name}: {fix}", name=name, obj=self)
    raise AttributeError(
        f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
    )


def explain_missing_hooks(hookable_class: type) -> None:
    """Gives `eqx.Module` a `__getattr__` that explains missing `register_*` methods (those
    of `hookable_class`), once, unless `JHOOKS_EXPLAIN_MISSING_HOOKS=0`."""
    global _methods
    if "__getattr__" in vars(eqx.Module):
        return
    if os.environ.get("JHOOKS_EXPLAIN_MISSING_HOOKS", "") == "0":
        return
    _methods = frozenset(name for name in vars(hookable_class) if name.startswith("register_"))
    eqx.Module.__getattr__ = _missing_attribute  # type: ignore[attr-defined]

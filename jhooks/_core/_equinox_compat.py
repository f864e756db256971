"""Every Equinox internal that jhooks relies on, in one place.

Equinox has no public API to build a module without running its `__init__`, to list
its dynamic fields, or to find the function inside an `eqx.filter_jit` wrapper. What
jhooks assumes of Equinox's internals (a module is a frozen dataclass whose fields live
in its `__dict__`; `filter_jit` returns a `_JitWrapper` whose `__wrapped__` is the
function; Equinox's own helper modules live under the `equinox` package) is written
here, once, so that an Equinox release that changes one of them breaks this file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax

M = TypeVar("M")

_PJIT: type = type(jax.jit(lambda: None))  # pyright: ignore[reportUnknownMemberType]


def field_values(module: eqx.Module) -> dict[str, Any]:
    """The fields set on `module` (a live dict: Equinox keeps fields in `__dict__`)."""
    return vars(module)


def dynamic_field_names(module: eqx.Module) -> list[str]:
    """The names of `module`'s fields that are pytree children (not static), set on it."""
    return [
        f.name
        for f in dataclasses.fields(module)
        if not f.metadata.get("static", False) and f.name in module.__dict__
    ]


def set_field(module: eqx.Module, name: str, value: Any) -> None:
    """Sets a field of a (frozen) module, as Equinox's own `__init__` machinery does."""
    object.__setattr__(module, name, value)


def new_module(cls: type[M], fields: dict[str, Any]) -> M:
    """A module of class `cls` with these fields, built without running `__init__`."""
    new = object.__new__(cls)
    vars(new).update(fields)
    return new


def unwrap_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function inside a `jax.jit` or `eqx.filter_jit` wrapper (`fn` if none)."""
    while type(fn) is _PJIT or type(fn).__name__ == "_JitWrapper":
        fn = fn.__wrapped__  # pyright: ignore[reportFunctionMemberAccess]
    return fn


def is_equinox_class(cls: type) -> bool:
    """Whether `cls` is defined by Equinox itself (its module is under `equinox`)."""
    module = cls.__module__ or ""
    return module == "equinox" or module.startswith("equinox.")

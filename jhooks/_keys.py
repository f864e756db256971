"""Structural keys: what makes two hooks "the same hook" for JAX's compilation caches.

Two hooks are the same when they run the same code on the same values: functions with
the same code, globals dict, defaults and closure contents; numbers compared bit for
bit (so `0.0` and `-0.0`, which compile to different programs, differ); small
concrete arrays by content; anything else (a list a hook appends to, a model) by
identity. A `lambda` written again in a loop or a notebook cell is then the same hook
and gets the compiled program of the previous one back.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import types
from collections.abc import Hashable
from typing import Any

import numpy as np
from jax.core import Tracer

# Arrays up to this many elements are compared by content, larger ones by identity.
_MAX_ARRAY_SIZE = 4096
_MAX_DEPTH = 6


class ById:
    """An object in a key, compared by identity (and kept alive with the key)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ById) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"ById({type(self.obj).__name__})"


def _number_key(x: Any) -> Hashable:
    if isinstance(x, float):
        return (float, struct.pack("<d", x))
    if isinstance(x, complex):
        return (complex, struct.pack("<dd", x.real, x.imag))
    return (type(x), x)


def _array_key(x: Any) -> Hashable | None:
    if isinstance(x, Tracer) or not hasattr(x, "shape") or x.size > _MAX_ARRAY_SIZE:
        return None
    try:
        data = np.asarray(x)
    except Exception:  # a deleted or non-addressable array
        return None
    return ("array", type(x).__name__, data.shape, data.dtype.str, data.tobytes())


def _function_key(fn: types.FunctionType, depth: int) -> Hashable:
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(structural_key(cell.cell_contents, depth + 1))
        except ValueError:  # an empty cell
            cells.append(("empty",))
    kwdefaults = tuple(sorted((fn.__kwdefaults__ or {}).items()))
    return (
        "function",
        fn.__code__,
        ById(fn.__globals__),
        structural_key(fn.__defaults__, depth + 1),
        structural_key(kwdefaults, depth + 1),
        tuple(cells),
    )


def structural_key(obj: Any, depth: int = 0) -> Hashable:
    """A hashable key for `obj`, equal for hooks that compute the same thing."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return _number_key(obj)
    if depth >= _MAX_DEPTH:
        return ById(obj)
    if isinstance(obj, tuple) and type(obj) is tuple:
        return ("tuple", tuple(structural_key(o, depth + 1) for o in obj))
    if isinstance(obj, types.FunctionType):
        return _function_key(obj, depth)
    if isinstance(obj, types.MethodType):
        return ("method", structural_key(obj.__func__, depth + 1), ById(obj.__self__))
    if isinstance(obj, functools.partial):
        keywords = tuple(sorted(obj.keywords.items()))
        return (
            "partial",
            structural_key(obj.func, depth + 1),
            structural_key(obj.args, depth + 1),
            structural_key(keywords, depth + 1),
        )
    if (
        dataclasses.is_dataclass(obj)
        and not isinstance(obj, type)
        and obj.__dataclass_params__.frozen  # type: ignore[attr-defined]
    ):
        fields = tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))
        return (type(obj), structural_key(fields, depth + 1))
    array = _array_key(obj)
    if array is not None:
        return array
    return ById(obj)

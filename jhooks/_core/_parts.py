"""How a walk reads a `functools.partial`, a pytree node and a library wrapper of user
code: the parts its guards read again (`_guards`)."""

from __future__ import annotations

import functools
import types
from typing import Any

from ._guards import CHANGED
from ._kinds import OPAQUE, attribute, parts
from ._reach import SKIPPED, library, node_children


def partial_parts(obj: functools.partial) -> tuple:
    return (obj.func, *obj.args, *obj.keywords.values(), *obj.keywords, type(obj))


def node_parts(obj: Any) -> tuple:
    node = node_children(obj)
    return (CHANGED,) if node is None else (*node[0], node[1])


def wrapped(obj: Any) -> tuple:
    return (attribute(obj, "__wrapped__"),)


EMPTY = ("empty cell",)


def function_parts(fn: types.FunctionType) -> tuple:
    """What a walk reads of a function besides its globals: its cells' contents first."""
    cells = [cell_contents_or_empty(c) for c in fn.__closure__ or ()]
    return (*cells, fn.__defaults__, fn.__kwdefaults__, fn.__dict__ or None, fn.__code__)


def cell_contents_or_empty(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return EMPTY


def library_parts(obj: Any) -> list:
    """A library value's state, as `_kinds.parts` gives it (a walk keyed it by that)."""
    found = parts(obj)
    if found is None or found is OPAQUE:
        return [CHANGED]
    return [found[0], *found[1]]  # pyright: ignore[reportIndexIssue]


def class_parts(cls: type) -> list:
    """What a class's key holds: its attributes, user bases and metaclass."""
    values = [(k, v) for k, v in vars(cls).items() if k not in SKIPPED]
    return [values, [b for b in cls.__mro__[1:] if not library(b)], type(cls)]


def class_guard(cls: type) -> tuple:
    """What `class_parts` reads, flat: compared by identity, quickly."""
    d = vars(cls)
    return (*d.values(), *d.keys(), *cls.__mro__, type(cls))

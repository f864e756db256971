"""How a walk reads (and rebuilds) a `functools.partial`, a pytree node and a library
wrapper of user code: the parts its guards read again (`_guards`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ._guards import CHANGED
from ._kinds import attribute
from ._plans import Rebuilt
from ._reach import node_children


def partial_maker(kind: type, n: int, keywords: tuple) -> Callable[[list], Any]:
    """Makes a `functools.partial` again from its parts: function, arguments, keywords."""

    def make(p: list) -> Any:
        return kind(p[0], *p[1 : n + 1], **dict(zip(keywords, p[n + 1 :])))

    return make


def partial_parts(obj: functools.partial) -> tuple:
    return (obj.func, *obj.args, *obj.keywords.values(), *obj.keywords, type(obj))


def node_parts(obj: Any) -> tuple:
    node = node_children(obj)
    return (CHANGED,) if node is None else (*node[0], node[1])


def wrapped(obj: Any) -> tuple:
    return (attribute(obj, "__wrapped__"),)


def visit(obj: Any, plan: Any) -> Any:
    """A library wrapper whose wrapped code holds sites: the wrapper, rebuilt around it."""
    if plan is None:
        return None
    return Rebuilt(
        obj, lambda p: functools.wraps(p[0])(lambda *a, **k: p[0](*a, **k)), [obj], [plan]
    )

"""Where the values a run reads live, and how a trace puts tracers there and back.

A *plan* (made by `_closures.Walk`) is an int (a site: `values[i]` goes there), a
`Mutable` (an object used as it is, whose slots are set during the trace: a closure
cell, a dict item, a list item, an attribute) or a `Rebuilt` (an immutable object made
again from its parts: a tuple, a `functools.partial`, a pytree). `install` applies a
plan, recording each change; `restore` undoes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._jax_compat import is_tracer

# Where a site or a child lives: how `install` reaches it.
CELL, ITEM, ATTR, TYPE_ATTR, VISIT = range(5)


class Mutable:
    """A plan: an object used as it is, with these slots set during the trace."""

    __slots__ = ("obj", "slots")

    def __init__(self, obj: Any):
        self.obj = obj
        self.slots: list[tuple[int, Any, Any, Any]] = []  # (how, holder, key, plan)


class Rebuilt:
    """A plan: an immutable object made again from its parts (some of them plans)."""

    __slots__ = ("obj", "make", "parts", "planned")

    def __init__(self, obj: Any, make: Callable[[list], Any], parts: list, planned: list):
        self.obj, self.make, self.parts, self.planned = obj, make, parts, planned


def _get(how: int, holder: Any, key: Any) -> Any:
    if how == CELL:
        return holder.cell_contents
    if how == ITEM:
        return holder[key]
    return vars(holder)[key] if how == TYPE_ATTR else object.__getattribute__(holder, key)


def _set(how: int, holder: Any, key: Any, value: Any) -> None:
    if how == CELL:
        holder.cell_contents = value
    elif how == ITEM:
        holder[key] = value
    elif how == TYPE_ATTR:
        setattr(holder, key, value)
    else:
        object.__setattr__(holder, key, value)


def install(plan: Any, values: list, undo: list, memo: dict[int, Any] | None = None) -> Any:
    """The object of `plan` with `values[i]` at site `i`: mutable holders get them in
    place (each change recorded in `undo` for `restore`), immutable ones are rebuilt."""
    if type(plan) is int:
        return values[plan]
    memo = {} if memo is None else memo
    done = memo.get(id(plan))
    if done is not None:
        return done
    if isinstance(plan, Mutable):
        memo[id(plan)] = plan.obj
        for how, holder, key, child in plan.slots:
            new = install(child, values, undo, memo)
            if how == VISIT:
                continue
            old = _get(how, holder, key)
            if new is not old:
                undo.append((how, holder, key, old, new))
                _set(how, holder, key, new)
        return plan.obj
    parts = [
        part if p is None else install(p, values, undo, memo)
        for part, p in zip(plan.parts, plan.planned)
    ]
    same = all(a is b for a, b in zip(parts, plan.parts))
    out = plan.obj if same else plan.make(parts)
    memo[id(plan)] = out
    return out


def sites_in(plan: Any) -> set[int]:
    """The sites a plan puts values at."""
    found: set[int] = set()
    stack, seen = [plan], set()
    while stack:
        p = stack.pop()
        if type(p) is int:
            found.add(p)
        elif p is not None and id(p) not in seen:
            seen.add(id(p))
            stack.extend(s[3] for s in p.slots) if isinstance(p, Mutable) else stack.extend(
                p.planned
            )
    return found


def restore(undo: list) -> None:
    """Undoes `install`, newest change first. A slot that the traced code assigned a
    concrete value keeps it (a counter it incremented); one holding a tracer is reset."""
    while undo:
        how, holder, key, old, new = undo.pop()
        try:
            current = _get(how, holder, key)
        except (AttributeError, KeyError, IndexError):
            current = new
        if current is new or is_tracer(current):
            _set(how, holder, key, old)

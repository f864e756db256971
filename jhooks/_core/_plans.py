"""Where a run's program inputs live in its arguments, and how a trace is given them.

A *plan* (made by `_closures.Walk`) is an int (a site: `values[i]` goes there), a
`Copied` (a list or dict of the arguments' pytree, made again holding the new values)
or a `Rebuilt` (a tuple or pytree node of the arguments, made again from its parts), as
`jax.jit` makes the pytree of its arguments again around its tracers. Plans exist only
along the arguments' pytree structure: any other object (a closure cell, a global, an
object's attributes) is the user's own, used as it is, never copied or written.
What the traced code wrote to a list or dict made again is written back to the
user's by `restore` afterwards, unless it holds a tracer.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from ._jax_compat import is_tracer

# Where a child lives in a `Copied` object.
ITEM, ATTR = range(2)


class Copied:
    """A plan: a mutable object, used through a copy with these slots set."""

    __slots__ = ("obj", "slots")

    def __init__(self, obj: Any):
        self.obj = obj
        self.slots: list[tuple[int, Any, Any]] = []  # (how, key, plan)


class Rebuilt:
    """A plan: an object made again from its parts (some of them plans)."""

    __slots__ = ("obj", "make", "parts", "planned")

    def __init__(self, obj: Any, make: Callable[[list], Any], parts: list, planned: list):
        self.obj, self.make, self.parts, self.planned = obj, make, parts, planned


def _children(plan: Any) -> list:
    if isinstance(plan, Copied):
        return [s[2] for s in plan.slots]
    return [p for p in plan.planned if p is not None]


def touched(plans: list, traced: set[int]) -> set[int]:
    """The ids of the plans (in `plans`, to any depth) that lead to a traced site."""
    found: set[int] = set()
    while True:  # again, until no cycle hides a traced site any more
        state: dict[int, bool] = {}
        for plan in plans:
            _reaches(plan, traced, found, state)
        now = {i for i, hit in state.items() if hit}
        if now <= found:
            return found
        found |= now


def _reaches(p: Any, traced: set[int], found: set[int], state: dict[int, bool]) -> bool:
    if type(p) is int:
        return p in traced
    if p is None:
        return False
    done = state.get(id(p))
    if done is not None:
        return done
    state[id(p)] = id(p) in found  # a cycle back to `p`: what is known so far
    hit = False
    for child in _children(p):
        hit = _reaches(child, traced, found, state) or hit
    state[id(p)] = hit
    return hit


class Install:
    """One installation of plans: `Install(values, needed)(plan)`; `restore(undo)`."""

    def __init__(self, values: list, needed: set[int] | None, undo: list):
        self.values, self.needed, self.undo = values, needed, undo
        self.memo: dict[int, Any] = {}
        self.originals: dict[int, Any] = {}  # id of a copy or rebuilt object: the user's

    def original(self, obj: Any) -> Any:
        """The user's object that `obj` is this installation's copy of (or `obj`); a
        method of a copy, as the user's object's method."""
        if isinstance(obj, types.MethodType):
            func, owner = self.original(obj.__func__), self.original(obj.__self__)
            if func is obj.__func__ and owner is obj.__self__:
                return obj
            return types.MethodType(func, owner)
        return self.originals.get(id(obj), obj)

    def __call__(self, plan: Any) -> Any:
        if type(plan) is int:
            return self.values[plan]
        done = self.memo.get(id(plan))
        if done is not None:
            return done
        if isinstance(plan, Copied):
            return self._copied(plan)
        parts = [
            part if p is None or not self._needs(p) else self(p)
            for part, p in zip(plan.parts, plan.planned)
        ]
        same = all(a is b for a, b in zip(parts, plan.parts))
        out = plan.obj if same else plan.make(parts)
        self.memo[id(plan)] = out
        if out is not plan.obj:
            self.originals[id(out)] = plan.obj
        return out

    def _needs(self, plan: Any) -> bool:
        return self.needed is None or type(plan) is int or id(plan) in self.needed

    def _copied(self, plan: Copied) -> Any:
        obj = plan.obj
        new = type(obj)(obj)  # an exact list or dict
        self.memo[id(plan)] = new  # before the children: a cycle finds the copy
        self.originals[id(new)] = obj
        for how, key, child in plan.slots:
            if self._needs(child):
                put(how, new, key, self(child))
        self.undo.append(("copy", obj, new, snapshot(new)))
        return new


def put(how: int, holder: Any, key: Any, value: Any) -> None:
    if how == ITEM:
        holder[key] = value
    else:
        object.__setattr__(holder, key, value)


def take_out(holder: Any, key: Any, value: Any) -> None:
    """Removes `value` from where `holder` keeps it: the item of a list that is it, the
    entry `key` of a dict, or the attribute `key` of an object (if it still holds it)."""
    if isinstance(holder, list):
        index = next((i for i, v in enumerate(holder) if v is value), None)
        if index is not None:
            del holder[index]
    elif isinstance(holder, dict):
        if holder.get(key) is value:
            del holder[key]
    elif getattr(holder, key, None) is value:
        delattr(holder, key)


def snapshot(obj: Any) -> Any:
    """What `restore` compares with: the entries of a copy, as they were installed."""
    if isinstance(obj, list):
        return list(obj)
    return dict(obj), {}


def _tracing(value: Any) -> bool:
    return is_tracer(value) or getattr(value, "_jhooks_traced", False)


def restore(undo: list) -> None:
    """Writes back to the user's objects what the traced code wrote to the copies (a
    counter it incremented, an item it appended); values holding a tracer stay out."""
    originals = {id(r[2]): r[1] for r in undo}

    def back(value: Any) -> Any:
        return originals.get(id(value), value)

    while undo:
        _, obj, new, before = undo.pop()
        if isinstance(new, list):
            if len(new) != len(before) or any(a is not b for a, b in zip(new, before)):
                items = [
                    obj[i] if i < len(before) and i < len(obj) and x is before[i] else back(x)
                    for i, x in enumerate(new)
                ]
                if not any(map(_tracing, items)):
                    obj[:] = items
        else:
            entries, attrs = snapshot(new)
            _write_back(entries, before[0], obj, back, ITEM)
            _write_back(attrs, before[1], obj, back, ATTR)


def _write_back(now: dict, before: dict, obj: Any, back: Callable, how: int) -> None:
    for key, value in now.items():
        if (key not in before or before[key] is not value) and not _tracing(value):
            put(how, obj, key, back(value))
    for key in before.keys() - now.keys():
        if how == ITEM:
            obj.pop(key, None)
        else:
            vars(obj).pop(key, None)

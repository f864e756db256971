"""Where a run's program inputs live in its arguments, and how a trace is given them.

A *plan* (made by `_closures.Walk`) is an int (a site: `values[i]` goes there), a
`Copied` (a list or dict of the arguments' pytree, made again holding the new values)
or a `Rebuilt` (a tuple or pytree node of the arguments, made again from its parts), as
`jax.jit` makes the pytree of its arguments again around its tracers. Plans exist only
along the arguments' pytree structure: any other object (a closure cell, a global, an
object's attributes) is the user's own, used as it is, never copied or written.
What the traced code writes to a list or dict made again is lost, as under `jax.jit`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._entries import put


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
    """One installation of plans: `Install(values, needed)(plan)`, the arguments' pytree
    made again around `values` where `needed` (plan ids, or `None`: all) leads to them."""

    def __init__(self, values: list, needed: set[int] | None):
        self.values, self.needed = values, needed
        self.memo: dict[int, Any] = {}

    def __call__(self, plan: Any) -> Any:
        if type(plan) is int:
            return self.values[plan]
        done = self.memo.get(id(plan))
        if done is not None:
            return done
        if isinstance(plan, Copied):
            new = self.memo[id(plan)] = type(plan.obj)(plan.obj)  # an exact list or dict
            for how, key, child in plan.slots:
                if self._needs(child):
                    put(how, new, key, self(child))
            return new
        parts = [
            part if p is None or not self._needs(p) else self(p)
            for part, p in zip(plan.parts, plan.planned)
        ]
        same = all(a is b for a, b in zip(parts, plan.parts))
        out = self.memo[id(plan)] = plan.obj if same else plan.make(parts)
        return out

    def _needs(self, plan: Any) -> bool:
        return self.needed is None or type(plan) is int or id(plan) in self.needed

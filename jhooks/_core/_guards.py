"""Guards: what a walk read of each object, to check again cheaply on the next call.

A walk (`_closures.Walk`) records, for each object whose content its key depends on, a
*guard*: a function that reads that content again (`read(obj)`, a flat tuple: the
values the walk looked into, then the names and the type they depend on), what it read
then, and which of those values were array sites. `unchanged(guards, roots)` reads
them all again: when every value is the same object as before (or an equal string,
int, float bit for bit, pytree structure, or container of those), the walk would give
the same key, so its program is the one to run; an array site that holds another array
of the same type is only a new argument. Anything else is a change, and the caller
walks again. A guard reads only what the walk read: the globals a function names, an
object's attributes, a container's entries.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_TREEDEF = type(jax.tree_util.tree_structure(0))
_BY_VALUE = (str, bytes, int, _TREEDEF, type)
CHANGED = object()  # what a read gives where the walk would take another path
NOT_NUMBERS = "OUSMmV"  # NumPy kinds: objects, strings, bytes, datetimes, voids


class Guard:
    """What a walk read of one object: `read(obj)` gave `seen`; `sites` maps positions
    in it to the site each array there is. `root` is the object's index among the run's
    roots (held weakly by the caller), or -1 when `obj` is held here."""

    __slots__ = ("obj", "read", "seen", "sites", "root")

    def __init__(self, obj: Any, read: Callable[[Any], tuple], seen: tuple, sites: dict):
        self.obj, self.read, self.seen, self.sites = obj, read, seen, sites
        self.root = -1


def flat(slots: list[tuple] | None, obj: Any) -> tuple:
    """A container's slots `(how, name, value, ...)` as one tuple: values, names, type."""
    if slots is None:
        return (CHANGED,)
    return (*[s[2] for s in slots], *[s[1] for s in slots], type(obj))


def same(a: Any, b: Any) -> bool:
    """Whether the walk would key `a` as it keyed `b`, seen at the same place (`a` is
    not `b`): equal strings, ints, pytree structures and classes, floats bit for bit,
    and tuples, lists and dicts of those."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind in _BY_VALUE:
        return a == b
    if kind is float:
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if kind is tuple or kind is list:
        return len(a) == len(b) and all(x is y or same(x, y) for x, y in zip(a, b))
    if kind is dict:
        return len(a) == len(b) and same(list(a.items()), list(b.items()))
    return False


def _array(x: Any) -> bool:
    array = isinstance(x, jax.Array)
    return array or (isinstance(x, np.ndarray) and x.dtype.kind not in NOT_NUMBERS)


def fits_int32(x: Any) -> bool:
    """A number a program may trace: an int must fit int32 (else it is static)."""
    return type(x) is not int or -(2**31) <= x < 2**31


def unchanged(
    guards: list[Guard], roots: list, sites: list, numbers: frozenset = frozenset()
) -> list | None:
    """`sites`, with the arrays now at their places (and the numbers, at the sites in
    `numbers`: those traced), if no guard sees a change; else `None`."""
    fresh: list | None = None
    for guard in guards:
        obj = guard.obj if guard.root < 0 else roots[guard.root]
        now, seen = guard.read(obj), guard.seen
        if len(now) != len(seen):
            return None
        if all(map(operator.is_, now, seen)):
            continue
        for i, (a, b) in enumerate(zip(now, seen)):
            if a is b or same(a, b):
                continue
            site = guard.sites.get(i)
            if site is None or type(a) is not type(b):
                return None
            if not (_array(a) or (site in numbers and fits_int32(a))):
                return None
            if fresh is None:
                fresh = list(sites)
            fresh[site] = a
    return sites if fresh is None else fresh

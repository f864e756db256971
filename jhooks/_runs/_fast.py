"""A warm call's fast path: the last walk of the same run, checked by its guards.

A run called again with the same function and hooks (the same objects: a bound
method's function and `self`) finds its last walk here, keyed by their identities,
and checks the walk's guards (`_core._guards`): what it read of each object, read
again. If nothing changed, the walk would give the same key, so the program, its plans
and its traced sites are those of last time, with the arrays now at the sites. A
change anywhere, or a change of how walks key things (`Places.generation`: a number
pinned static, a trace that wrote to an object), sends the call back to the walk.

A NumPy array among the program's arguments is sent to the device once: the entry keeps
its bytes and the device's copy, and passes the copy while the bytes are equal (an
array changed in place is sent again).

The roots are held weakly (an entry dies with its function or hook); what the walk
read inside them is held, so that identities compared are those of live objects.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from .._core import Bounded, Guard, unchanged

MAX_ENTRIES = 64
MAX_KEPT_BYTES = 1 << 20  # a larger NumPy array is sent to the device on each call
MAX_ENTRY_BYTES = 16 << 20  # and beyond 16 of them per run, the others
ARGS, KWARGS = 1, 2  # where a run's arguments are among its roots


class Entry:
    """One run's last walk, and what it selected."""

    __slots__ = (
        "refs",
        "guards",
        "generation",
        "found",
        "sites",
        "numbers",
        "devices",
        "__weakref__",
    )

    def __init__(self, refs: list, guards: list[Guard], generation: int, found: tuple):
        self.refs, self.guards, self.generation, self.found = refs, guards, generation, found
        self.sites: list = []
        self.numbers: frozenset[int] = frozenset()  # the sites of traced numbers
        self.devices: dict[int, tuple] = {}  # site -> (bytes, shape, dtype, device copy)


_entries: Bounded[Hashable, Entry] = Bounded(MAX_ENTRIES)


def _parts(roots: list) -> list:
    """The roots as held: a bound method as its function and `self` (a hook `c.inc` is
    a new method object at each access)."""
    out: list = []
    for root in roots:
        if type(root) is types.MethodType:
            out.extend((root.__func__, root.__self__))
        else:
            out.append(root)
    return out


def entry_key(head: Hashable, roots: list) -> Hashable:
    """The run's function and hooks, by identity; its arguments' number and names."""
    held = _parts([roots[0]]) + _parts(roots[KWARGS + 1 :])
    return (head, len(roots[ARGS]), tuple(roots[KWARGS]), *map(id, held))


def lookup(key: Hashable, roots: list, generation: int, traced: int) -> tuple[tuple, list] | None:
    """`(found, sites)` of the run's last walk if nothing it read has changed; `sites`
    has device copies of its NumPy arrays (`found[traced]`: the sites passed)."""
    entry = _entries.get(key)
    if entry is None or entry.generation != generation:
        return None
    parts = _parts(roots)
    if any(ref is not None and ref() is not part for ref, part in zip(entry.refs, parts)):
        return None
    sites = unchanged(entry.guards, parts, entry.sites, entry.numbers)
    if sites is None:
        return None
    _entries.move_to_end(key)
    return entry.found, _on_device(entry, sites, entry.found[traced])


def _on_device(entry: Entry, sites: list, traced: list[int]) -> list:
    """`sites` with each NumPy array passed replaced by its device copy, made again
    when its bytes changed."""
    out = None
    for i in traced:
        a = sites[i]
        if type(a) is not np.ndarray or a.nbytes > MAX_KEPT_BYTES:
            continue
        data, kept = a.tobytes(), entry.devices.get(i)
        if kept is None or kept[0] != data or kept[1] != a.shape or kept[2] != a.dtype:
            if kept is None and len(entry.devices) * MAX_KEPT_BYTES >= MAX_ENTRY_BYTES:
                continue  # enough kept for this run: sent on each call
            kept = entry.devices[i] = (data, a.shape, a.dtype, jax.device_put(a))
        if out is None:
            out = list(sites)
        out[i] = kept[3]
    return sites if out is None else out


def remember(
    key: Hashable,
    roots: list,
    walk: Any,
    args_plan: Any,
    generation: int,
    found: tuple,
    numbers: list[int],
) -> None:
    """Keeps `walk` (made from `roots`) for the next call, with what it selected."""
    parts = _parts(roots)
    args_at = len(_parts(roots[:ARGS]))
    refs: list = []
    for i, part in enumerate(parts):
        if i in (args_at, args_at + 1):  # the arguments: a fresh tuple and dict each call
            refs.append(None)
            continue
        try:
            refs.append(weakref.ref(part, functools.partial(forget, _entries, key)))
        except TypeError:
            return
    at = {id(part): i for i, part in enumerate(parts)}
    sites = {}
    if args_plan is not None:  # the arguments' arrays
        sites = {j: p for j, p in enumerate(args_plan.planned) if type(p) is int}
    args = Guard(None, _same_tuple, tuple(roots[ARGS]), sites)
    args.root = args_at
    for guard in walk.guards:
        i = at.get(id(guard.obj), -1)
        if i >= 0:
            guard.root, guard.obj = i, None
    entry = Entry(refs, [args, *walk.guards], generation, found)
    entry.sites = walk.sites
    entry.numbers = frozenset(numbers)
    _entries[key] = entry
    _entries.move_to_end(key)


def forget(cache: OrderedDict, key: Hashable, _: Any) -> None:
    """A weak reference's callback: `key` leaves `cache` with what it held."""
    cache.pop(key, None)


def _same_tuple(args: tuple) -> tuple:
    return args

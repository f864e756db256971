"""Where a value is held in the user's objects, and how it is put there or taken out:
the one rule by which a traced value left behind is found and replaced (a run's trace
writing it, `_runs/_failures.py`; a hook keeping it, `_runs/_kept.py`; found where a
hook's code reaches, `_jax_compat/_leaks.py`).

A *holder* has *entries*: a list's or deque's items (by index), a dict's items, a
closure cell's contents, an object's or class's attributes. An entry holds the value
itself or holds it inside tuples (a namedtuple, tuples in tuples): a tuple cannot
change, so the entry gets a tuple made again around what replaces the value, or, where
nothing replaces it, is taken out. A list, dict or object inside a tuple is a holder of
its own.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from typing import Any

ITEM, ATTR, CELL = range(3)  # how a holder holds an entry: an item, an attribute, a cell's
GONE = object()  # `made_again`: a value found that nothing replaces
_DEPTH = 8  # tuples in tuples looked into


def is_sequence(holder: Any) -> bool:
    """A holder whose entries are positions (a list, a deque): taken out, an item is
    removed and those after it move up."""
    return isinstance(holder, (list, collections.deque))


def how_of(holder: Any) -> int:
    if isinstance(holder, (list, dict, collections.deque)):
        return ITEM
    return CELL if isinstance(holder, types.CellType) else ATTR


def entries(holder: Any) -> list[tuple[int, Any, Any]] | None:
    """`(how, key, value)` for each entry of `holder`, or `None` if it holds none."""
    if is_sequence(holder):
        return [(ITEM, i, v) for i, v in enumerate(holder)]
    if isinstance(holder, dict):
        return [(ITEM, k, v) for k, v in list(holder.items())]
    if isinstance(holder, types.CellType):
        try:
            return [(CELL, "cell_contents", holder.cell_contents)]
        except ValueError:  # empty
            return []
    attrs = getattr(holder, "__dict__", None)
    if isinstance(attrs, (dict, types.MappingProxyType)):
        return [(ATTR, k, v) for k, v in list(attrs.items())]
    return None


def record(held: dict, holder: Any, slots: Any) -> None:
    """Notes what `holder`'s entries hold now, `(how, key, value, ...)` each, in `held`
    (id -> (holder, {key: (how, value)})): a walk's record of the places it read."""
    known = held.get(id(holder))
    if known is None or known[0] is not holder:
        known = held[id(holder)] = (holder, {})
    known[1].update((slot[1], (slot[0], slot[2])) for slot in slots)


def put(how: int, holder: Any, key: Any, value: Any) -> None:
    if how == ITEM:
        holder[key] = value
    elif how == CELL:
        holder.cell_contents = value
    else:  # past a frozen dataclass's `__setattr__`; a class's is its metaclass's
        (setattr if isinstance(holder, type) else object.__setattr__)(holder, key, value)


def remove(how: int, holder: Any, key: Any) -> None:
    """Takes the entry out: a dict's key, an attribute, a cell's contents (empty again)."""
    if how == ITEM:
        del holder[key]
    elif how == CELL:
        del holder.cell_contents
    else:
        (delattr if isinstance(holder, type) else object.__delattr__)(holder, key)


def holds(holder: Any, key: Any, value: Any) -> bool:
    """Whether the entry `key` of `holder` still holds `value` (itself)."""
    how = how_of(holder)
    if how == ITEM and is_sequence(holder):
        return key < len(holder) and holder[key] is value
    if how == ITEM:
        return holder.get(key) is value
    if how == CELL:
        return any(v is value for _, _, v in entries(holder) or ())
    return getattr(holder, key, None) is value


def take_out(holder: Any, key: Any, value: Any) -> bool:
    """Removes `value` from where `holder` keeps it, if it still does: the item of a
    list or deque that is it, else the entry `key`. Whether it did."""
    if is_sequence(holder):
        index = next((i for i, v in enumerate(holder) if v is value), None)
        if index is not None:
            del holder[index]
        return index is not None
    if not holds(holder, key, value):
        return False
    remove(how_of(holder), holder, key)
    return True


def drop_items(holder: Any, values: list) -> None:
    """Removes from a list or deque each item that is one of `values`."""
    left = [v for v in holder if not any(v is t for t in values)]
    holder.clear()
    holder.extend(left)


def inside(value: Any, found: Callable[[Any], bool], depth: int = 0) -> list:
    """The values `found` says are wanted that `value` is or holds inside tuples."""
    if found(value):
        return [value]
    if isinstance(value, tuple) and depth < _DEPTH:
        return [x for v in value for x in inside(v, found, depth + 1)]
    return []


def made_again(value: Any, found: Callable[[Any], bool], swap: Callable[[Any], Any]) -> Any:
    """`value` with each value `found` in it (itself, or inside tuples) replaced by
    `swap(v)`, its tuples made again around the replacements: `value` itself where
    nothing is found, `GONE` where `swap` gives `None` for one."""
    if found(value):
        new = swap(value)
        return GONE if new is None else new
    if not isinstance(value, tuple) or not inside(value, found):
        return value
    parts = [made_again(v, found, swap) for v in value]
    if any(p is GONE for p in parts):
        return GONE
    return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)

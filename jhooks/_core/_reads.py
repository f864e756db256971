"""What a trace read of a large dict or list, or of an object of the user's class: its
guards are those entries (attributes), not all.

A dict or list of `LARGE` entries or more that a run's code holds (a vocabulary, a table
of settings, a list of arrays) reaches the trace as a `ReadDict` or `ReadList`: a copy
that records the keys looked up (`d[k]`, `d.get(k)`, `k in d`; `a[i]` with an int `i`).
After the trace, `READS[place]` (its place in the walk, such as "hook h: closure
variable `vocab`") holds the union of the keys read there; a walk then keys only those
entries (and only they are arguments), so a call costs what the hook read, not what the
container holds. Any other use (iterating, `len`, `items()`, `dict(d)`, `**d`, a slice,
a pytree flatten) reads it whole: `READS[place]` is then `WHOLE`, for good, and it is
keyed by all its content, as any dict or list.

An object of the user's own class (`recordable`) reaches the trace as a copy whose class
is a subclass made for the trace, that records the attributes read or written through the
instance (`self.scale`, `getattr(self, name)`, `self.count = n`); what C code reads all
of its state through (`vars(self)`, `self.__dict__`, `__getstate__` and `__reduce_ex__`:
`copy.copy(self)`, `pickle`, `dir`) reads it whole.
So a bound-method hook whose `self` collects results between calls is keyed by the
attributes its code uses, not by the results. The copy's `__class__` is the user's class
(`isinstance`, `dataclasses.replace`, zero-argument `super()` work); `type(copy)` is the
subclass, of the same name.

The union only grows, so a program's key always holds what its trace read: a program
traced with fewer keys known is found again only through a key holding them all.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import jax

LARGE = 64
WHOLE = None
READS: OrderedDict[str, frozenset | None] = OrderedDict()
_MAX_PLACES = 4096


class ReadDict(dict):
    """A dict that records which keys the code read (`read`), or that it read all."""

    __slots__ = ("read", "whole", "place")

    def __init__(self, source: dict, place: str):
        super().__init__(source)
        self.read: set = set()
        self.whole = False
        self.place = place

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return dict.get(self, key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return dict.__contains__(self, key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return dict.setdefault(self, key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self.read.add(key)
        return dict.pop(self, key, *default)


class ReadList(list):
    """A list that records which int indices the code read (`read`), or that it read
    all."""

    __slots__ = ("read", "whole", "place")

    def __init__(self, source: list, place: str):
        super().__init__(source)
        self.read: set = set()
        self.whole = False
        self.place = place

    def __getitem__(self, index: Any) -> Any:
        if type(index) is int:
            self.read.add(index)
        else:
            self.whole = True
        return list.__getitem__(self, index)


def _reads_all(name: str, kind: type = dict) -> Any:
    method = getattr(kind, name)

    def whole(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.whole = True
        return method(self, *args, **kwargs)

    whole.__name__ = name
    return whole


for _name in (
    "__iter__",
    "__len__",
    "__eq__",
    "__ne__",
    "__repr__",
    "__reversed__",
    "__or__",
    "__ror__",
    "keys",
    "values",
    "items",
    "copy",
    "popitem",
    "__reduce_ex__",
):
    setattr(ReadDict, _name, _reads_all(_name))
for _name in (
    "__iter__",
    "__len__",
    "__contains__",
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__repr__",
    "__reversed__",
    "__add__",
    "__mul__",
    "__rmul__",
    "index",
    "count",
    "copy",
    "pop",
    "sort",
    "reverse",
    "__reduce_ex__",
):
    setattr(ReadList, _name, _reads_all(_name, list))
ReadDict.__hash__ = None  # type: ignore[assignment]  # as dict's
ReadList.__hash__ = None  # type: ignore[assignment]  # as list's


def _flatten(d: ReadDict) -> tuple[list, tuple]:
    d.whole = True
    keys = sorted(dict.keys(d), key=repr)
    return [dict.__getitem__(d, k) for k in keys], tuple(keys)


def _unflatten(keys: tuple, values: Any) -> Any:
    return dict(zip(keys, values))


def _flatten_list(a: ReadList) -> tuple[list, None]:
    a.whole = True
    return list.copy(a), None


jax.tree_util.register_pytree_node(ReadDict, _flatten, _unflatten)


def _unflatten_list(_: None, values: Any) -> Any:
    return list(values)


jax.tree_util.register_pytree_node(ReadList, _flatten_list, _unflatten_list)


class ObjectReads:
    """What a trace read (and wrote) of one object copy, by attribute name."""

    __slots__ = ("read", "whole", "place")

    def __init__(self, place: str):
        self.read: set = set()
        self.whole = False
        self.place = place


# Copies being recorded, by id: only between `watch` and `learn` (the trace).
_WATCHED: dict[int, ObjectReads] = {}
_PLAIN_GETATTRIBUTE = object.__getattribute__


def recordable(cls: type) -> bool:
    """Whether the reads of an instance of `cls` can be recorded: a class of plain
    Python objects (metaclass `type`), reading attributes in the usual way (no
    `__getattribute__` or `__getattr__` of its own), with no `__init_subclass__` (the
    subclass made for a trace would run it)."""
    return (
        type(cls) is type
        and cls.__getattribute__ is _PLAIN_GETATTRIBUTE
        and not hasattr(cls, "__getattr__")
        and not any("__init_subclass__" in vars(k) for k in cls.__mro__[:-1])
    )


# What C code reads all of an object's state through (`vars`, `copy`, `pickle`, `dir`).
_READS_ALL = frozenset({"__dict__", "__getstate__", "__reduce__", "__reduce_ex__"})


def _note(self: Any, name: str) -> None:
    log = _WATCHED.get(id(self))
    if log is not None and name != "__class__":  # the class is keyed by its content
        if name in _READS_ALL:
            log.whole = True
        else:
            log.read.add(name)


def _recording(cls: type) -> type:
    setattr_: Any = cls.__setattr__
    delattr_: Any = cls.__delattr__
    reduce_ex: Any = cls.__reduce_ex__

    def __getattribute__(self: Any, name: str) -> Any:
        _note(self, name)
        return object.__getattribute__(self, name)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        _note(self, name)
        setattr_(self, name, value)

    def __delattr__(self: Any, name: str) -> None:
        _note(self, name)
        delattr_(self, name)

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # `copy` and `pickle` make (and name) an object of the user's class, not this one.
        _note(self, "__reduce_ex__")
        out = reduce_ex(self, protocol)
        if type(out) is tuple and len(out) > 1 and out[1] and out[1][0] is recording:
            out = (out[0], (cls, *out[1][1:]), *out[2:])
        return out

    namespace = {
        "__slots__": (),
        "__getattribute__": __getattribute__,
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
        "__reduce_ex__": __reduce_ex__,
        "__class__": property(lambda self: cls),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    recording = type(cls.__name__, (cls,), namespace)
    return recording


def recording_copy(obj: Any) -> Any:
    """A shallow copy of `obj` that records what is read of it once `watch`ed; `obj`'s
    plain copy when its class does not allow it."""
    new = copy.copy(obj)
    if type(new) is type(obj):
        try:
            object.__setattr__(new, "__class__", _recording(type(obj)))
        except TypeError:  # a layout that a subclass cannot take
            pass
    return new


def watch(new: Any, place: str) -> None:
    """Records from now on what the code reads of `new` (a `recording_copy`)."""
    if type(new).__getattribute__ is _PLAIN_GETATTRIBUTE:
        READS[place] = WHOLE  # not recorded: keyed whole
    else:
        _WATCHED[id(new)] = ObjectReads(place)


def watched(new: Any) -> ObjectReads | None:
    """Stops recording `new`: what was read of it (to `learn`), if it was watched."""
    return _WATCHED.pop(id(new), None)


def known(place: str) -> frozenset | None:
    """The keys read at `place` so far: `WHOLE` when unknown or when all were read."""
    return READS.get(place, WHOLE)


def learn(d: ReadDict | ReadList | ObjectReads) -> None:
    """Adds what the trace read of `d` to `READS` (after the trace)."""
    place = d.place
    if d.whole:
        READS[place] = WHOLE
    elif place not in READS or READS[place] is not WHOLE:
        READS[place] = frozenset(d.read) | (READS.get(place) or frozenset())
    READS.move_to_end(place)
    while len(READS) > _MAX_PLACES:
        READS.popitem(last=False)

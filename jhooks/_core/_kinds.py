"""How a walk keys the objects of libraries (the standard library's included).

Library code is constant: functions, classes, modules, builtins and C callables (a
NumPy ufunc, a jitted function) are keys by identity. Library *values* are not: a
`deque`, a `UserDict`, an `array.array`, a mapping proxy, a thread-local, a weak
reference, a context variable, `os.environ`, a builtin method bound to a dict hold
state that changes, so `parts(obj)` names the state a walk keys by content. Random
generators and the functions of `time` and `random` give a new value each call: they
are `OPAQUE`, and a run that reads one is not cached, as is one that reads a builtin
iterator or generator where its code names `next` (what it gives next changes as it is
read; the caller decides: `ITERATOR`). Other objects of a library
without attributes (C objects, such as a lock) are keys by identity, or by value when
their type hashes by value.
"""

from __future__ import annotations

import array
import collections
import collections.abc
import contextvars
import random
import threading
import types
import weakref
from typing import Any

import numpy as np

OPAQUE = ("opaque",)
ITERATOR = ("iterator",)  # opaque where the code walked advances it, else by identity
_TUPLEGETTER = type(vars(collections.namedtuple("_Pair", "a"))["a"])
_NO_VALUE = ("no value",)
_IMPURE = frozenset({"time", "random", "_random", "secrets"})  # a new value each call
_ITERATORS = frozenset({"builtins", "itertools"})
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)
_RANDOM = (random.Random, np.random.Generator, np.random.RandomState, np.random.BitGenerator)
# Synchronisation, not values: what a hook does with them is not in a program.
_SYNC = (
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Condition,
    threading.Event,
    threading.Semaphore,
    threading.Barrier,
    threading.Thread,
)
_CODE = (
    types.BuiltinFunctionType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    np.ufunc,
)


def attribute(obj: Any, name: str) -> Any:
    """`getattr(obj, name, None)`, whatever `obj.__getattr__` raises."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _iterator(obj: Any) -> bool:
    """A builtin iterator or generator (`iter(xs)`, `itertools.count()`): what it gives
    next changes as code reads it, and no guard can read it without consuming it."""
    kind = type(obj)
    return isinstance(obj, collections.abc.Iterator) and kind.__module__ in _ITERATORS


def parts(obj: Any) -> tuple[tuple, list] | tuple | None:
    """A library object's state: `(head, values)` to key by content, `None` when the
    object is a constant (its identity or value is its key), or `OPAQUE`."""
    if isinstance(obj, _RANDOM):
        return OPAQUE
    if _iterator(obj):
        return ITERATOR
    if isinstance(obj, threading.Event):
        return ("event", obj.is_set()), []
    if isinstance(obj, (bytearray, memoryview)):
        return (type(obj), bytes(obj)), []
    if isinstance(obj, types.BuiltinMethodType):
        owner = obj.__self__
        if isinstance(owner, types.ModuleType) and owner.__name__ in _IMPURE:
            return OPAQUE
        if owner is None or isinstance(owner, types.ModuleType) or isinstance(owner, type):
            return None
        return ("builtin method", obj.__name__), [owner]
    if isinstance(obj, _CODE) or isinstance(obj, _SYNC):
        return None
    if isinstance(obj, _TUPLEGETTER):  # a namedtuple's field: its index and doc
        return ("field",), [*obj.__reduce__()[1]]
    if isinstance(obj, collections.deque):
        return ("deque", obj.maxlen), list(obj)
    if isinstance(obj, array.array):
        return ("array", obj.typecode, obj.tobytes()), []
    if isinstance(obj, types.MappingProxyType):
        return ("mappingproxy",), [dict(obj)]
    if isinstance(obj, weakref.ReferenceType):
        target = obj()
        return ("weakref",), [] if target is None else [target]
    if isinstance(obj, _PROXIES):
        try:
            return ("weakproxy", obj.__class__), [vars(obj)]
        except ReferenceError:
            return ("dead weakproxy",), []
    if isinstance(obj, contextvars.ContextVar):
        return ("contextvar", obj.name), [obj.get(_NO_VALUE)]
    attrs = attribute(obj, "__dict__")
    if isinstance(attrs, dict) and type(obj) is not type:
        return ("attributes", type(obj)), [dict(attrs)]
    return None  # code, or a C object whose state Python cannot read: by identity

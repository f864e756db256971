"""What a traced run reads: its guards, and the values it takes as arguments.

`Walk(mode)(obj)` walks everything Python code in `obj` can read: a function's closure
cells, defaults and the globals its code names (and the attributes it names of user
modules it reads), `functools.partial` arguments, a bound method's function and
`self`, an object's attributes (`__dict__`, `__slots__`) and its class's attributes
(user classes, bases included), containers, pytrees (Equinox modules), to any depth,
each object once (a shared or cyclic object is a back-reference). It returns a
hashable *key* that holds every value read, compared by content: strings, numbers
bit for bit (`0.0` and `-0.0` differ), code objects, pytree structures, and, for
objects it cannot look into (library objects, builtins), their identity, held weakly
where Python allows it (`Walk.refs`), so that a key never keeps a model alive.

Mode `RUN` (the function, arguments and hooks of a run): arrays (JAX and NumPy) and
Python numbers are *sites* (`Walk.sites`), left out of the key; `Walk.plan` says
where each lives, so that `install` can put a tracer there (in the user's own cell,
dict, list or attribute, restored after the trace: side effects reach the user's
objects) or rebuild the immutable objects holding it (tuples, partials, pytrees).
Mode `STATIC` (registered hooks, predicates): arrays and numbers are in the key by
content (a digest of a NumPy array's bytes; a large JAX array by identity, as it is
immutable).
"""

from __future__ import annotations

import functools
import hashlib
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._jax_compat import is_tracer
from ._plans import ATTR, CELL, ITEM, TYPE_ATTR, VISIT, Mutable, Rebuilt
from ._reach import SKIPPED, code_names, library, namespace, node_children, slot_names
from ._static import _Static, number_key

RUN, STATIC = "run", "static"
_SMALL = 1 << 16  # JAX arrays up to this size are keyed by content in STATIC mode
_NUMBER_TYPES = (int, float, complex)
_EXACT_ATOMS = frozenset({str, bytes, type(None), bool})
_ARRAY_TYPES: set[type] = {np.ndarray}  # and each JAX array type met (a fast path)
_ATOMS = (str, bytes, type(None), bool, type(Ellipsis), types.CodeType, range, slice)


class Ref:
    """An object in a key, by identity, held weakly when Python allows it."""

    __slots__ = ("_get", "_id", "weak")

    def __init__(self, obj: Any):
        try:
            self._get: Callable[[], Any] = weakref.ref(obj)
            self.weak = True
        except TypeError:
            self._get = lambda: obj
            self.weak = False
        self._id = id(obj)

    def __call__(self) -> Any:
        return self._get()

    def __hash__(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ref) or other._id != self._id:
            return False
        mine = self._get()
        return mine is not None and mine is other._get()


def text(where: Any) -> str:
    """A place in a walk as text: places are built lazily, `(parent, format, name)`."""
    if isinstance(where, str):
        return where
    parent, form, name = where
    return form.format(text(parent), name)


class Walk:
    """One walk of the values a run reads: `key = Walk(mode)(obj)`; see the module doc."""

    def __init__(self, mode: str, written: dict[int, Any] | None = None):
        self.mode = mode
        # Containers a trace changed (a list of traces, a counter): the trace's output,
        # keyed by identity, their contents left as they are.
        self.written = written or {}
        self.containers: dict[int, tuple[Any, Any]] = {}  # id -> (container, key)
        self.sites: list[Any] = []  # RUN: the arrays and numbers found, in order
        self.where: list[str] = []  # RUN: a description of each site
        self.refs: list[Ref] = []  # objects keyed by identity
        self._seen: dict[int, tuple[int, Any]] = {}  # id -> (index, plan)
        self._keep: list[Any] = []  # objects visited, so their ids stay theirs
        self.plan: Any = None  # the plan of the last object walked

    def __call__(self, obj: Any, where: str = "") -> Any:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))
        try:
            key, self.plan = self._walk(obj, where)
        except RecursionError:
            raise TypeError(
                f"{text(where) or 'a value'} holds objects nested too deeply to guard (over "
                "about 5000 levels): pass the values the run needs as arguments instead."
            ) from None
        finally:
            sys.setrecursionlimit(limit)
        return key

    def _ref(self, obj: Any) -> Ref:
        ref = Ref(obj)
        self.refs.append(ref)
        return ref

    def _site(self, obj: Any, where: Any, key: Any) -> tuple[Any, Any]:
        self.sites.append(obj)
        self.where.append(text(where))
        return key, len(self.sites) - 1

    def _walk(self, obj: Any, where: Any) -> tuple[Any, Any]:
        """`(key, plan)`; the plan is `None` when nothing in `obj` is a site."""
        kind = type(obj)
        if kind in _EXACT_ATOMS:
            return obj, None
        if kind in _ARRAY_TYPES and self.mode == RUN and obj.dtype != object:
            return self._site(obj, where, "a")
        if kind is int or kind is float or kind is complex:
            if self.mode == RUN:
                return self._site(obj, where, ("n", kind.__name__))
            return number_key(obj), None
        if kind is types.ModuleType:
            return ("module", obj.__name__), None
        if isinstance(obj, _ATOMS):
            return obj, None
        if kind is int or kind is float or kind is complex:
            if self.mode == RUN:
                return self._site(obj, where, ("n", kind.__name__))
            return number_key(obj), None
        if isinstance(obj, _Static):
            value = tuple(map(number_key, obj)) if isinstance(obj, tuple) else number_key(obj)
            return ("static", value), None
        if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
            if isinstance(obj, jax.Array):
                _ARRAY_TYPES.add(kind)
            if isinstance(obj, np.bool_):
                return (kind, bool(obj)), None
            return self._array(obj, where)
        if isinstance(obj, (int, float, complex)):  # a subclass (an IntEnum...): by value
            return (kind, obj), None
        seen = self._seen.get(id(obj))
        if seen is not None:
            return ("@", seen[0]), seen[1]
        index = len(self._seen)
        self._seen[id(obj)] = (index, None)
        self._keep.append(obj)
        key, plan = self._compound(obj, where)
        self._seen[id(obj)] = (index, plan)
        if (kind is list or kind is dict or kind is set) and key[0] != "written":
            items = obj.values() if isinstance(obj, dict) else obj
            numbers = tuple(number_key(x) for x in items if type(x) in _NUMBER_TYPES)
            self.containers[id(obj)] = (obj, (key, numbers))
        return key, plan

    def _array(self, obj: Any, where: Any) -> tuple[Any, Any]:
        if isinstance(obj, np.ndarray) and obj.dtype == object:
            raise TypeError(
                f"{text(where) or 'a value'} is a NumPy array of Python objects, which a compiled "
                "run can neither trace nor guard: pass an array of numbers."
            )
        if self.mode == RUN:
            return self._site(obj, where, "a")
        if isinstance(obj, (np.ndarray, np.generic)):
            data = np.ascontiguousarray(obj)
            digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
            return ("np", data.shape, data.dtype.str, digest), None
        if is_tracer(obj) or obj.size > _SMALL:
            return ("jax", self._ref(obj)), None
        data = np.asarray(obj)
        digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
        return ("jaxv", data.shape, data.dtype.str, digest), None

    def _compound(self, obj: Any, where: Any) -> tuple[Any, Any]:
        if isinstance(obj, types.FunctionType):
            if library(obj):
                return ("lib", self._ref(obj)), None
            return self._function(obj, where)
        if isinstance(obj, functools.partial):
            return self._rebuilt(
                obj,
                ("partial", type(obj)),
                [obj.func, *obj.args, *obj.keywords.values()],
                [where, *((where, "{}: partial argument {}", i) for i in range(len(obj.args)))]
                + [(where, "{}: partial keyword `{}`", k) for k in obj.keywords],
                _partial_maker(type(obj), len(obj.args), tuple(obj.keywords)),
            )
        if isinstance(obj, types.MethodType):
            return self._rebuilt(
                obj,
                ("method",),
                [obj.__func__, obj.__self__],
                [where, (where, "{}: self{}", "")],
                lambda p: types.MethodType(p[0], p[1]),
            )
        if isinstance(obj, tuple) and (type(obj) is tuple or hasattr(obj, "_fields")):
            return self._rebuilt(
                obj,
                ("tuple", type(obj)),
                list(obj),
                [(where, "{}[{}]", i) for i in range(len(obj))],
                (lambda p: tuple(p)) if type(obj) is tuple else (lambda p: type(obj)(*p)),
            )
        if isinstance(obj, (list, dict, set)) and self.written.get(id(obj)) is obj:
            return ("written", id(obj)), None
        if isinstance(obj, list):
            return self._mutable(
                obj, ("list", type(obj)), [(ITEM, obj, i, v) for i, v in enumerate(obj)], where
            )
        if isinstance(obj, dict):
            return self._mutable(
                obj,
                ("dict", type(obj), tuple(obj)),
                [(ITEM, obj, k, v) for k, v in obj.items()],
                where,
            )
        if isinstance(obj, (set, frozenset)):
            inner = Walk(STATIC)
            key = frozenset(inner(x) for x in obj)
            self.refs.extend(inner.refs)
            return ("set", type(obj), key), None
        if isinstance(obj, types.ModuleType):
            return ("module", obj.__name__), None
        if isinstance(obj, type):
            return self._class(obj, where)
        if isinstance(obj, (staticmethod, classmethod)):
            return self._mutable(obj, ("sm", type(obj)), [(VISIT, None, None, obj.__func__)], where)
        if isinstance(obj, property):
            parts = [(VISIT, None, None, f) for f in (obj.fget, obj.fset, obj.fdel)]
            return self._mutable(obj, ("property",), parts, where)
        node = node_children(obj)
        if node is not None:
            children, treedef = node
            try:
                hash(treedef)
            except TypeError:
                return ("node?", self._ref(obj)), None
            return self._rebuilt(
                obj,
                ("node", treedef),
                children,
                [where] * len(children),
                lambda p: jax.tree_util.tree_unflatten(treedef, p),
            )
        unwrapped = getattr(obj, "__wrapped__", None)
        if unwrapped is not None and library(type(obj)) and callable(obj):
            # A library wrapper of user code (`jax.jit(f)`): f is what runs.
            key, plan = self._walk(unwrapped, where)
            return ("wrapped", type(obj), key), _visit(obj, plan)
        if namespace(obj):
            return self._object(obj, where)
        if library(type(obj)) or not (hasattr(obj, "__dict__") or slot_names(type(obj))):
            try:
                hash(obj)
            except TypeError:
                return ("id", self._ref(obj)), None
            if type(obj).__hash__ is object.__hash__:
                return ("id", self._ref(obj)), None
            return ("value", type(obj), obj), None  # hashable by value: a dtype, a Fraction
        return self._object(obj, where)

    def _rebuilt(
        self, obj: Any, head: tuple, parts: list, wheres: list, make: Callable[[list], Any]
    ) -> tuple[Any, Any]:
        keys, plans = [], []
        for part, at in zip(parts, wheres):
            k, p = self._walk(part, at)
            keys.append(k)
            plans.append(p)
        key = (*head, tuple(keys))
        if all(p is None for p in plans):
            return key, None
        return key, Rebuilt(obj, make, parts, plans)

    def _mutable(self, obj: Any, head: tuple, slots: list[tuple], where: Any) -> tuple[Any, Any]:
        """`slots`: `(how, holder, key, value)`, or with a fifth item, the value's name."""
        plan = Mutable(obj)
        # Registered before the children, so that a cycle back to `obj` finds it.
        self._seen[id(obj)] = (self._seen[id(obj)][0], plan)
        keys = []
        for slot in slots:
            how, holder, name, value = slot[:4]
            if len(slot) > 4:
                at = slot[4]
            elif how in (ATTR, TYPE_ATTR):
                at = (where, "{}.{}", name)
            else:
                at = where if how == VISIT else (where, "{}[{!r}]", name)
            k, p = self._walk(value, at)
            keys.append(k)
            if p is not None:
                plan.slots.append((how, holder, name, p))
        key = (*head, tuple(keys))
        return key, (plan if plan.slots else None)

    def _function(self, fn: types.FunctionType, where: Any) -> tuple[Any, Any]:
        code = fn.__code__
        name = fn.__qualname__
        slots: list[tuple] = []
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                slots.append(
                    (CELL, cell, var, cell.cell_contents, (name, "{}: closure variable `{}`", var))
                )
            except ValueError:  # an empty cell
                slots.append((VISIT, None, var, _EMPTY))
        if fn.__defaults__:
            slots.append((ATTR, fn, "__defaults__", fn.__defaults__, (name, "{}: default{}", "")))
        for k, v in (fn.__kwdefaults__ or {}).items():
            slots.append((ITEM, fn.__kwdefaults__, k, v, (name, "{}: default `{}`", k)))
        g = fn.__globals__
        names = code_names(code)
        for n in names:
            if n in g:
                value = g[n]
                slots.append((ITEM, g, n, value, (name, "{}: global `{}`", n)))
                if isinstance(value, types.ModuleType) and not library(value):
                    # `config.SCALE` in a user module `config`: the names the code reads.
                    d = value.__dict__
                    slots.extend(
                        (ITEM, d, a, d[a], ((name, "{}: `{}", n), "{}.{}`", a))
                        for a in names
                        if a in d and a[:2] != "__"
                    )
        return self._mutable(fn, ("fn", code, Ref(g)), slots, where or name)

    def _class(self, cls: type, where: Any) -> tuple[Any, Any]:
        if library(cls):
            return ("type", self._ref(cls)), None
        slots: list[tuple] = [
            (TYPE_ATTR, cls, k, v) for k, v in vars(cls).items() if k not in SKIPPED
        ]
        slots.extend((VISIT, None, None, base) for base in cls.__mro__[1:-1])
        return self._mutable(cls, ("class", self._ref(cls)), slots, cls.__qualname__)

    def _object(self, obj: Any, where: Any) -> tuple[Any, Any]:
        cls = type(obj)
        slots: list[tuple] = [(VISIT, None, None, cls)]
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            slots.extend((ATTR, obj, k, v) for k, v in list(attrs.items()))
        for name in slot_names(cls):
            if hasattr(obj, name):
                slots.append((ATTR, obj, name, getattr(obj, name)))
        at = where or cls.__qualname__
        return self._mutable(obj, ("object",), slots, at)


_EMPTY = ("empty cell",)


def _partial_maker(kind: type, n: int, keywords: tuple) -> Callable[[list], Any]:
    """Makes a `functools.partial` again from its parts: function, arguments, keywords."""

    def make(p: list) -> Any:
        return kind(p[0], *p[1 : n + 1], **dict(zip(keywords, p[n + 1 :])))

    return make


def _visit(obj: Any, plan: Any) -> Any:
    if plan is None:
        return None
    mutable = Mutable(obj)
    mutable.slots.append((VISIT, None, None, plan))
    return mutable


def static_key(obj: Any) -> Any:
    """`obj`'s key with every value by content: what makes two registered hooks equal."""
    return Walk(STATIC)(obj)

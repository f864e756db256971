"""How a walk reads code: functions (closure cells, defaults, attributes, the globals
their code names), modules (the user's own, and a library's values), and classes; and
library values and arrays.

`CodeWalk` is the part of `_closures.Walk` that walks them; `Ref` and `text` are the
pieces of a key and of a place that both use.
"""

from __future__ import annotations

import hashlib
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._guards import Guard
from ._jax_compat import is_tracer
from ._kinds import OPAQUE, attribute, parts
from ._parts import EMPTY, class_guard, class_parts, function_parts, library_parts
from ._plans import ATTR, ITEM
from ._reach import code_names, library, slot_names

RUN, STATIC = "run", "static"
_SMALL = 1 << 16  # JAX arrays up to this size are keyed by content in STATIC mode
_NOT_NUMBERS = "OUSMmV"  # NumPy kinds: objects, strings, bytes, datetimes, voids


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
    parts_: list = []
    while not isinstance(where, str):
        parts_.append(where)
        where = where[0]
    for _, form, name in reversed(parts_):
        where = form.format(where, name)
    return where


class CodeWalk:
    """Functions, modules and classes, for `_closures.Walk` (which defines the rest)."""

    names: set[str]
    record: bool
    entries: dict[int, tuple[Any, Any]]
    _modules: list
    _seen: dict[int, tuple[int, Any]]
    _keep: list[Any]
    _classes: dict[int, Any]
    opaque: list[str]
    guards: list[Guard]
    unguarded: list[str]
    mode: str
    _tree: bool
    constants: list[Any]
    constant_ids: list[int]
    tracers: list[Any]

    def _site(self, obj: Any, where: Any, key: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def _walk(self, obj: Any, where: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def _ref(self, obj: Any) -> Ref:
        raise NotImplementedError

    def _mutable(
        self,
        obj: Any,
        head: tuple,
        read: Callable[[Any], list | None],
        where: Any,
        guard: tuple[Callable[[Any], tuple], Sequence[int]] | None = None,
    ) -> tuple[Any, Any]:
        raise NotImplementedError

    def _frozen(
        self,
        obj: Any,
        head: tuple,
        read: Callable[[Any], list],
        where: Any = "",
        guard: Callable[[Any], tuple] | None = None,
    ) -> tuple[Any, Any]:
        raise NotImplementedError

    # What a guard reads again: no method of the walk, which holds what it visited.
    @staticmethod
    def _container_slots(obj: Any) -> list[tuple]:
        items = enumerate(obj) if isinstance(obj, list) else obj.items()
        slots = [(ITEM, k, v) for k, v in items]
        return (
            slots if type(obj) is dict or type(obj) is list else slots + CodeWalk._attributes(obj)
        )

    @staticmethod
    def _attributes(obj: Any) -> list[tuple]:
        slots: list[tuple] = []
        attrs = attribute(obj, "__dict__")
        if isinstance(attrs, dict):
            slots.extend((ATTR, k, v) for k, v in list(attrs.items()))
        for name in slot_names(type(obj)):
            value = attribute(obj, name)
            if value is not None or hasattr(obj, name):
                slots.append((ATTR, name, value))
        return slots

    def _array(self, obj: Any, where: Any) -> tuple[Any, Any]:
        if isinstance(obj, np.ndarray) and obj.dtype.kind in _NOT_NUMBERS:
            what = "Python objects" if obj.dtype == object else f"dtype {obj.dtype}"
            raise TypeError(
                f"{text(where) or 'a value'} is a NumPy array of {what}, which a compiled "
                "run can neither trace nor guard: pass an array of numbers."
            )
        if self._tree:
            return self._site(obj, where, "a")
        if isinstance(obj, np.generic):  # immutable: by value
            return ("npv", obj.dtype.str, obj.tobytes()), None
        if self.mode == RUN and not isinstance(obj, np.ndarray):
            # A JAX array the run reads from outside its arguments: a constant of the
            # trace, keyed by identity (immutable; rebound, it is another program).
            self.constants.append(where)
            self.constant_ids.append(id(obj))
            if is_tracer(obj):  # a `jax.grad` or `jax.vmap` around the run, closed over
                self.tracers.append(obj)
            return ("jax", self._ref(obj)), None
        if isinstance(obj, np.ndarray):
            self.unguarded.append(text(where))
            data = np.ascontiguousarray(obj)
            digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
            return ("np", data.shape, data.dtype.str, digest), None
        if is_tracer(obj) or obj.size > _SMALL:
            return ("jax", self._ref(obj)), None
        data = np.asarray(obj)
        digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
        return ("jaxv", data.shape, data.dtype.str, digest), None

    def _guard(self, obj: Any, read: Callable[[Any], tuple], seen: tuple) -> Guard:
        """Records that the walk read `seen` of `obj`, as `read(obj)` reads it again."""
        guard = Guard(obj, read, seen, {})
        self.guards.append(guard)
        return guard

    def _library(self, obj: Any, where: Any) -> tuple[Any, Any]:
        found = parts(obj)
        if found is OPAQUE:
            self.opaque.append(f"{text(where) or 'a value'} ({type(obj).__qualname__})")
            return ("opaque", self._ref(obj)), None
        if found is None:
            try:
                if type(obj).__hash__ is not object.__hash__:
                    return ("value", type(obj), obj, hash(obj)), None
            except TypeError:
                pass
            return ("id", self._ref(obj)), None
        return self._frozen(obj, ("library", self._class(type(obj))), library_parts, where)

    def _library_module(self, module: types.ModuleType, where: Any) -> tuple[Any, Any]:
        """A library's module: the values (not code) it holds that the code names,
        `os.environ` say, by content."""
        names = sorted(self.names)
        self._modules.append((module, set(names)))

        def read(m: types.ModuleType) -> list:
            d = vars(m)
            return [(n, d[n]) for n in names if n in d and state(d[n])]

        return self._frozen(module, ("module", module.__name__), read, where)

    def _module(self, module: types.ModuleType, where: Any) -> tuple[Any, Any]:
        """A user's own module: the attributes that the code walked so far names."""
        if ALL_NAMES in self.names:  # read by computed names: all of its state
            names_ = [n for n, v in vars(module).items() if n in self.names or state(v)]
        else:
            names_ = self.names
        known_names = sorted(n for n in names_ if n[:2] != "__")
        self._modules.append((module, set(self.names)))
        d = vars(module)
        names = tuple(n for n in known_names if n in d)
        at = where or module.__name__

        def read(m: types.ModuleType) -> list:
            d = vars(m)
            return [(ATTR, n, d[n], (at, "{}.{}", n)) for n in known_names if n in d]

        return self._mutable(module, ("user module", module.__name__, names), read, where)

    def _function(self, fn: types.FunctionType, where: Any) -> tuple[Any, Any]:
        code = fn.__code__
        name = fn.__qualname__
        names = code_names(code)
        self.names.update(names)
        if not library(fn):
            if not _DYNAMIC.isdisjoint(names):  # `getattr(cfg, name)`, `vars(cfg)`
                self.names.add(ALL_NAMES)
            if not _LOOKUPS.isdisjoint(names):
                self.opaque.append(
                    f"{name}: looks modules or globals up by name (sys.modules, "
                    "importlib, globals()), which no guard can follow"
                )
        cells: list = list(fn.__closure__ or ())
        keys: list = []
        for var, cell in zip(code.co_freevars, cells):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                keys.append(EMPTY)
                continue
            keys.append(self._walk(value, (name, "{}: closure variable `{}`", var))[0])
        extra = [fn.__defaults__, fn.__kwdefaults__, fn.__dict__ or None]
        for value, form in zip(extra, ("{}: default{}", "{}: default{}", "{}.{}")):
            keys.append(self._walk(value, (name, form, ""))[0])
        gkey, _ = self._globals_of(fn.__globals__, names, name)
        self._guard(fn, function_parts, function_parts(fn))
        # Read, never copied: the trace runs `fn` itself (no part of it is a site).
        return ("fn", code, tuple(keys), gkey), None

    def _globals_of(self, g: dict, names: tuple, fn: str) -> tuple[Any, Any]:
        """The globals a function reads: entries of its module's namespace."""
        self._keep.append(g)

        def read(g: dict) -> list:
            return [(ITEM, n, g[n], (fn, "{}: global `{}`", n)) for n in names if n in g]

        def guard(g: dict) -> tuple:
            return tuple([g.get(n, EMPTY) for n in names])

        at = [i for i, n in enumerate(names) if n in g]
        # By the content read, not the module: a function made per call by `exec`
        # (a namedtuple's `__new__`) has globals of its own each time.
        return self._mutable(g, ("globals",), read, "", (guard, at))

    def _class(self, cls: type) -> Any:
        """A class's key: its attributes by content, its bases and metaclass; library
        classes by identity.

        A user's class is its content, not its identity, so that a class defined
        again on each call (equal code, equal attributes) selects one program. Which
        classes are the same object is in the key too: a class met again in the walk
        is a back-reference to its first place (`isinstance(obj, cls)` is then right
        for two classes equal in content)."""
        if library(cls):
            return ("type", self._ref(cls))
        found = self._classes.get(id(cls))
        if found is not None and found[0] is cls:
            return ("class@", found[1])
        self._classes[id(cls)] = (cls, len(self._classes))
        key, _ = self._frozen(cls, ("class", cls.__qualname__), class_parts, "", class_guard)
        return key


# Code that names one of these may read any attribute of a module: all are keyed.
_DYNAMIC = frozenset({"getattr", "hasattr", "vars", "__dict__", "__getattribute__"})
ALL_NAMES = "*"  # in `names`: every attribute of the user's modules
# Code that names one of these may reach any module: the run is not cached.
_LOOKUPS = frozenset({"modules", "import_module", "__import__", "reload", "globals"})


def state(value: Any) -> bool:
    """A module attribute that is state, not code (a function, class, module)."""
    return not (
        callable(value) or isinstance(value, (types.ModuleType, type(Ellipsis)))
    ) and not isinstance(value, type)


def vars_of(obj: Any) -> Any:
    attrs = attribute(obj, "__dict__")
    return dict(attrs) if isinstance(attrs, dict) else None

"""How a walk reads code: functions (closure cells, defaults, attributes, the globals
their code names), modules (the user's own, and a library's values), and classes; and
library values and large dicts.

`CodeWalk` is the part of `_closures.Walk` that walks them; `Ref` and `text` are the
pieces of a key and of a place that both use.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

from ._kinds import OPAQUE, attribute, parts
from ._plans import ATTR, ITEM, Cell, Copied, Rebuilt
from ._reach import SKIPPED, code_names, library
from ._reads import WHOLE, known


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
    _cells: dict[int, Cell]
    reads: dict | None
    opaque: list[str]

    def _walk(self, obj: Any, where: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def _ref(self, obj: Any) -> Ref:
        raise NotImplementedError

    def _mutable(self, obj: Any, head: tuple, slots: list[tuple], where: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def _frozen(self, obj: Any, head: tuple, values: list, where: Any = "") -> tuple[Any, Any]:
        raise NotImplementedError

    def _large_dict(self, obj: dict, where: Any) -> tuple[Any, Any]:
        """A large dict: the entries traces read at its place (`_reads`), once known."""
        place = text(where)
        read = known(place) if self.reads is None else self.reads.get(place, WHOLE)
        if read is None:  # WHOLE
            slots = [(ITEM, k, v) for k, v in obj.items()]
            head: tuple = ("container", place)
        else:
            slots = [(ITEM, k, obj[k]) for k in read if k in obj]
            head = ("read", place, frozenset((k, k in obj) for k in read))
        key, plan = self._mutable(obj, head, slots, where)
        if plan is None:
            plan = Copied(obj)
            self._seen[id(obj)] = (self._seen[id(obj)][0], plan)
        plan.place = place
        return key, plan

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
        head, values = found  # pyright: ignore[reportGeneralTypeIssues]
        return self._frozen(obj, (*head, self._class(type(obj))), values, where)

    def _library_module(self, module: types.ModuleType, where: Any) -> tuple[Any, Any]:
        """A library's module: the values (not code) it holds that the code names,
        `os.environ` say, by content."""
        self._modules.append((module, set(self.names)))
        d = vars(module)
        values = [(n, d[n]) for n in sorted(self.names) if n in d and state(d[n])]
        return self._frozen(module, ("module", module.__name__), values, where)

    def _module(self, module: types.ModuleType, where: Any) -> tuple[Any, Any]:
        """A user's own module: the attributes that the code walked so far names."""
        self._modules.append((module, set(self.names)))
        d = vars(module)
        names = sorted(n for n in self.names if n in d and n[:2] != "__")
        slots = [(ATTR, n, d[n], ((where or module.__name__), "{}.{}", n)) for n in names]
        return self._mutable(module, ("user module", module.__name__, tuple(names)), slots, where)

    def _function(self, fn: types.FunctionType, where: Any) -> tuple[Any, Any]:
        code = fn.__code__
        name = fn.__qualname__
        names = code_names(code)
        self.names.update(names)
        cells: list = list(fn.__closure__ or ())
        g = fn.__globals__
        extra = [fn.__defaults__, fn.__kwdefaults__, fn.__dict__ or None]
        plan = Rebuilt(fn, _function_maker(fn), [*cells, *extra, g], [])
        # Registered before the parts: a function that reads itself (a global, a cell)
        # finds it.
        self._seen[id(fn)] = (self._seen[id(fn)][0], plan)
        keys: list = []
        for var, cell in zip(code.co_freevars, cells):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                keys.append(EMPTY)
                plan.planned.append(None)
                continue
            k, p = self._walk(value, (name, "{}: closure variable `{}`", var))
            keys.append(k)
            plan.planned.append(None if p is None else self._cell(cell, p))
        for value, form in zip(extra, ("{}: default{}", "{}: default{}", "{}.{}")):
            k, p = self._walk(value, (name, form, ""))
            keys.append(k)
            plan.planned.append(p)
        read = [(ITEM, n, g[n], (name, "{}: global `{}`", n)) for n in names if n in g]
        gkey, gplan = self._globals_of(g, read)
        plan.planned.append(gplan)
        key = ("fn", code, tuple(keys), gkey)
        return key, (None if all(p is None for p in plan.planned) else plan)

    def _cell(self, cell: Any, plan: Any) -> Cell:
        found = self._cells.get(id(cell))
        if found is None:
            found = self._cells[id(cell)] = Cell(cell, plan)
        return found

    def _globals_of(self, g: dict, read: list[tuple]) -> tuple[Any, Any]:
        """The globals a function reads: entries of its module's namespace, which the
        trace reads through an overlay (a copy) when one of them is a site."""
        self._keep.append(g)
        return self._mutable(g, ("globals", Ref(g)), read, "")

    def _class(self, cls: type) -> Any:
        """A class's key: its attributes by content (a trace cannot be given a copy of
        a class), its bases and metaclass; library classes by identity."""
        if library(cls):
            return ("type", self._ref(cls))
        found = self._classes.get(id(cls))
        if found is not None and found[0] is cls:
            return found[1]
        self._classes[id(cls)] = (cls, ("class", id(cls)))  # a cycle back to `cls`
        values = [(k, v) for k, v in vars(cls).items() if k not in SKIPPED]
        bases = [b for b in cls.__mro__[1:] if not library(b)]
        key, _ = self._frozen(cls, ("class", cls.__qualname__), [values, bases, type(cls)])
        key = (*key, self._ref(cls))
        self._classes[id(cls)] = (cls, key)
        return key


EMPTY = ("empty cell",)


def state(value: Any) -> bool:
    """A module attribute that is state, not code (a function, class, module)."""
    return not (
        callable(value) or isinstance(value, (types.ModuleType, type(Ellipsis)))
    ) and not isinstance(value, type)


def vars_of(obj: Any) -> Any:
    attrs = attribute(obj, "__dict__")
    return dict(attrs) if isinstance(attrs, dict) else None


def _function_maker(fn: types.FunctionType) -> Callable[[list], Any]:
    """Makes `fn` again from its parts: fresh cells, defaults, keyword defaults, its
    attributes and an overlay of its globals."""
    n = len(fn.__closure__ or ())

    def make(p: list) -> Any:
        cells, (defaults, kwdefaults, attrs, g) = p[:n], p[n:]
        new = types.FunctionType(fn.__code__, g, fn.__name__, defaults, tuple(cells) or None)
        new.__kwdefaults__ = kwdefaults
        new.__qualname__ = fn.__qualname__
        new.__module__ = fn.__module__
        new.__doc__ = fn.__doc__
        if attrs is not None:
            new.__dict__ = attrs  # the copy: what the trace writes there is written back
        return new

    return make

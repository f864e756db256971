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
import os
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._jax_compat import is_tracer

RUN, STATIC = "run", "static"
# Objects of these packages are not looked into: library code and constants.
_LIBRARIES = frozenset(
    {"jax", "jaxlib", "equinox", "numpy", "jhooks", "torch", "optax", "functools", "builtins"}
)
_SKIPPED = frozenset(
    {
        "__dict__",
        "__weakref__",
        "__module__",
        "__doc__",
        "__qualname__",
        "__annotations__",
        "__slots__",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__match_args__",
        "__firstlineno__",
        "__static_attributes__",
    }
)
_SMALL = 1 << 16  # JAX arrays up to this size are keyed by content in STATIC mode
_NUMBER_TYPES = (int, float, complex)
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


class _Static:
    __slots__ = ()

    def __repr__(self) -> str:
        return f"jhooks.static({super().__repr__()})"


class _StaticInt(_Static, int):
    __slots__ = ()


class _StaticFloat(_Static, float):
    __slots__ = ()


class _StaticComplex(_Static, complex):
    __slots__ = ()


class _StaticTuple(_Static, tuple):
    __slots__ = ()


def static(value: Any) -> Any:
    """Marks a number a hook reads as static: never traced, each value its own program.

    **Arguments:**

    - `value`: a Python `int`, `float`, `complex`, or a tuple of them (a shape).

    **Returns:**

    An instance of a subclass of the value's type, equal to it, so hook code is
    unchanged.

    [`jhooks.run_with_hooks`][] keeps a Python number a hook reads as a Python value
    until it is seen to change between calls; from then on it is a traced argument,
    so that a sweep compiles once. A number marked static stays a Python value: each
    new value compiles a new program. (A number that tracing needs concretely, in
    `range(n)` or a shape, is made static by itself when its trace fails.)

    **Example:**

    ```python
    def keep_first(z, name, n=jhooks.static(4)):
        return z[:, :n].sum() * jnp.ones_like(z)
    ```
    """
    if isinstance(value, _Static):
        return value
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value  # already static
    if isinstance(value, int):
        return _StaticInt(value)
    if isinstance(value, float):
        return _StaticFloat(value)
    if isinstance(value, complex):
        return _StaticComplex(value)
    if isinstance(value, tuple):
        return _StaticTuple(static(v) for v in value)
    raise TypeError(
        f"jhooks.static takes a Python number or a tuple of them, got {type(value).__name__}. "
        "Arrays stay traced arguments; for a static array index use a tuple of ints."
    )


def number_key(x: Any) -> tuple:
    """A Python number, bit for bit (`0.0` and `-0.0` differ, `1` and `1.0` too)."""
    if isinstance(x, float):
        return (type(x).__name__, float.hex(x))
    if isinstance(x, complex):
        return (type(x).__name__, float.hex(x.real), float.hex(x.imag))
    return (type(x).__name__, int(x))


_INSTALLED = tuple(
    {
        os.path.realpath(sysconfig.get_paths()[k]) + os.sep
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
    }
)


@functools.lru_cache(maxsize=4096)
def _library_module(name: str) -> bool:
    """Code installed as a package (or the standard library) is library code; the
    user's own (scripts, notebooks, tests, a source checkout) is looked into."""
    if name.partition(".")[0] in _LIBRARIES:
        return True
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return module is not None and name != "__main__"  # builtin modules
    return os.path.realpath(path).startswith(_INSTALLED)


def _library(obj: Any) -> bool:
    module = getattr(obj, "__module__", None)
    return not isinstance(module, str) or _library_module(module)


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The global and attribute names a code object (and the code nested in it) reads."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_names(const))
    return tuple(dict.fromkeys(names))


# Where a site or a child lives: how `install` reaches it.
CELL, ITEM, ATTR, TYPE_ATTR, VISIT = range(5)


class Mutable:
    """A plan: an object used as it is, with these slots set during the trace."""

    __slots__ = ("obj", "slots")

    def __init__(self, obj: Any):
        self.obj = obj
        self.slots: list[tuple[int, Any, Any, Any]] = []  # (how, holder, key, plan)


class Rebuilt:
    """A plan: an immutable object made again from its parts (some of them plans)."""

    __slots__ = ("obj", "make", "parts", "planned")

    def __init__(self, obj: Any, make: Callable[[list], Any], parts: list, planned: list):
        self.obj, self.make, self.parts, self.planned = obj, make, parts, planned


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
                f"{where or 'a value'} holds objects nested too deeply to guard (over "
                "about 5000 levels): pass the values the run needs as arguments instead."
            ) from None
        finally:
            sys.setrecursionlimit(limit)
        return key

    def _ref(self, obj: Any) -> Ref:
        ref = Ref(obj)
        self.refs.append(ref)
        return ref

    def _site(self, obj: Any, where: str, key: Any) -> tuple[Any, Any]:
        self.sites.append(obj)
        self.where.append(where)
        return key, len(self.sites) - 1

    def _walk(self, obj: Any, where: str) -> tuple[Any, Any]:
        """`(key, plan)`; the plan is `None` when nothing in `obj` is a site."""
        if isinstance(obj, _ATOMS):
            return obj, None
        kind = type(obj)
        if kind is int or kind is float or kind is complex:
            if self.mode == RUN:
                return self._site(obj, where, ("n", kind.__name__))
            return number_key(obj), None
        if isinstance(obj, _Static):
            value = tuple(map(number_key, obj)) if isinstance(obj, tuple) else number_key(obj)
            return ("static", value), None
        if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
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
        if isinstance(obj, (list, dict, set)) and key[0] != "written":
            items = obj.values() if isinstance(obj, dict) else obj
            numbers = tuple(number_key(x) for x in items if type(x) in _NUMBER_TYPES)
            self.containers[id(obj)] = (obj, (key, numbers))
        return key, plan

    def _array(self, obj: Any, where: str) -> tuple[Any, Any]:
        if isinstance(obj, np.ndarray) and obj.dtype == object:
            raise TypeError(
                f"{where or 'a value'} is a NumPy array of Python objects, which a compiled "
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

    def _compound(self, obj: Any, where: str) -> tuple[Any, Any]:
        if isinstance(obj, types.FunctionType):
            if _library(obj):
                return ("lib", self._ref(obj)), None
            return self._function(obj, where)
        if isinstance(obj, functools.partial):
            return self._rebuilt(
                obj,
                ("partial", type(obj)),
                [obj.func, *obj.args, *obj.keywords.values()],
                [where, *(f"{where}: partial argument {i}" for i in range(len(obj.args)))]
                + [f"{where}: partial keyword `{k}`" for k in obj.keywords],
                lambda p, n=len(obj.args), ks=tuple(obj.keywords): type(obj)(
                    p[0], *p[1 : n + 1], **dict(zip(ks, p[n + 1 :]))
                ),
            )
        if isinstance(obj, types.MethodType):
            return self._rebuilt(
                obj,
                ("method",),
                [obj.__func__, obj.__self__],
                [where, f"{where}: self"],
                lambda p: types.MethodType(p[0], p[1]),
            )
        if isinstance(obj, tuple) and (type(obj) is tuple or hasattr(obj, "_fields")):
            return self._rebuilt(
                obj,
                ("tuple", type(obj)),
                list(obj),
                [f"{where}[{i}]" for i in range(len(obj))],
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
            return ("module", self._ref(obj)), None
        if isinstance(obj, type):
            return self._class(obj, where)
        if isinstance(obj, (staticmethod, classmethod)):
            return self._mutable(obj, ("sm", type(obj)), [(VISIT, None, None, obj.__func__)], where)
        if isinstance(obj, property):
            parts = [(VISIT, None, None, f) for f in (obj.fget, obj.fset, obj.fdel)]
            return self._mutable(obj, ("property",), parts, where)
        node = _children(obj)
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
        if unwrapped is not None and _library(type(obj)) and callable(obj):
            # A library wrapper of user code (`jax.jit(f)`): f is what runs.
            key, plan = self._walk(unwrapped, where)
            return ("wrapped", type(obj), key), _visit(obj, plan)
        if _namespace(obj):
            return self._object(obj, where)
        if _library(type(obj)) or not (hasattr(obj, "__dict__") or _slot_names(type(obj))):
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

    def _mutable(self, obj: Any, head: tuple, slots: list[tuple], where: str) -> tuple[Any, Any]:
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
                at = f"{where}.{name}"
            else:
                at = where if how == VISIT else f"{where}[{name!r}]"
            k, p = self._walk(value, at)
            keys.append(k)
            if p is not None:
                plan.slots.append((how, holder, name, p))
        key = (*head, tuple(keys))
        return key, (plan if plan.slots else None)

    def _function(self, fn: types.FunctionType, where: str) -> tuple[Any, Any]:
        code = fn.__code__
        name = fn.__qualname__
        slots: list[tuple] = []
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                slots.append((CELL, cell, var, cell.cell_contents, f"{name}: closure variable `{var}`"))
            except ValueError:  # an empty cell
                slots.append((VISIT, None, var, _EMPTY))
        if fn.__defaults__:
            slots.append((ATTR, fn, "__defaults__", fn.__defaults__, f"{name}: default"))
        for k, v in (fn.__kwdefaults__ or {}).items():
            slots.append((ITEM, fn.__kwdefaults__, k, v, f"{name}: default `{k}`"))
        g = fn.__globals__
        names = _names(code)
        for n in names:
            if n in g:
                value = g[n]
                slots.append((ITEM, g, n, value, f"{name}: global `{n}`"))
                if isinstance(value, types.ModuleType) and not _library(value):
                    # `config.SCALE` in a user module `config`: the names the code reads.
                    d = value.__dict__
                    slots.extend(
                        (ITEM, d, a, d[a], f"{name}: `{n}.{a}`")
                        for a in names
                        if a in d and a[:2] != "__"
                    )
        return self._mutable(fn, ("fn", code, Ref(g)), slots, where or name)

    def _class(self, cls: type, where: str) -> tuple[Any, Any]:
        if _library(cls):
            return ("type", self._ref(cls)), None
        slots: list[tuple] = [
            (TYPE_ATTR, cls, k, v) for k, v in vars(cls).items() if k not in _SKIPPED
        ]
        slots.extend((VISIT, None, None, base) for base in cls.__mro__[1:-1])
        return self._mutable(cls, ("class", self._ref(cls)), slots, cls.__qualname__)

    def _object(self, obj: Any, where: str) -> tuple[Any, Any]:
        cls = type(obj)
        slots: list[tuple] = [(VISIT, None, None, cls)]
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            slots.extend((ATTR, obj, k, v) for k, v in list(attrs.items()))
        for name in _slot_names(cls):
            if hasattr(obj, name):
                slots.append((ATTR, obj, name, getattr(obj, name)))
        at = where or f"a {cls.__qualname__}"
        return self._mutable(obj, ("object",), slots, at)


_EMPTY = ("empty cell",)


def _namespace(obj: Any) -> bool:
    """Library objects that are only their attributes: looked into."""
    name = type(obj).__name__
    return (name == "SimpleNamespace" or name == "Namespace") and isinstance(
        getattr(obj, "__dict__", None), dict
    )


def _visit(obj: Any, plan: Any) -> Any:
    if plan is None:
        return None
    mutable = Mutable(obj)
    mutable.slots.append((VISIT, None, None, plan))
    return mutable


_slots: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _slot_names(cls: type) -> tuple[str, ...]:
    """The `__slots__` of a class and its bases (cached weakly: classes may die)."""
    found = _slots.get(cls)
    if found is None:
        names: list[str] = []
        for klass in cls.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            names.extend([slots] if isinstance(slots, str) else slots)
        found = _slots[cls] = tuple(n for n in names if n not in ("__dict__", "__weakref__"))
    return found


def _children(obj: Any) -> tuple[list, Any] | None:
    """A pytree node's children and structure, one level down; `None` for a leaf."""
    children, treedef = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)
    if jax.tree_util.treedef_is_leaf(treedef):
        return None
    return children, treedef


def _get(how: int, holder: Any, key: Any) -> Any:
    if how == CELL:
        return holder.cell_contents
    if how == ITEM:
        return holder[key]
    return vars(holder)[key] if how == TYPE_ATTR else object.__getattribute__(holder, key)


def _set(how: int, holder: Any, key: Any, value: Any) -> None:
    if how == CELL:
        holder.cell_contents = value
    elif how == ITEM:
        holder[key] = value
    elif how == TYPE_ATTR:
        setattr(holder, key, value)
    else:
        object.__setattr__(holder, key, value)


def install(plan: Any, values: list, undo: list, memo: dict[int, Any] | None = None) -> Any:
    """The object of `plan` with `values[i]` at site `i`: mutable holders get them in
    place (each change recorded in `undo` for `restore`), immutable ones are rebuilt."""
    if type(plan) is int:
        return values[plan]
    memo = {} if memo is None else memo
    done = memo.get(id(plan))
    if done is not None:
        return done
    if isinstance(plan, Mutable):
        memo[id(plan)] = plan.obj
        for how, holder, key, child in plan.slots:
            new = install(child, values, undo, memo)
            if how == VISIT:
                continue
            old = _get(how, holder, key)
            if new is not old:
                undo.append((how, holder, key, old, new))
                _set(how, holder, key, new)
        return plan.obj
    parts = [
        part if p is None else install(p, values, undo, memo)
        for part, p in zip(plan.parts, plan.planned)
    ]
    same = all(a is b for a, b in zip(parts, plan.parts))
    out = plan.obj if same else plan.make(parts)
    memo[id(plan)] = out
    return out


def sites_in(plan: Any) -> set[int]:
    """The sites a plan puts values at."""
    found: set[int] = set()
    stack, seen = [plan], set()
    while stack:
        p = stack.pop()
        if type(p) is int:
            found.add(p)
        elif p is not None and id(p) not in seen:
            seen.add(id(p))
            stack.extend(s[3] for s in p.slots) if isinstance(p, Mutable) else stack.extend(
                p.planned
            )
    return found


def restore(undo: list) -> None:
    """Undoes `install`, newest change first. A slot that the traced code assigned a
    concrete value keeps it (a counter it incremented); one holding a tracer is reset."""
    while undo:
        how, holder, key, old, new = undo.pop()
        try:
            current = _get(how, holder, key)
        except (AttributeError, KeyError, IndexError):
            current = new
        if current is new or is_tracer(current):
            _set(how, holder, key, old)


def static_key(obj: Any) -> Any:
    """`obj`'s key with every value by content: what makes two registered hooks equal."""
    return Walk(STATIC)(obj)

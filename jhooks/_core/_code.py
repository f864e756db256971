"""How a walk reads code: functions (closure cells, defaults, attributes, the globals
their code names), modules (the user's own, and a library's values), and classes; and
library values and arrays.

Each `*_key(walk, obj, where)` is a step of `_closures.Walk` (which walks the rest);
`Ref` and `text` are the pieces of a key and of a place that both use.
"""

from __future__ import annotations

import collections
import hashlib
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._entries import ATTR, CELL, ITEM, record
from ._guards import NOT_NUMBERS, Guard
from ._jax_compat import is_tracer
from ._kinds import ITERATOR, OPAQUE, attribute, parts
from ._parts import EMPTY, class_guard, class_parts, function_parts, library_parts
from ._parts import cell_contents_or_empty as cell_or_empty
from ._reach import _library_module, code_names, library, slot_names
from ._static import number_key

if TYPE_CHECKING:
    from ._closures import Walk

RUN, STATIC = "run", "static"
_SMALL = 1 << 16  # JAX arrays up to this size are keyed by content in STATIC mode


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


# What a guard reads again: not the walk, which holds what it visited.
def container_slots(obj: Any) -> list[tuple]:
    items = enumerate(obj) if isinstance(obj, list) else obj.items()
    slots = [(ITEM, k, v) for k, v in items]
    if isinstance(obj, collections.defaultdict):  # what a missing key gives
        slots.append((ATTR, "default_factory", obj.default_factory))
    return slots if type(obj) is dict or type(obj) is list else slots + attributes_of(obj)


def items_of(obj: list | dict) -> tuple:
    """What a walk reads of a list or dict: its values, then its keys (by identity)."""
    if type(obj) is list:
        return (*obj, len(obj), list)
    return (*obj.values(), *obj, dict)  # pyright: ignore[reportAttributeAccessIssue]


def attributes_of(obj: Any) -> list[tuple]:
    slots: list[tuple] = []
    attrs = attribute(obj, "__dict__")
    if isinstance(attrs, dict):
        slots.extend((ATTR, k, v) for k, v in list(attrs.items()))
    for name in slot_names(type(obj)):
        value = attribute(obj, name)
        if value is not None or hasattr(obj, name):
            slots.append((ATTR, name, value))
    return slots


_BY_VALUE = (str, bytes, type(None), bool, type(Ellipsis), types.CodeType, range, slice)


def written_key(value: Any) -> Any:
    """What the walks before and after a trace compare of an entry, to find what the
    trace wrote: a number bit for bit, a string or a tuple of those by value, anything
    else by identity. Shallow: a write inside a container is that container's entry
    (each container is compared at its own place), not every entry on the way to it,
    which would no longer be read (a later change of a global unseen); and the walk's
    order (which numbers its back-references) is not compared."""
    kind = type(value)
    if kind is int or kind is float or kind is complex:
        return number_key(value)
    if kind is tuple:
        return ("tuple", tuple(map(written_key, value)))
    if isinstance(value, np.generic):
        return ("npv", value.dtype.str, value.tobytes())
    return (kind, value) if isinstance(value, _BY_VALUE) else ("is", id(value))


_ABSENT = ("absent",)
_ADVANCES = frozenset({"next", "__next__"})


def left_key(obj: Any, name: Any) -> Any:
    """What a trace left in entry `name` of `obj` (an item of a dict, else an attribute),
    as `written_key` compares it: a written entry is left out of the key while it holds
    this, and read again once something else changes it. A list a trace wrote (`"*"`,
    `log.append(...)`, which the user may append to as well) stays keyed by identity."""
    if name == "*":
        return None
    if isinstance(obj, dict):
        return written_key(obj[name]) if name in obj else _ABSENT
    try:
        value = getattr(obj, name, _ABSENT)
    except Exception:  # whatever `obj.__getattr__` raises: not there
        return _ABSENT
    return _ABSENT if value is _ABSENT else written_key(value)


def as_left(obj: Any, written: dict[Any, Any]) -> bool:
    """Whether each entry of `obj` a trace wrote holds what the trace left there."""
    return all(left_key(obj, name) == key for name, key in written.items())


def array_key(walk: Walk, obj: Any, where: Any) -> tuple[Any, Any]:
    if isinstance(obj, np.ndarray) and obj.dtype.kind in NOT_NUMBERS:
        what = "Python objects" if obj.dtype == object else f"dtype {obj.dtype}"
        if not walk._tree and obj.dtype != object:  # strings read: keyed by their bytes
            return _numpy_key(walk, obj, where), None
        if not walk._tree:
            walk.opaque.append(f"{text(where) or 'a value'} (a NumPy array of {what})")
            return ("opaque", walk._ref(obj)), None
        raise TypeError(
            f"{text(where) or 'a value'} is a NumPy array of {what}, which a compiled "
            "run can neither trace nor guard: pass an array of numbers."
        )
    if walk._tree:
        return walk._site(obj, where, "a")
    if isinstance(obj, np.generic):  # immutable: by value
        return ("npv", obj.dtype.str, obj.tobytes()), None
    if walk.mode == RUN and not isinstance(obj, np.ndarray):
        # A JAX array the run reads from outside its arguments: a constant of the
        # trace, keyed by identity (immutable; rebound, it is another program).
        walk.constants.append(where)
        walk.constant_refs.append(weakref.ref(obj))
        if is_tracer(obj):  # a `jax.grad` or `jax.vmap` around the run, closed over
            walk.tracers.append(obj)
        return ("jax", walk._ref(obj)), None
    if isinstance(obj, np.ndarray):
        return _numpy_key(walk, obj, where), None
    if is_tracer(obj) or obj.size > _SMALL:
        return ("jax", walk._ref(obj)), None
    data = np.asarray(obj)
    digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
    return ("jaxv", data.shape, data.dtype.str, digest), None


def by_identity(walk: Walk, obj: Any, where: Any) -> Ref:
    """An object whose class keeps Python's identity equality, in the key by identity as
    well as by content (`SCALES[obj]`, `obj in ACTIVE`, `BY_ID[id(obj)]` tell two such
    objects apart, equal in content or not), and where it was read, as a JAX array read
    outside the arguments is (`warn_rebound` tells when a new one traces again)."""
    ref = walk._ref(obj)
    walk.constants.append(where)
    walk.constant_refs.append(ref)
    return ref


def _numpy_key(walk: Walk, obj: np.ndarray, where: Any) -> tuple:
    """A NumPy array read outside the arguments: its bytes, read again on every call
    (no guard), and a subclass's attributes (a masked array's mask)."""
    walk.unguarded.append(text(where))
    data = np.ascontiguousarray(obj)
    digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
    extra = vars_of(obj) if type(obj) is not np.ndarray else None
    more = () if not extra else (walk._walk(extra, where)[0],)
    return ("np", type(obj), data.shape, data.dtype.str, digest, *more)


def add_guard(walk: Walk, obj: Any, read: Callable[[Any], tuple], seen: tuple) -> Guard:
    """Records that the walk read `seen` of `obj`, as `read(obj)` reads it again."""
    guard = Guard(obj, read, seen, {})
    walk.guards.append(guard)
    return guard


def library_key(walk: Walk, obj: Any, where: Any) -> tuple[Any, Any]:
    found = parts(obj)
    if found is ITERATOR:  # opaque where walked code advances one (`next(it)`)
        found = OPAQUE if not walk.names.isdisjoint(_ADVANCES) else None
    if found is OPAQUE:
        walk.opaque.append(f"{text(where) or 'a value'} ({type(obj).__qualname__})")
        return ("opaque", walk._ref(obj)), None
    if found is None:
        try:
            if type(obj).__hash__ is not object.__hash__:
                return ("value", type(obj), obj, hash(obj)), None
        except (TypeError, ValueError):  # unhashable
            pass
        return ("id", walk._ref(obj)), None
    return walk._frozen(obj, ("library", class_key(walk, type(obj))), library_parts, where)


def library_module_key(walk: Walk, module: types.ModuleType, where: Any) -> tuple[Any, Any]:
    """A library's module: the values (not code) it holds that the code names,
    `os.environ` say, by content."""
    names = sorted(walk.names)
    walk._modules.append((module, set(names)))

    def read(m: types.ModuleType) -> list:
        d = vars(m)
        return [(n, d[n]) for n in names if n in d and state(d[n])]

    return walk._frozen(module, ("module", module.__name__), read, where)


def module_key(walk: Walk, module: types.ModuleType, where: Any) -> tuple[Any, Any]:
    """A user's own module: the attributes that the code walked so far names."""
    if ALL_NAMES in walk.names:  # read by computed names: all of its state
        names_ = [n for n, v in vars(module).items() if n in walk.names or state(v)]
    else:
        names_ = walk.names
    known_names = sorted(n for n in names_ if n[:2] != "__")
    walk._modules.append((module, set(walk.names)))
    d = vars(module)
    names = tuple(n for n in known_names if n in d)
    at = where or module.__name__

    def read(m: types.ModuleType) -> list:
        d = vars(m)
        return [(ATTR, n, d[n], (at, "{}.{}", n)) for n in known_names if n in d]

    return walk._mutable(module, ("user module", module.__name__, names), read, where)


def function_key(walk: Walk, fn: types.FunctionType, where: Any) -> tuple[Any, Any]:
    code = fn.__code__
    name = fn.__qualname__
    names = code_names(code)
    walk.names.update(names)
    if not library(fn):
        if not _DYNAMIC.isdisjoint(names):  # `getattr(cfg, name)`, `vars(cfg)`
            walk.names.add(ALL_NAMES)
        if not _LOOKUPS.isdisjoint(names):
            walk.opaque.append(
                f"{name}: looks modules or globals up by name (sys.modules, "
                "importlib, globals(), eval), which no guard can follow"
            )
    cells: list = list(fn.__closure__ or ())
    keys: list = []
    for var, cell in zip(code.co_freevars, cells):
        value = cell_or_empty(cell)
        if walk.record:  # a traced value the trace left in a cell is taken back (by name)
            record(walk.held, cell, [] if value is EMPTY else [(CELL, var, value)])
        at = (name, "{}: closure variable `{}`", var)
        keys.append(EMPTY if value is EMPTY else walk._walk(value, at)[0])
    extra = [fn.__defaults__, fn.__kwdefaults__, fn.__dict__ or None]
    for value, form in zip(extra, ("{}: default{}", "{}: default{}", "{}.{}")):
        keys.append(walk._walk(value, (name, form, ""))[0])
    gkey, _ = _globals_of(walk, fn.__globals__, names, name)
    add_guard(walk, fn, function_parts, function_parts(fn))
    # Read, never copied: the trace runs `fn` itself (no part of it is a site).
    return ("fn", code, tuple(keys), gkey), None


def _globals_of(walk: Walk, g: dict, names: tuple, fn: str) -> tuple[Any, Any]:
    """The globals a function reads: entries of its module's namespace."""
    walk._keep.append(g)

    def read(g: dict) -> list:
        return [(ITEM, n, g[n], (fn, "{}: global `{}`", n)) for n in names if n in g]

    def guard(g: dict) -> tuple:
        return tuple([g.get(n, EMPTY) for n in names])

    at = [i for i, n in enumerate(names) if n in g]
    # By the content read, not the module: a function made per call by `exec`
    # (a namedtuple's `__new__`) has globals of its own each time.
    return walk._mutable(g, ("globals",), read, "", (guard, at))


def class_key(walk: Walk, cls: type) -> Any:
    """A class's key: its attributes by content, its bases and metaclass; library
    classes by identity.

    A user's class is its content, not its identity, so that a class defined
    again on each call (equal code, equal attributes) selects one program. Which
    classes are the same object is in the key too: a class met again in the walk
    is a back-reference to its first place (`isinstance(obj, cls)` is then right
    for two classes equal in content)."""
    if library(cls):
        return ("type", walk._ref(cls))
    found = walk._classes.get(id(cls))
    if found is not None and found[0] is cls:
        return ("class@", found[1])
    walk._classes[id(cls)] = (cls, len(walk._classes))
    if walk.record:  # a traced value the trace left in a class attribute is taken back
        record(walk.held, cls, [(ATTR, k, v) for k, v in vars(cls).items()])
    key, _ = walk._frozen(cls, ("class", cls.__qualname__), class_parts, "", class_guard)
    return key


# Code that names one of these may read any attribute of a module: all are keyed.
_DYNAMIC = frozenset({"getattr", "hasattr", "vars", "__dict__", "__getattribute__"})
ALL_NAMES = "*"  # in `names`: every attribute of the user's modules
# Code that names one of these may reach any module: the run is not cached.
_LOOKUPS = frozenset(
    {"modules", "import_module", "__import__", "reload", "globals", "eval", "exec"}
)


def names_grew(names: set[str], modules: list) -> bool:
    """Whether one of `modules` (each with the names known when it was walked) was walked
    before all the `names` code reads were known."""
    for module, seen in modules:
        if ALL_NAMES in names and ALL_NAMES not in seen:
            return True
        d = vars(module)
        user = not _library_module(module.__name__)
        if any(n in d and (user or state(d[n])) for n in names - seen):
            return True
    return False


def state(value: Any) -> bool:
    """A module attribute that is state, not code (a function, class, module)."""
    return not (
        callable(value) or isinstance(value, (types.ModuleType, type(Ellipsis)))
    ) and not isinstance(value, type)


def vars_of(obj: Any) -> Any:
    attrs = attribute(obj, "__dict__")
    return dict(attrs) if isinstance(attrs, dict) else None

"""Hooks split into a static structure (a jit key) and the values they close over.

`split(obj, mode, leaves, names)` walks a hook, a function, an argument: its code,
closure cells, defaults, `functools.partial` arguments, the module globals its code
reads, containers and pytrees, recursively. It returns a hashable key of everything
that decides what the code computes (code objects, container structure, strings,
objects by identity), and appends the values (arrays, and for hooks Python numbers)
to `leaves`. `rebuild(obj, mode, leaves)` walks the same object in the same order and
returns a copy with the next value of `leaves` (tracers, inside a compiled program) in
place of each: functions are remade with `types.FunctionType` and fresh cells.

Modes: `TRACE` (forward hooks: numbers and arrays are values), `ARRAYS` (the function
and its arguments: arrays are values, numbers are keyed by value, as in
`eqx.filter_jit`), `KEY` (predicates, backward hooks: everything is keyed, nothing is
rebuilt). Python floats are keyed bit for bit (`float.hex`), so 0.0 and -0.0 differ.
Objects are keyed by identity through weak references where Python allows them, so
a key never keeps a model alive.
"""

from __future__ import annotations

import dis
import functools
import types
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TRACE, ARRAYS, KEY = "trace", "arrays", "key"
_MAX_DEPTH = 8
# Code from these packages is not looked into: its globals are library constants.
_LIBRARIES = ("jax", "jaxlib", "equinox", "numpy", "jhooks", "torch", "optax", "functools")


class _Static:
    """Marks a value as static: part of the jit key, never a traced argument."""

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
    """Marks a number a hook closes over as static: the compiled program depends on it.

    **Arguments:**

    - `value`: a Python `int`, `float`, `complex`, or a tuple of them (a shape).

    **Returns:**

    An instance of a subclass of the value's type, equal to it, so hook code is
    unchanged.

    [`jhooks.run_with_hooks`][] passes the numbers and arrays a hook closes over to the
    compiled program as arguments, so that a sweep over a head index compiles once.
    A value used where Python needs it concretely (`range(n)`, a shape, `if scale:`,
    an index into a Python list) must be static instead: each new value compiles a
    new program.

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


class Ref:
    """An object in a jit key, by identity, held weakly when Python allows it."""

    __slots__ = ("_get", "_id")

    def __init__(self, obj: Any):
        try:
            self._get = weakref.ref(obj)
        except TypeError:
            self._get = lambda: obj
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


def _number_key(x: Any) -> tuple:
    if isinstance(x, float):
        return (type(x).__name__, float.hex(x))
    if isinstance(x, complex):
        return (type(x).__name__, float.hex(x.real), float.hex(x.imag))
    return (type(x).__name__, int(x))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, complex)) and not isinstance(x, (bool, _Static))


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and not isinstance(x, np.bool_)


def _fits(x: Any) -> bool:
    """A Python int that fits a weakly typed int32 scalar (others stay keyed)."""
    return not isinstance(x, int) or -(2**31) <= x < 2**31


def _library(fn: types.FunctionType) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module.split(".")[0] in _LIBRARIES


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return list(dict.fromkeys(names))


@functools.lru_cache(maxsize=4096)
def _writes_globals(code: types.CodeType) -> bool:
    for ins in dis.get_instructions(code):
        if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            return True
    return any(_writes_globals(c) for c in code.co_consts if isinstance(c, types.CodeType))


def _globals_of(fn: types.FunctionType) -> list[tuple[str, Any]]:
    g = fn.__globals__
    return [(n, g[n]) for n in _global_names(fn.__code__) if n in g]


class _Walk:
    """One traversal: `split` when `leaves` is a list to fill, `rebuild` when an iterator."""

    def __init__(
        self, mode: str, leaves: Any, names: list | None, rebuild: bool, content: bool = False
    ):
        self.content = content  # arguments: containers by content, never by identity
        self.mode = mode
        self.leaves = leaves
        self.names = names
        self.rebuild = rebuild
        self.path: list[int] = []
        self.taken = 0  # values split or rebuilt so far

    def leaf(self, obj: Any, where: str, kind: str = "array") -> Any:
        self.taken += 1
        if self.rebuild:
            return next(self.leaves)
        self.leaves.append(obj)
        if self.names is not None:
            self.names.append((where, kind))
        return ("leaf",)

    def __call__(self, obj: Any, where: str, depth: int = 0) -> Any:
        """The key of `obj` (split) or its rebuilt copy (rebuild)."""
        mode = self.mode
        if obj is None or isinstance(obj, (bool, str, bytes, type, types.ModuleType)):
            return obj
        if isinstance(obj, _Static):
            if isinstance(obj, tuple):
                return obj if self.rebuild else ("static", tuple(_number_key(v) for v in obj))
            return obj if self.rebuild else ("static", _number_key(obj))
        if _is_number(obj):
            if mode == TRACE and _fits(obj):
                value = obj if self.rebuild else jnp.asarray(obj)
                return self.leaf(value, where, type(obj).__name__)
            return obj if self.rebuild else _number_key(obj)
        if _is_array(obj):
            if mode == KEY:
                return Ref(obj)
            return self.leaf(obj, where)
        if depth >= _MAX_DEPTH or id(obj) in self.path:
            return obj if self.rebuild else Ref(obj)
        self.path.append(id(obj))
        try:
            return self._compound(obj, where, depth + 1)
        finally:
            self.path.pop()

    def _compound(self, obj: Any, where: str, depth: int) -> Any:
        walk = functools.partial(self.__call__, depth=depth)
        if isinstance(obj, types.FunctionType):
            return self._function(obj, where, depth)
        if isinstance(obj, functools.partial):
            func = walk(obj.func, where)
            args = tuple(walk(a, f"partial argument {i}") for i, a in enumerate(obj.args))
            kws = {k: walk(v, f"partial keyword `{k}`") for k, v in obj.keywords.items()}
            if self.rebuild:
                return functools.partial(func, *args, **kws)
            return ("partial", type(obj), func, args, tuple(kws.items()))
        if isinstance(obj, types.MethodType):
            func, owner = walk(obj.__func__, where), walk(obj.__self__, where)
            return types.MethodType(func, owner) if self.rebuild else ("method", func, owner)
        if not isinstance(obj, (tuple, list, dict)) and _is_node(obj):
            # A pytree (an Equinox module...): immutable, flattened in one go.
            children, treedef = jax.tree_util.tree_flatten(obj)
            return self._node(obj, treedef, [walk(c, where) for c in children])
        if isinstance(obj, tuple) and self.mode != KEY:
            new = [walk(c, f"{where}[{i}]") for i, c in enumerate(obj)]
            if self.rebuild:
                return type(obj)(new) if type(obj) is tuple else type(obj)(*new)
            return ("tuple", type(obj), tuple(new))
        if isinstance(obj, (tuple, list, dict)):
            if not self.rebuild and self.mode != KEY and not _holds_values(obj, self.mode):
                # Nothing to trace: the object itself. A list is keyed by identity (hooks
                # and counters append to lists); anything else by what it holds now too.
                if isinstance(obj, list) and not self.content:
                    return ("same", Ref(obj))
                mine = None if isinstance(obj, tuple) or self.content else Ref(obj)
                return ("same", mine, _key_only(obj))
            if self.rebuild and not _holds_values(obj, self.mode):
                return obj
            children, treedef = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)
            if isinstance(obj, dict):
                keys = list(obj)
                new = [walk(obj[k], f"{where}[{k!r}]") for k in keys]
                return dict(zip(keys, new)) if self.rebuild else ("dict", tuple(keys), tuple(new))
            new = [walk(c, f"{where}[{i}]") for i, c in enumerate(children)]
            return self._node(obj, treedef, new)
        return obj if self.rebuild else Ref(obj)

    def _node(self, obj: Any, treedef: Any, new: list) -> Any:
        """A pytree node rebuilt from `new`, or its key (by identity if unhashable)."""
        if self.rebuild:
            return jax.tree_util.tree_unflatten(treedef, new)
        try:
            hash(treedef)
        except TypeError:
            return Ref(obj)
        return ("node", treedef, tuple(new))

    def _function(self, fn: types.FunctionType, where: str, depth: int) -> Any:
        walk = functools.partial(self.__call__, depth=depth)
        if _library(fn) or _writes_globals(fn.__code__):
            # A function that assigns globals runs with its own module's: never rebuilt.
            return fn if self.rebuild else Ref(fn)
        taken = self.taken
        name = fn.__code__.co_name
        cells = []
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                cells.append(walk(cell.cell_contents, f"{name}: closure variable `{var}`"))
            except ValueError:  # an empty cell
                cells.append(_EMPTY)
        defaults = tuple(walk(d, f"{name}: default") for d in fn.__defaults__ or ())
        kwdefaults = {
            k: walk(v, f"{name}: default `{k}`") for k, v in (fn.__kwdefaults__ or {}).items()
        }
        found = [(n, walk(v, f"{name}: global `{n}`")) for n, v in _globals_of(fn)]
        if not self.rebuild:
            return (
                "function",
                fn.__code__,
                Ref(fn.__globals__),
                tuple(cells),
                defaults,
                tuple(kwdefaults.items()),
                tuple(found),
            )
        if self.mode == KEY or self.taken == taken:
            return fn  # nothing in it was traced
        g = fn.__globals__
        if any(v is not g[n] for n, v in found):
            g = dict(g)
            g.update(found)
        closure = (
            tuple(types.CellType() if c is _EMPTY else types.CellType(c) for c in cells) or None
        )
        new = types.FunctionType(fn.__code__, g, fn.__name__, defaults or None, closure)
        new.__kwdefaults__ = kwdefaults or None
        new.__qualname__ = fn.__qualname__
        new.__module__ = fn.__module__
        new.__dict__.update(fn.__dict__)
        return new


_EMPTY = object()


def _is_node(obj: Any) -> bool:
    treedef = jax.tree_util.tree_structure(obj, is_leaf=lambda x: x is not obj)
    return not jax.tree_util.treedef_is_leaf(treedef)


def _holds_values(obj: Any, mode: str) -> bool:
    """Whether a container holds something to trace (or a function, or a pytree, that may)."""
    if isinstance(obj, dict):
        return any(_holds_values(v, mode) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_values(v, mode) for v in obj)
    if _is_array(obj) or (mode == TRACE and _is_number(obj) and _fits(obj)):
        return True
    if obj is None or isinstance(obj, (bool, str, bytes, type, int, float, complex)):
        return False
    return callable(obj) or _is_node(obj)


def _key_only(obj: Any) -> Any:
    return _Walk(KEY, [], None, rebuild=False)(obj, "", depth=1)


def split(
    obj: Any,
    mode: str,
    leaves: list,
    names: list | None = None,
    where: str = "",
    content: bool = False,
) -> Any:
    """The jit key of `obj`; appends its values to `leaves` (and their descriptions to `names`).

    `content=True` (arguments) keys containers with nothing to trace by what they
    hold; otherwise (closures, globals) mutable ones by identity as well.
    """
    return _Walk(mode, leaves, names, rebuild=False, content=content)(obj, where)


def rebuild(obj: Any, mode: str, leaves: Any) -> Any:
    """`obj` with the next values of the iterator `leaves` in place of those `split` took."""
    if mode == KEY:
        return obj
    return _Walk(mode, leaves, None, rebuild=True)(obj, "")

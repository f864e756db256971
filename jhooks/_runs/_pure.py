"""Hooks whose Python provably computes the same again: the hook pass's one shortcut.

Every hook runs its Python on every call (`_hookpass.py`), except where running it
again provably gives what the last run gave. That is so for a *pure* hook: a function
(or a `functools.partial` of one) whose code

- writes nothing: no global, nonlocal, attribute or item store, no in-place operator,
  no method that mutates a list or dict (`append`, `update`...), no import, no
  generator, no identity test (`is`);
- calls only the builtins that read their arguments (`len`, `min`, `range`...), the
  functions and modules of JAX, jhooks, `math` and `operator`, and other pure hooks;
- holds (in its cells, defaults, `partial` arguments and the globals it names) only
  such functions and *data*: numbers, strings, `None`, JAX and NumPy arrays, and
  tuples, lists and dicts of them.

Its result is then a function of its code and what it holds, which `pure_key` reads on
every call: numbers and strings by value, NumPy arrays by content, the library objects
its code names by identity (so `mock.patch("jax.nn.relu")` is seen), and the JAX and
NumPy arrays held in cells, defaults and `partial` arguments by shape and dtype only: the
hook is traced with those arrays as inputs (`arrays`), so a fresh array each call, or
one changed in place, reuses the trace. A hook that needs such an array's value in
Python (`int(count)`) is traced again with it concrete and keyed by its identity (JAX
arrays) or content (NumPy arrays). Anything else is not pure, and runs.
"""

from __future__ import annotations

import builtins
import dis
import functools
import math
import operator
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core import Static, is_tracer, number_key

_STORES = frozenset(
    {
        "STORE_GLOBAL",
        "DELETE_GLOBAL",
        "DELETE_DEREF",
        "STORE_ATTR",
        "DELETE_ATTR",
        "STORE_SUBSCR",
        "DELETE_SUBSCR",
        "IMPORT_NAME",
        "IMPORT_FROM",
        "YIELD_VALUE",
        "RETURN_GENERATOR",
        "SEND",
        "IS_OP",
        "SETUP_WITH",
        "BEFORE_WITH",
    }
)
_MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "clear",
        "update",
        "setdefault",
        "remove",
        "discard",
        "sort",
        "reverse",
        "__setitem__",
        "__delitem__",
        "__setattr__",
        "__delattr__",
        "__dict__",
        "__class__",
        "__globals__",
        "__closure__",
    }
)
_PURE_BUILTINS = frozenset(
    getattr(builtins, n)
    for n in (
        "abs all any bool complex dict divmod enumerate float int isinstance len list max "
        "min pow range reversed round slice sorted str sum tuple zip"
    ).split()
)
_LIBRARIES = ("jax", "jhooks", "math", "operator")
_DATA = (bool, int, float, complex, str, bytes, type(None))
_MAX_DATA = 256  # leaves of data a pure hook may hold
_MAX_NUMPY_BYTES = 1 << 16
_MAX_DEPTH = 4


class Impure(Exception):
    """The hook is not pure: it runs again."""


class Key:
    """A pure hook's key and what it holds by identity (kept alive with the key), and
    the JAX arrays it is traced with as inputs, with where they are."""

    __slots__ = ("parts", "held", "arrays", "tracers")

    def __init__(self, tracers: bool = False) -> None:
        self.parts: list = []
        self.held: list = []
        self.arrays: list = []
        self.tracers = tracers  # a tracer held is data (no key is made: `writes_nothing`)


def pure_key(hook: Callable, inputs: bool) -> Key | None:
    """`hook`'s key if it is pure (see the module's docstring), else `None`.

    `inputs`: its JAX arrays (in cells, defaults, `partial` arguments) are keyed by
    shape and dtype and listed in `Key.arrays`, to be traced as inputs; else by
    identity."""
    key = Key()
    try:
        _callable(hook, key, inputs, 0)
    except Impure:
        return None
    return key


def writes_nothing(hook: Callable) -> bool:
    """Whether `hook` is pure but for the tracers it may hold (a jit's argument that a
    `partial` or a closure holds): no side effect, though no key can be made of it."""
    try:
        _callable(hook, Key(tracers=True), True, 0)
    except Impure:
        return False
    return True


def _callable(fn: Any, key: Key, inputs: bool, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise Impure
    if isinstance(fn, functools.partial) and type(fn) is functools.partial:
        key.parts.append("partial")
        _callable(fn.func, key, inputs, depth + 1)
        for x in fn.args:
            _held(x, key, inputs, depth)
        for name, x in sorted(fn.keywords.items()):
            key.parts.append(name)
            _held(x, key, inputs, depth)
        return
    if type(fn) is not types.FunctionType:
        raise Impure
    code = fn.__code__
    found = _reads(code)
    if found is None:
        raise Impure
    globals_, chains = found
    key.parts.append(code)
    key.held.append(code)
    for x in fn.__defaults__ or ():
        _held(x, key, inputs, depth)
    for name, x in sorted((fn.__kwdefaults__ or {}).items()):
        key.parts.append(name)
        _held(x, key, inputs, depth)
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            raise Impure from None
        _held(value, key, inputs, depth)
    space = fn.__globals__
    for name in globals_:
        if name in space:
            _held(space[name], key, False, depth)
        elif getattr(builtins, name, None) in _PURE_BUILTINS:
            key.parts.append(name)
        else:
            raise Impure
    for chain in chains:
        _chain(chain, fn, space, key)


def _held(x: Any, key: Key, inputs: bool, depth: int) -> None:
    """Keys one value a pure hook holds."""
    if isinstance(x, types.ModuleType):
        if not _library(getattr(x, "__name__", "")):
            raise Impure
        key.parts.append(("module", id(x)))
        key.held.append(x)
    elif isinstance(x, (types.FunctionType, functools.partial)) and not _library_object(x):
        _callable(x, key, inputs, depth + 1)
    elif callable(x) and not isinstance(x, type) and _library_object(x):
        key.parts.append(("library", id(x)))
        key.held.append(x)
    else:
        budget = [_MAX_DATA]
        key.parts.append(_data(x, key, inputs, budget))


def _data(x: Any, key: Key, inputs: bool, budget: list) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise Impure
    kind = type(x)
    if kind in _DATA or isinstance(x, Static):
        return (kind, number_key(x) if isinstance(x, (float, complex)) else x)
    if kind in (tuple, list):
        return (kind, tuple(_data(v, key, inputs, budget) for v in x))
    if kind is dict:
        return (dict, tuple((k, _data(v, key, inputs, budget)) for k, v in x.items()))
    if inputs and _input_array(x):
        key.arrays.append(x)
        return ("array", type(x), x.shape, str(x.dtype), getattr(x, "weak_type", False))
    if isinstance(x, jax.Array) and not is_tracer(x):
        key.held.append(x)
        return ("array", id(x))
    if key.tracers and is_tracer(x):
        return ("tracer",)
    if isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "biufc":
        if x.nbytes > _MAX_NUMPY_BYTES:
            raise Impure
        return ("numpy", x.shape, str(x.dtype), np.asarray(x).tobytes())
    raise Impure


def _input_array(x: Any) -> bool:
    """A JAX or NumPy array that a pure hook is traced with as an input."""
    if isinstance(x, jax.Array):
        return not is_tracer(x)
    return type(x) is np.ndarray and x.dtype.kind in "biufc"


def _library(name: str) -> bool:
    return name.split(".")[0] in _LIBRARIES


def _library_object(x: Any) -> bool:
    return _library(getattr(x, "__module__", None) or "") or x in (math, operator)


def _chain(chain: tuple[str, ...], fn: Any, space: dict, key: Key) -> None:
    """Keys what a chain of attributes from a module names (`jax.nn.relu`)."""
    head, *names = chain
    value = space.get(head)
    if value is None and fn.__closure__:
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__))
        value = cells[head].cell_contents if head in cells else None
    for name in names:
        if not isinstance(value, types.ModuleType):
            return
        try:
            value = getattr(value, name)
        except AttributeError:
            raise Impure from None
        key.parts.append(("attr", name, id(value)))
        key.held.append(value)
    if isinstance(value, types.ModuleType) and not _library(value.__name__):
        raise Impure


@functools.lru_cache(maxsize=4096)
def _reads(code: types.CodeType) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]] | None:
    """The globals `code` (and the code inside it) names, and its chains of attributes
    from a global or closure variable; `None` if it writes anything (cached too: a hook
    that is not pure is looked at on every call)."""
    try:
        return _reads_of(code)
    except Impure:
        return None


def _reads_of(code: types.CodeType) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    names: list[str] = []
    chains: list[tuple[str, ...]] = []
    chain: list[str] = []
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op in _STORES or (op == "STORE_DEREF" and ins.argval in code.co_freevars):
            raise Impure
        if op == "BINARY_OP" and ins.argrepr.endswith("="):
            raise Impure  # in place: `acts += [x]`
        if op in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval in _MUTATORS:
            raise Impure
        if op == "LOAD_GLOBAL":
            names.append(ins.argval)
        if op in ("LOAD_ATTR", "LOAD_METHOD") and chain:
            chain.append(ins.argval)
            continue
        if len(chain) > 1:
            chains.append(tuple(chain))
        chain = [ins.argval] if op in ("LOAD_GLOBAL", "LOAD_DEREF") else []
    if len(chain) > 1:
        chains.append(tuple(chain))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner = _reads(const)
            if inner is None:
                raise Impure
            inner_names, inner_chains = inner
            names += inner_names
            chains += inner_chains
    return tuple(dict.fromkeys(names)), tuple(dict.fromkeys(chains))


def with_inputs(hook: Callable, arrays: list) -> Callable:
    """`hook` rebuilt (never changed) so that the JAX arrays it holds in cells,
    defaults and `partial` arguments are `arrays`, in the order `pure_key` found them."""
    it = iter(arrays)
    return _rebuilt(hook, it)


def _rebuilt(fn: Any, it: Any) -> Any:
    if isinstance(fn, functools.partial):
        func = _rebuilt(fn.func, it)
        args = tuple(_swap(x, it) for x in fn.args)
        keywords = {n: _swap(x, it) for n, x in sorted(fn.keywords.items())}
        return functools.partial(func, *args, **keywords)
    defaults = tuple(_swap(x, it) for x in fn.__defaults__ or ()) or None
    kwdefaults = {n: _swap(x, it) for n, x in sorted((fn.__kwdefaults__ or {}).items())}
    cells = tuple(types.CellType(_swap(c.cell_contents, it)) for c in fn.__closure__ or ())
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, cells or None)
    new.__kwdefaults__ = kwdefaults or None
    new.__qualname__ = fn.__qualname__
    return new


def _swap(x: Any, it: Any) -> Any:
    if isinstance(x, (types.FunctionType, functools.partial)) and not _library_object(x):
        return _rebuilt(x, it)
    if type(x) is tuple:
        return tuple(_swap(v, it) for v in x)
    if type(x) is list:
        return [_swap(v, it) for v in x]
    if type(x) is dict:
        return {k: _swap(v, it) for k, v in x.items()}
    if _input_array(x):
        return next(it)
    return x

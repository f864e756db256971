"""One compiled program per run structure: hooks' values are its arguments.

`run_with_hooks` and `run_with_cache` call `compiled(...)`, which splits the function,
its arguments and the hooks with `_closures.split` into a key (code, structure,
strings, objects by identity) and values (arrays; for forward hooks, Python numbers
too), and calls `_program(key, values)`, an `eqx.filter_jit`-ed function. Inside it
the function and the hooks are rebuilt with tracers in place of the values and the
run's body runs. So a sweep over a head index, a patch array or a steering vector
compiles once; a hook with other code, or closing over other strings, objects or
structure, compiles anew. The same program serves calls at top level (eager ones too)
and inside a user's trace, where it is a nested jit.

The live objects (hooks, function, arguments) reach the program through a
thread-local stack, not through its key: the key (held by JAX's jit cache) holds
weak references only, so a model or function passed to a run can be freed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core import ARRAYS, KEY, TRACE, ThreadStack, hook_name, jit_key, rebuild, split, unwrap_jit

# The run whose program is being traced, read by `_program` (not part of its key).
_LIVE: ThreadStack[_Live] = ThreadStack("run programs being traced")

_CONCRETE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerArrayConversionError,
)


class HookName(str):
    """A point's name as passed to hooks: a `str`, with TransformerLens' `hook.name`.

    TransformerLens calls hooks as `hook(value, hook=hook_point)` and hooks read
    `hook.name`; jhooks passes the name. This `str` subclass serves both habits.
    """

    __slots__ = ()

    @property
    def name(self) -> str:
        """The point's name as a plain `str` (TransformerLens' `hook.name`)."""
        return str(self)

    def layer(self) -> int:
        """The layer index in the name (`"blocks.3.attn.hook_z"` -> 3), as in TransformerLens."""
        for part in self.split("."):
            if part.isdigit():
                return int(part)
        raise ValueError(f"hook point {str(self)!r} has no layer index in its name.")


class _NamedCall:
    """Calls a (rebuilt) hook with a `HookName`; errors name the user's hook."""

    def __init__(self, fn: Callable, original: Callable):
        self.fn = fn
        self.__wrapped__ = original
        self.__qualname__ = hook_name(original)

    def __call__(self, value: Any, name: str) -> Any:
        return self.fn(value, HookName(name))


class _Token:
    """A fresh jit context per traced program: jits inside it retrace in each new one."""

    __slots__ = ("__weakref__",)


class _Live:
    __slots__ = ("body", "fn", "args", "kwargs", "fwd", "bwd")

    def __init__(self, body, fn, args, kwargs, fwd, bwd):  # type: ignore[no-untyped-def]
        self.body, self.fn, self.args, self.kwargs = body, fn, args, kwargs
        self.fwd, self.bwd = fwd, bwd


class _Key:
    """The static argument of `_program`: hashable, compared by value."""

    __slots__ = ("key", "_hash")

    def __init__(self, key: Hashable):
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self._hash == other._hash and self.key == other.key


@eqx.filter_jit
def _program(key: _Key, values: list) -> Any:
    del key  # it only selects the compiled program
    live = _LIVE.items()[-1]
    it = iter(values)
    fn = rebuild(live.fn, ARRAYS, it)
    args = rebuild(live.args, ARRAYS, it)
    kwargs = rebuild(live.kwargs, ARRAYS, it)
    fwd = [(sel, _NamedCall(rebuild(hook, TRACE, it), hook)) for sel, hook in live.fwd]
    bwd = [(sel, _NamedCall(hook, hook)) for sel, hook in live.bwd]
    with jit_key((jit_key.value, _Token())):
        return live.body(fn, args, kwargs, fwd, bwd)


def selector_key(sel: Any) -> Hashable:
    leaves: list = []
    predicate = None if sel.predicate is None else split(sel.predicate, KEY, leaves)
    return (sel.names, predicate)


def compiled(
    caller: str,
    body: Callable,
    options: Hashable,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    fwd: list,
    bwd: list,
) -> Any:
    """Runs `body(fn, args, kwargs, fwd, bwd)` inside the compiled program of this structure.

    `options` is the key of whatever else `body` depends on (the cache filter...).
    """
    stack = _LIVE.items()
    if stack:
        # Inside another run's program: traced inline, in its trace (a nested program
        # would hide this run's points from the outer cache).
        fwd = [(sel, _NamedCall(hook, hook)) for sel, hook in fwd]
        bwd = [(sel, _NamedCall(hook, hook)) for sel, hook in bwd]
        return body(fn, args, kwargs, fwd, bwd)
    fn = unwrap_jit(fn)
    values: list = []
    traced: list = []
    key = [
        caller,
        options,
        split(fn, ARRAYS, values),
        split(args, ARRAYS, values, content=True),
        split(kwargs, ARRAYS, values, content=True),
    ]
    for sel, hook in fwd:
        names: list = []
        key.append((selector_key(sel), split(hook, TRACE, values, names)))
        traced.extend((hook, sel, where, kind) for where, kind in names)
    for sel, hook in bwd:
        key.append((selector_key(sel), split(hook, KEY, [])))
    stack.append(_Live(body, fn, args, kwargs, fwd, bwd))
    try:
        return _program(_Key(tuple(key)), values)
    except (*_CONCRETE, KeyError, IndexError, TypeError) as err:
        if not (isinstance(err, _CONCRETE) or _mentions_tracer(err)):
            raise
        if not traced:
            err.add_note(
                f"jhooks.{caller} compiles `fn` (once per hook structure, eager calls too), "
                "so `fn` must be traceable by jax.jit."
            )
            raise
        raise _static_error(caller, traced, err) from err
    finally:
        stack.pop()


def _label(hook: Any) -> str:
    inner = hook
    while isinstance(inner, functools.partial):
        inner = inner.func
    return hook_name(inner) + (" (a functools.partial)" if inner is not hook else "")


def _mentions_tracer(err: Exception) -> bool:
    """An error from Python code given a tracer: a key or index made from one, a slice."""
    text = str(err)
    return any(word in text for word in ("Traced<", "Tracer", "must be static"))


def _static_error(caller: str, traced: list, err: Exception) -> Exception:
    numbers = [t for t in traced if t[3] in ("int", "float", "complex")]
    listed = "; ".join(
        f"hook {_label(h)} for {('point ' + repr(s.names[0])) if s.names else 'a predicate'}:"
        f" {where.split(': ', 1)[-1]} ({kind})"
        for h, s, where, kind in (numbers or traced)
    )
    return TypeError(
        f"{caller}: tracing the run needed a concrete Python value, but the numbers and "
        "arrays hooks close over are traced arguments of the compiled program (so that new "
        f"values do not recompile). Traced: {listed}. Mark a value used in Python control "
        "flow, a shape, range() or a Python index as static with `jhooks.static(value)` "
        "(e.g. `functools.partial(hook, n=jhooks.static(n))`): each new static value "
        f"compiles a new program. JAX said: {type(err).__name__}: {str(err).splitlines()[0]}"
    )


class Cast:
    """`run_with_cache(dtype=...)`: casts the floating-point values of a cache."""

    def __init__(self, dtype: Any):
        try:
            self.dtype = None if dtype is None else jnp.dtype(dtype)
        except TypeError as err:
            raise TypeError(f"run_with_cache: dtype must be a NumPy dtype, got {dtype!r}.") from err
        if self.dtype is not None and not jnp.issubdtype(self.dtype, jnp.inexact):
            raise TypeError(
                f"run_with_cache: dtype casts floating-point activations and must be a "
                f"floating dtype, got {self.dtype.name}."
            )
        self.key = None if self.dtype is None else self.dtype.name

    def __call__(self, cache: dict[str, Any]) -> dict[str, Any]:
        if self.dtype is None:
            return cache

        def one(x: Any) -> Any:
            return x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x

        return {name: jax.tree.map(one, value) for name, value in cache.items()}

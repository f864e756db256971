"""`jhooks.static`, and how a Python number is keyed: bit for bit."""

from __future__ import annotations

from typing import Any


class Static:
    __slots__ = ()

    def __repr__(self) -> str:
        return f"jhooks.static({super().__repr__()})"


class _StaticInt(Static, int):
    __slots__ = ()


class _StaticFloat(Static, float):
    __slots__ = ()


class _StaticComplex(Static, complex):
    __slots__ = ()


class _StaticTuple(Static, tuple):
    __slots__ = ()


def static(value: Any) -> Any:
    """Marks a number the run's function or its arguments hold as static: never traced,
    each value its own program.

    **Arguments:**

    - `value`: a Python `int`, `float`, `complex`, or a tuple of them (a shape).

    **Returns:**

    An instance of a subclass of the value's type, equal to it, so hook code is
    unchanged.

    A Python number passed in a run's arguments is a traced argument from the first
    call, as under `jax.jit`, so that a sweep compiles once; one the function reads
    elsewhere (a closure, a global, an attribute) is a Python value, keyed by value. A
    number marked static stays a Python value: each new value compiles a new
    program. (A number that tracing needs concretely, in `range(n)` or a shape, is
    made static by itself when its trace fails.) A hook's own numbers need no
    marking: hooks run as Python on every call, so a number is a Python value in the
    hook, and what reaches JAX is an argument of the program (where it is used as a
    shape or a slice bound, each value is its own program).

    **Example:**

    ```python
    def keep_first(z, name, n=jhooks.static(4)):
        return z[:, :n].sum() * jnp.ones_like(z)
    ```
    """
    if isinstance(value, Static):
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

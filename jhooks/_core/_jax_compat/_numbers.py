"""Python numbers traced in a run (part of the fence, `__init__.py` beside this file):
a tracer whose class raises `NeedsConcrete` where Python code needs its value."""

from __future__ import annotations

from typing import Any


class NeedsConcrete(Exception):
    """A traced Python number reached code that needs its value (`str`, `int`...)."""


_ONLY_OPERANDS: dict[type, type] = {}
_CONVERSIONS = ("format", "str", "hash", "int", "index", "bool", "float", "complex")
_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")


def concrete_only(tracer: Any) -> Any:
    """`tracer` (a Python number traced in a run), which now raises `NeedsConcrete`
    where Python code needs its value: formatted in a string, hashed, made an `int`,
    an index, a `bool`; arithmetic with Python numbers keeps that property. Its class
    becomes a subclass of its tracer class with those methods only."""
    cls = type(tracer)
    if cls in _ONLY_OPERANDS.values():
        return tracer
    sub = _ONLY_OPERANDS.get(cls)
    if sub is None:

        def needs_value(self: Any, *args: Any) -> Any:
            raise NeedsConcrete("a traced Python number's value was needed")

        body: dict[str, Any] = {f"__{n}__": needs_value for n in _CONVERSIONS}
        for name in _ARITHMETIC:
            for method in (f"__{name}__", f"__r{name}__"):
                body[method] = _keeps_tag(getattr(cls, method))
        body["__slots__"] = ()
        sub = _ONLY_OPERANDS[cls] = type(f"Number{cls.__name__}", (cls,), body)
    tracer.__class__ = sub
    return tracer


def _keeps_tag(method: Any) -> Any:
    def arithmetic(self: Any, other: Any) -> Any:
        out = method(self, other)
        number = isinstance(other, (int, float, complex)) or type(other) is type(self)
        if number and type(out) is type(self).__base__:
            out.__class__ = type(self)
        return out

    return arithmetic

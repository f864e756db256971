"""A backward hook reads what a forward hook kept, as in PyTorch.

Under a differentiation (`jax.grad`, `jax.vjp`, inside a jit or not), a forward hook is
given the differentiation's tracer; what it keeps (`saved["x"] = z`, as Opacus, K-FAC
and Grad-CAM do) is that tracer, whose differentiation has ended when the backward pass
calls the backward hooks. While a backward hook runs, each such tracer it can reach (in
its cells, defaults, `partial` arguments, instance attributes and the globals its code
names, and the dicts and lists in them) is replaced by the forward value under it, and
put back after: the hook reads the forward value, a constant of the backward pass, as
PyTorch's saved tensor is.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ._jax_compat import ended_differentiation_primal, is_tracer
from ._reach import reached_by

_MAX_DEPTH = 3
_MAX_VISITS = 2048


@contextmanager
def forward_values(hook: Any) -> Iterator[None]:
    """Gives `hook` the forward values under the ended tracers it can reach, while the
    block runs."""
    swapped: list[tuple[Any, Any, Any]] = []
    try:
        _swap([v for _, v in reached_by(hook)], swapped, [_MAX_VISITS], 0, set())
        yield
    finally:
        for container, key, old in reversed(swapped):
            if isinstance(container, (list, dict)):
                container[key] = old
            else:
                setattr(container, key, old)


def _swap(values: list, swapped: list, budget: list, depth: int, seen: set) -> None:
    if depth > _MAX_DEPTH:
        return
    for value in values:
        if budget[0] <= 0:
            return
        if id(value) in seen:
            continue  # met already (a dict both closed over and named as a global)
        if isinstance(value, (list, dict)):
            seen.add(id(value))
            budget[0] -= 1
            items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
            _slots(value, items, swapped, budget, depth, seen)
        elif isinstance(value, tuple):
            _swap(list(value), swapped, budget, depth + 1, seen)
        elif _instance(value):
            seen.add(id(value))
            budget[0] -= 1
            _slots(value, list(vars(value).items()), swapped, budget, depth, seen)


def _slots(container: Any, items: list, swapped: list, budget: list, depth: int, seen: set):
    inner = []
    for key, v in items:
        if is_tracer(v):
            primal = ended_differentiation_primal(v)
            if primal is not None:
                swapped.append((container, key, v))
                if isinstance(container, (list, dict)):
                    container[key] = primal
                else:
                    setattr(container, key, primal)
        else:
            inner.append(v)
    _swap(inner, swapped, budget, depth + 1, seen)


def _instance(value: Any) -> bool:
    """A user's plain object (not a class, module, function or library object)."""
    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
        return False
    module = type(value).__module__ or ""
    return hasattr(value, "__dict__") and not module.startswith(("jax", "numpy", "builtins"))

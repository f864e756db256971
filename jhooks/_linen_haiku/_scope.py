"""A method call of a Linen or Haiku module as a hookable module's call in a run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core import partial_evaluating
from .._runs import current_scope, in_module_call, input_point, named_point, point_scope
from .._staging import calls_model


@calls_model
def module_call(path: str, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Calls `method(*args, **kwargs)`, a method of the module at `path`, as the call
    pipeline of `jhooks._modules` calls a hookable module with no hook registered: the
    points and operations inside are named under `path`, its positional arguments are
    the point `path:in` (where a run names it) and its output the point `path` (not
    for the root, `""`). A method that the module calls on itself (`__call__` calling
    `self.encode`) is part of the call it is in: no other point. Nor is a call that JAX
    partially evaluates (Linen's `nn.scan` traces its body once so, to check that its
    broadcast variables are constants, then again in its `lax.scan`: the second is
    the call, and its points are the points of the scan's iterations)."""
    if (in_module_call() and current_scope() == path) or partial_evaluating():
        return method(*args, **kwargs)
    with point_scope(path):
        out = method(*input_point(args, path), **kwargs)
    return named_point(out, path) if path else out

"""A method call of a Linen or Haiku module as a hookable module's call in a run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core import ThreadStack, partial_evaluating
from .._runs import current_scope, hookable_call, input_point, named_point, point_scope
from .._staging import calls_model

# The Linen and Haiku module calls being run, innermost last: `(prefix, name)`, where
# `prefix` is the scope the outermost of them was called in ("" at the top of a run, or
# `mlp` when a hookable module at `mlp` calls `model.apply`) and `name` the call's point.
_CALLS: ThreadStack[tuple[str, str]] = ThreadStack("Linen and Haiku module calls")


@calls_model
def module_call(path: str, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Calls `method(*args, **kwargs)`, a method of the module at `path` (from the root
    of its library's model), as the call pipeline of `jhooks._modules` calls a hookable
    module with no hook registered: the points and operations inside are named under
    its name, its positional arguments are the point `name:in` (where a run names it)
    and its output the point `name`. The name is `path` under the scope the model was
    called in: a Linen model called by a hookable module at `mlp` names its `Dense_0`
    `mlp.Dense_0`. The root module of `apply` (Linen's, path `""`) has no point: its
    output is `apply`'s, named by whatever called it.

    A method that the module calls on itself (`__call__` calling `self.encode`) is part
    of the call it is in: no other point. Nor is a call that JAX partially evaluates
    (Linen's `nn.scan` traces its body once so, to check that its broadcast variables
    are constants, then again in its `lax.scan`: the second is the call, and its points
    are the points of the scan's iterations)."""
    if partial_evaluating():
        return method(*args, **kwargs)
    outer = _CALLS.top()
    prefix = current_scope() if outer is None else outer[0]
    name = ".".join(part for part in (prefix, path) if part)
    if outer is not None and outer[1] == name:
        return method(*args, **kwargs)
    with _CALLS.pushed((prefix, name)):
        return hookable_call(_scoped_call, name, bool(path), method, args, kwargs)


@calls_model
def _scoped_call(name: str, point: bool, method: Callable[..., Any], args: tuple, kwargs: dict):
    with point_scope(name):
        if not point:  # the root of `apply`: inside the scope it was called in
            return method(*args, **kwargs)
        out = method(*input_point(args, name), **kwargs)
    return named_point(out, name)

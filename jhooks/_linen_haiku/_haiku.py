"""Haiku's interceptor: a method call of a module is a scope named by its
`module.module_name` with each `/` a dot (`mlp/~/linear_0` is `mlp.~.linear_0`).

Haiku's names are paths of `/`-separated parts, among them `~` (a module made inside
its parent's `__call__`) and `~name` (made inside the parent's method `name`): `blk/linear`
(made in `blk`'s constructor) and `blk/~/linear` (made in its `__call__`) are two modules
of one model. So every part is kept, and only `/` changes, to jhooks' `.`: the map is
one to one, a part holds no `.`, `/` or `:` (Haiku's names are identifiers), and the `/`
of an operation address (`mlp.~.linear_0/dot_general`) stays unambiguous.

Imported only once `haiku` is (`_framework.py`). Uses Haiku's public API only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk

from .._staging import calls_model
from ._scope import module_call


def haiku_path(module: hk.Module) -> str:
    """The module's name as jhooks names a path: `mlp/~/linear_0` -> `mlp.~.linear_0`."""
    return module.module_name.replace("/", ".")


@calls_model
def intercept(
    method: Callable[..., Any], args: tuple, kwargs: dict, context: hk.MethodContext
) -> Any:
    """Haiku's method interceptor: every method call of a module (not its constructor,
    which runs before the module has a name) goes through `module_call`."""
    if context.method_name == "__init__":
        return method(*args, **kwargs)
    return module_call(haiku_path(context.module), method, args, kwargs)

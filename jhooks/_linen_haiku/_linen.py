"""Flax Linen's interceptor: a method call of a bound module is a scope named by its
path (`module.path`, Linen's public one, joined with dots: `block_1.attn`).

Imported only once `flax.linen` is (`_framework.py`). Uses Flax's public API only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from .._staging import calls_model
from ._scope import module_call


def linen_path(module: nn.Module) -> str:
    """The module's path from the root of `model.apply` (Linen's `module.path`, whose
    parts are the names Linen gives: attribute names of `setup`, `Dense_0`, `"0"`),
    joined with dots."""
    return ".".join(str(part) for part in module.path)


@calls_model
def intercept(
    method: Callable[..., Any], args: tuple, kwargs: dict, context: nn.module.InterceptorContext
) -> Any:
    """Linen's `Interceptor`: every method call of a bound module (not `setup`, which
    returns nothing and makes the submodules) goes through `module_call`."""
    module = context.module
    if context.method_name == "setup" or module.scope is None:
        return method(*args, **kwargs)
    return module_call(linen_path(module), method, args, kwargs)

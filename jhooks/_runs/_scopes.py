"""Hook point names scoped by the hookable module whose call reaches them.

`jhooks.hook_point(z, "hook_z")` inside the call of the hookable module at path
`blocks.0.attn` is the point `blocks.0.attn.hook_z`, as TransformerLens names its
`HookPoint`s: one attention class used in two blocks gives two names. The module call
(`_modules/_call.py`) enters `point_scope(path)`; `scoped(name)` prefixes the innermost.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .._core import ThreadStack

_SCOPES: ThreadStack[str] = ThreadStack("hookable module calls (hook point scopes)")


@contextmanager
def point_scope(path: str) -> Iterator[None]:
    """Hook points reached inside the block are named under `path` ("" for the root)."""
    with _SCOPES.pushed(path):
        yield


def current_scope() -> str:
    """The path of the innermost hookable module being called, "" outside any."""
    return _SCOPES.top() or ""


def scoped(name: str) -> str:
    """`name` under the innermost module's path. A name that already starts with that
    path (a model that spells its points' full names out) is kept as it is."""
    prefix = current_scope()
    if not prefix or name == prefix or name.startswith(prefix + "."):
        return name
    return f"{prefix}.{name}"

"""Handles returned by every `register_*` call, and the jit cache key they maintain."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import jax

_next_id = itertools.count()
_active: set[int] = set()
# Every hook that lives outside a traced function (node, module and global hooks) is
# part of this jit cache key, so a jitted function retraces when one is added or
# removed, and gets its cached program back once the set of hooks is what it was.
_jit_key = jax.make_user_context(frozenset())


class Hooks(dict):
    """An ordered dict from handle id to hook, which handles can remove from."""


def _publish() -> None:
    _jit_key.set_global(frozenset(_active))


class RemovableHandle:
    """What a `register_*` call returns: removes the hook it registered.

    **Example:**

    ```python
    h = node.register_hook(hook)
    h.remove()          # idempotent
    with node.register_prehook(other):
        ...             # `other` is removed on exit
    ```

    `h.id` is unique across every kind of hook.
    """

    id: int

    def __init__(self, *hooks_dicts: Hooks):
        self.id = next(_next_id)
        self._refs = tuple(weakref.ref(d) for d in hooks_dicts)
        _active.add(self.id)
        _publish()

    def remove(self) -> None:
        """Removes the hook. Calling it again does nothing."""
        for ref in self._refs:
            hooks = ref()
            if hooks is not None:
                hooks.pop(self.id, None)
        if self.id in _active:
            _active.discard(self.id)
            _publish()

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"RemovableHandle(id={self.id})"


def add_hook(hooks: Hooks, hook: Any, *, prepend: bool = False) -> RemovableHandle:
    """Registers `hook` in the ordered dict `hooks` and returns its handle."""
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    if prepend:
        items = list(hooks.items())
        hooks.clear()
        hooks.update([items[-1], *items[:-1]])
    return handle

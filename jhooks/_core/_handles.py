"""Handles returned by every `register_*` call, and the jit cache key of registered hooks.

Node, module and global hooks live outside the functions that use them, so JAX's
compilation caches must be told about them. They are, through one JAX user context
(`jax.make_user_context`) whose value is a snapshot of every registry: for each
registry holding hooks, its serial number and the structural key of each hook, in
order. A jitted function therefore retraces when a hook changes anywhere, and gets its
cached program back whenever the hooks are again what they were, however many
registrations happened in between (registering the same hook again in a loop costs
no compile after the first). Hooks are keyed as `_closures` keys a run's predicates.

A registration or removal made while JAX is tracing (a hook that registers another
hook) also bumps a generation number in the snapshot: the program being traced may
contain the new hook, so no later state may reuse it, removal included.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Hashable
from typing import Any

import jax

from ._closures import KEY, split
from ._jax_compat import at_top_level

_next_id = itertools.count()
_next_serial = itertools.count()
_lock = threading.RLock()
_registries: weakref.WeakSet[Hooks] = weakref.WeakSet()
_generation = 0
jit_key = jax.make_user_context(((), 0))


class Hooks(dict):
    """An ordered dict from handle id to hook, which handles can remove from.

    Every instance is one registry of the jit key; `serial` names it there and is
    never reused.
    """

    def __init__(self) -> None:
        super().__init__()
        self.serial = next(_next_serial)
        self.keys_by_id: dict[int, Hashable] = {}
        with _lock:
            _registries.add(self)

    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def hook_key(hook: Any) -> Hashable:
    """What makes two registered hooks the same hook: their code and everything they
    hold (numbers bit for bit, other objects by identity, held weakly), as for the
    predicates of a run. A registry's entry (a dataclass holding the hook and its
    options) is keyed by its fields."""
    if dataclasses.is_dataclass(hook) and not isinstance(hook, type):
        fields = dataclasses.fields(hook)
        return (type(hook), tuple(split(getattr(hook, f.name), KEY, []) for f in fields))
    return split(hook, KEY, [])


def _publish(during_trace: bool) -> None:
    global _generation
    if during_trace:
        _generation += 1
    snapshot = tuple(
        sorted(
            (hooks.serial, tuple(hooks.keys_by_id[i] for i in hooks))
            for hooks in list(_registries)
            if hooks
        )
    )
    jit_key.set_global((snapshot, _generation))


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

    def remove(self) -> None:
        """Removes the hook. Calling it again does nothing.

        **Example:**

        ```python
        handle = model.fc1.register_forward_hook(hook)
        handle.remove()  # a jitted step retraces without the hook on its next call
        ```
        """
        with _lock:
            removed = False
            for ref in self._refs:
                hooks = ref()
                if hooks is not None and self.id in hooks:
                    del hooks[self.id]
                    del hooks.keys_by_id[self.id]
                    removed = True
            if removed:
                _publish(during_trace=not at_top_level())

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"RemovableHandle(id={self.id})"


def add_hook(hooks: Hooks, hook: Any, *, prepend: bool = False) -> RemovableHandle:
    """Registers `hook` in the ordered dict `hooks` and returns its handle."""
    handle = RemovableHandle(hooks)
    key = hook_key(hook)
    with _lock:
        hooks[handle.id] = hook
        hooks.keys_by_id[handle.id] = key
        if prepend:
            items = list(hooks.items())
            hooks.clear()
            hooks.update([items[-1], *items[:-1]])
        _publish(during_trace=not at_top_level())
    return handle

"""Handles returned by every `register_*` call, and the one place that says what is in
the jit key.

**What is in the jit key.** A jitted function retraces when its arguments' shapes,
dtypes and static values change (JAX), or when one of these five values changes, each
a `jax.make_user_context` that JAX puts in every jit cache key:

- `jit_key`: a snapshot of every registry of node, module and global hooks: for each
  registry holding hooks, its serial number and the key of each hook, in order (a
  hook's code and everything it reads, by content: `static_key`), and a
  generation number bumped by a registration or removal made while JAX is tracing
  (the program being traced may contain the new hook, so no later state may reuse
  it, removal included). A jitted function retraces when a hook changes anywhere and
  gets its cached program back whenever the hooks are again what they were, however
  many registrations happened in between.
- `program_key`: a fresh token while a run's program (`_runs._programs`) is traced,
  so that functions jitted inside a run retrace in each program (hook points read the
  active run, which their own cache key does not show).
- `staged_key`: `True` inside a staged run (`_runs._loops`), whose points are
  primitives that a plain run must not reuse.
- `retaining_key`: the `jhooks.grad` call tracing (`_autograd._grad`), whose
  retained values are primitives too.
- `loop_fence_key`: a fresh token set by `loop_index()` inside a function jitted within
  a run (`_runs._loops`), so that a jitted block traced at one loop depth is traced
  again at another.

Runs (`run_with_hooks`, `run_with_cache`) keep their own cache of programs, keyed by
the guards of what they read (`_runs._programs`); inside it, these five apply too.

**Names are keyed where they are read.** A hookable module's registry is in its pytree
structure, but two registries that hold no hooks compare equal (so that blocks stack
with `jax.tree.map`): a cache keyed by structure cannot tell `blocks.0` from `blocks.1`
then. `NAMES_KEYED` is pushed where module names are read and the key does show which
module it is (a run: its key, its program's lookup and trace; `jhooks.ops`): registries
compare by identity there. A name read anywhere else under a trace pins its registry to
identity for good (`_modules/_registry.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Hashable
from typing import Any

import jax

from ._closures import STATIC, Walk
from ._context import ThreadStack
from ._guards import Guard, unchanged
from ._jax_compat import at_top_level

_next_id = itertools.count()
_next_serial = itertools.count()
_lock = threading.RLock()
_registries: weakref.WeakSet[Hooks] = weakref.WeakSet()
_generation = 0
_published: tuple[Hashable, int] = ((), 0)
jit_key = jax.make_user_context(((), 0))
program_key = jax.make_user_context(None)
staged_key = jax.make_user_context(False)
retaining_key = jax.make_user_context(None)
loop_fence_key = jax.make_user_context(None)
NAMES_KEYED: ThreadStack[object] = ThreadStack("calls whose cache key shows module names")


class Hooks(dict):
    """An ordered dict from handle id to hook, which handles can remove from.

    Every instance is one registry of the jit key; `serial` names it there and is
    never reused.
    """

    def __init__(self) -> None:
        super().__init__()
        self.serial = next(_next_serial)
        self.keys_by_id: dict[int, Hashable] = {}
        self.guards_by_id: dict[int, Any] = {}  # whether a hook's key would change
        with _lock:
            _registries.add(self)

    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def hook_key(hook: Any) -> Hashable:
    """What makes two registered hooks the same hook: their code and everything they
    read, by content (numbers bit for bit, NumPy arrays and small JAX arrays by their
    bytes, objects' attributes; library objects and large JAX arrays by identity, held
    weakly). A registry's entry (a dataclass holding the hook and its options) is
    keyed by its fields."""
    return _guarded_hook_key(hook)[0]


def static_key(obj: Any) -> Any:
    """`obj`'s key with every value by content: what makes two registered hooks equal."""
    return guarded_static_key(obj)[0]


def guarded_static_key(obj: Any) -> tuple[Any, list[Guard] | None]:
    """`static_key(obj)`, and the guards that tell cheaply whether it would change
    (`_guards.unchanged`); `None` where some content has no guard (a NumPy array)."""
    walk = Walk(STATIC)
    key = walk(obj)
    if walk.names_grew():
        again = Walk(STATIC)
        again.names.update(walk.names)
        key = again(obj)
        walk = again
    return key, None if walk.unguarded or walk.opaque else walk.guards


def _guarded_hook_key(hook: Any) -> tuple[Hashable, Any]:
    if dataclasses.is_dataclass(hook) and not isinstance(hook, type):
        keys, guards = zip(
            *(guarded_static_key(getattr(hook, f.name)) for f in dataclasses.fields(hook))
        )
        together = None if any(g is None for g in guards) else [x for g in guards for x in g]
        return (type(hook), tuple(keys)), together
    return guarded_static_key(hook)


def refreshed_hook_keys() -> Hashable:
    """Every registered hook keyed again, as it reads now (`cfg["s"]` changed since it
    was registered), the jit key published again if one changed; the hooks' keys.

    A run calls it on every call, and keys its program by it: its registered hooks
    then act as they read now (a change traces the run again), as a PyTorch module
    hook does on every call."""
    if not _published[0]:
        return ()  # no hook is registered anywhere
    with _lock:
        changed = False
        for hooks in list(_registries):
            for i, hook in list(hooks.items()):
                guards = hooks.guards_by_id.get(i)
                if guards is not None and unchanged(guards, [], []) is not None:
                    continue
                key, hooks.guards_by_id[i] = _guarded_hook_key(hook)
                if key != hooks.keys_by_id.get(i):
                    hooks.keys_by_id[i] = key
                    changed = True
        if changed:
            _publish(during_trace=not at_top_level())
        return _published[0]  # the hooks (not the generation: see `_publish`)


def registered_hooks() -> list:
    """Every hook registered anywhere (the function of a registry's entry)."""
    if not _published[0]:
        return []
    with _lock:
        return [getattr(h, "fn", h) for hooks in list(_registries) for h in list(hooks.values())]


def _publish(during_trace: bool) -> None:
    global _generation, _published
    if during_trace:
        _generation += 1
    snapshot = tuple(
        sorted(
            (hooks.serial, tuple(hooks.keys_by_id[i] for i in hooks))
            for hooks in list(_registries)
            if hooks
        )
    )
    _published = (snapshot, _generation)
    jit_key.set_global(_published)


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
                    hooks.guards_by_id.pop(self.id, None)
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

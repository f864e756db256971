"""The one loop that runs a chain of hooks: call each; a result that is not `None`,
once checked, replaces the value for the hooks after it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ._guide import guided

H = TypeVar("H")
V = TypeVar("V")


def run_chain(
    hooks: Iterable[H],
    value: V,
    call: Callable[[H, V], Any],
    accept: Callable[[H, Any, V], V],
    where: str | Callable[[H], str] | None = None,
) -> V:
    """Runs a chain of hooks in order, as PyTorch does for every kind of hook.

    **Arguments:**

    - `hooks`: the hooks, in the order they run.
    - `value`: what the first hook is given.
    - `call`: `call(hook, value)` calls one hook and returns what it returned.
    - `accept`: `accept(hook, new, value)` checks a result that is not `None` (it
        raises an error naming the hook) and returns the value that replaces `value`.
    - `where`: where the hooks run, for guided errors (`"at hook point 'hook_z'"`,
        `"of module 'fc1' (Linear)"`), or a function of the hook giving it.

    **Returns:**

    The value after the last hook. An error a hook raises out of a PyTorch habit
    (`float` on a traced value, the batch axis under `jax.vmap`, `z[i] = 0`) is re-raised
    with what to do instead (`_guide.py`).

    **Example:**

    ```python
    run_chain([double, observe], 1.0, lambda h, v: h(v), lambda h, new, old: new)
    ```
    """
    for hook in hooks:
        new = guided(call, hook, value, where(hook) if callable(where) else where)
        if new is not None:
            value = accept(hook, new, value)
    return value

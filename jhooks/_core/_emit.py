"""`jhooks.emit`: values computed in the backward pass, returned by `jhooks.grad`.

A backward hook runs while JAX traces the backward pass, which `jhooks.grad` runs in
its own trace, so a value a hook computes there is an ordinary value of the program
that `jhooks.grad` can return. `emit` hands it to the innermost `jhooks.grad` being
differentiated. Hooks mapped per example over `jax.vmap` levels (see
`_primitive.per_example`) return their emitted values from the mapped function, so
those carry the batch dimensions, leading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax

from ._checks import hook_name
from ._context import ThreadStack
from ._forward_values import forward_values
from ._jax_compat import differentiates, is_staging, path_to

_collectors: ThreadStack[Emitted] = ThreadStack("emit collectors")
_running: ThreadStack[Callable[..., Any]] = ThreadStack("running backward hooks")


class Emitted:
    """What one backward pass emitted: name -> (value, the hook that emitted it)."""

    def __init__(self, base: Any = None, stage: Callable[[str, Any], None] | None = None):
        self.values: dict[str, Any] = {}
        self.hooks: dict[str, str] = {}
        self.base = base
        # Marks a value emitted in a backward pass that JAX stages out (the backward of a
        # scan, a checkpoint, a cond, a nested jit), for `jhooks.grad` to reap.
        self.stage = stage
        self.staged: list[str] = []

    def add(self, name: str, value: Any, hook: str) -> None:
        if name in self.values:
            raise ValueError(
                f"jhooks.emit({name!r}) was called twice in one backward pass: by "
                f"{self.hooks[name]} and by {hook}. Give each emitted value its own name, "
                f"e.g. f'{name}.{{layer}}'."
            )
        self.values[name] = value
        self.hooks[name] = hook

    def merge_into(self, results: dict[str, Any], taken_by: str) -> None:
        """Adds the emitted values to `results`, refusing a name already there."""
        for name, value in self.values.items():
            if name in results:
                raise ValueError(
                    f"jhooks.emit({name!r}) in {self.hooks[name]} uses the name of "
                    f"{taken_by}: give one of them another name."
                )
            results[name] = value


@contextmanager
def collecting(emitted: Emitted) -> Iterator[Emitted]:
    """Collects what hooks emit inside the block into `emitted`."""
    with _collectors.pushed(emitted):
        yield emitted


@contextmanager
def running(hook: Callable[..., Any]) -> Iterator[None]:
    """Marks `hook` as the backward hook running now, for the errors of `emit`; what
    it reads of what forward hooks kept is the forward value (`_forward_values`)."""
    with _running.pushed(hook), forward_values(hook):
        yield


def running_backward_hook() -> Callable[..., Any] | None:
    """The backward hook running now (innermost), or `None` outside backward hooks."""
    return _running.top()


def call_hook(hook: Callable[..., Any], *args: Any) -> Any:
    """Calls a backward hook, so that what it emits names it."""
    with running(hook):
        return hook(*args)


def mapped_with_emits(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` returning `(out, emitted values)`, for mapping over vmap levels. The values
    are keyed by `(name, hook)`: what names the hook travels with the value, so nothing
    is left behind when the mapped call raises."""

    def with_emits(*args: Any) -> tuple[Any, dict[tuple[str, str], Any]]:
        inner = Emitted()
        with collecting(inner):
            out = fn(*args)
        return out, {(name, inner.hooks[name]): v for name, v in inner.values.items()}

    return with_emits


def forward_emits(values: dict[tuple[str, str], Any]) -> None:
    """Emits the values that a mapped hook emitted, now batched, to the collector."""
    for (name, hook), value in values.items():
        _emit_to_collector(name, value, hook)


def _emit_to_collector(name: str, value: Any, hook: str) -> None:
    collector = _collectors.top()
    if collector is None:
        return
    path = [] if collector.base is None else path_to(collector.base)
    if path is None or any(differentiates(t) for t in path):
        # A forward pass, or the backward pass of a plain `jax.grad` inside the function
        # that `jhooks.grad` differentiates (a gradient penalty): not `jhooks.grad`'s own
        # backward pass, which runs the hooks again and emits there.
        return
    if any(is_staging(t) for t in path):
        if collector.stage is not None:
            collector.stage(name, value)
            collector.staged.append(name)
            return
        raise ValueError(
            f"jhooks.emit({name!r}) in {hook}: this backward pass runs inside a "
            "transformation that JAX traces on its own within the differentiated function "
            "(a nested jax.jit, lax.scan, jax.checkpoint or lax.cond), so its values "
            "cannot be returned from it. Emit from a hook outside that transformation, "
            "or put jhooks.grad inside it."
        )
    collector.add(name, value, hook)


def emit(name: str, value: Any) -> None:
    """Returns a value computed in a backward hook from `jhooks.grad`.

    **Arguments:**

    - `name`: the key of the value in the `retained` dict of [`jhooks.grad`][] and
        [`jhooks.value_and_grad`][], and in the cache of
        `jhooks.run_with_cache(..., incl_bwd=True)`.
    - `value`: an array or pytree of arrays computed in the hook, typically from the
        gradients it sees (a norm, a histogram, a statistic).

    **Returns:**

    Nothing. Called inside any backward hook (value hooks, multi-grad hooks, node
    hooks, module backward hooks, parameter hooks, `run_with_hooks` backward hooks).
    The value is an output of the compiled program, with no host callback: it works
    under `jax.jit` and sharded jit, and in backward passes inside `lax.scan` (stacked
    along the scan's axis), `jax.checkpoint`, `lax.cond` and nested `jax.jit`. Under
    `jax.vmap` of the function that `jhooks.grad` differentiates, a hook sees one
    example and its emitted value comes back with the batch dimension leading. A value
    belongs to the backward pass of the innermost `jhooks.grad`: anywhere else (the
    forward pass, plain `jax.grad`, the backward pass of a plain `jax.grad` inside the
    differentiated function) `emit` does nothing. Emitting one name twice in one
    backward pass is an error that names both hooks.

    **Example:**

    ```python
    def loss(params, x):
        h = jhooks.register_hook(x @ params, lambda g: jhooks.emit("h_norm", jnp.linalg.norm(g)))
        return jnp.sum(jnp.tanh(h))

    grads, retained = jax.jit(jhooks.grad(loss))(params, x)
    retained["h_norm"]  # the norm of the gradient at h, every step
    ```
    """
    if not isinstance(name, str):
        raise TypeError(f"jhooks.emit takes a string name, got {name!r}.")
    leaves = jax.tree.leaves(value)
    if not leaves or not all(isinstance(x, jax.Array) or hasattr(x, "shape") for x in leaves):
        raise TypeError(
            f"jhooks.emit({name!r}) takes an array or a pytree of arrays, got "
            f"{type(value).__name__}."
        )
    hook = _running.top()
    _emit_to_collector(name, value, "a hook" if hook is None else hook_name(hook))

"""Autograd-node hooks: PyTorch's `grad_fn.register_hook` and `register_prehook`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .._core import Hooks, RemovableHandle, add_hook, check_callable, hook_name
from ._backward_hooks import call_with_backward_hooks

R = TypeVar("R")


class Node(Generic[R]):
    """A function whose backward pass can be hooked, as a PyTorch autograd node can.

    **Arguments:**

    - `fn`: the function. `Node(fn)(*args)` returns `fn(*args)`.

    In the backward pass, pre-hooks `hook(grad_outputs) -> tuple | None` run first and
    may replace the gradients of `fn`'s outputs; then hooks
    `hook(grad_inputs, grad_outputs) -> tuple | None` run and may replace the gradients
    of `fn`'s positional arguments. `grad_inputs` has one entry per positional argument
    (`None` for one that is not a floating array, or that is not differentiated);
    `grad_outputs` one per array in the output.

    The hooks that run are those registered when the node is called: one registered
    between the forward pass and the backward pass (between `jax.vjp` and calling its
    function) does not run in that backward pass, unlike PyTorch, because JAX builds
    the backward rule when it traces the forward pass. Hooks added or removed after a
    jitted function ran make it retrace on its next call.

    **Example:**

    ```python
    @jhooks.Node
    def mul(a, b):
        return a * b

    mul.register_prehook(lambda grad_outputs: (grad_outputs[0] * 2,))
    mul.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0], None))
    jax.grad(lambda a, b: mul(a, b).sum(), argnums=(0, 1))(a, b)  # (2 * b, 0)
    ```
    """

    def __init__(self, fn: Callable[..., R]):
        check_callable(fn, "the function of a jhooks.Node")
        self.fn = fn
        functools.update_wrapper(self, fn)
        self._hooks = Hooks()
        self._pre_hooks = Hooks()

    def register_hook(self, hook: Callable[[tuple, tuple], tuple | None]) -> RemovableHandle:
        """Adds `hook(grad_inputs, grad_outputs) -> tuple | None`, run after the pre-hooks.

        **Example:**

        ```python
        node = jhooks.Node(lambda a, b: a * b)
        node.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0], None))
        ```
        """
        check_callable(hook)
        return add_hook(self._hooks, hook)

    def register_prehook(self, hook: Callable[[tuple], tuple | None]) -> RemovableHandle:
        """Adds `hook(grad_outputs) -> tuple | None`, run before the node's backward.

        **Example:**

        ```python
        node.register_prehook(lambda grad_outputs: (2.0 * grad_outputs[0],))
        ```
        """
        check_callable(hook)
        return add_hook(self._pre_hooks, hook)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if not self._hooks and not self._pre_hooks:
            return self.fn(*args, **kwargs)
        return call_with_backward_hooks(
            self.fn,
            args,
            kwargs,
            pre_hooks=list(self._pre_hooks.values()),
            hooks=list(self._hooks.values()),
            owner=f"Node({hook_name(self.fn)})",
            materialize_grads=False,
        )

    def __repr__(self) -> str:
        return f"Node({hook_name(self.fn)})"

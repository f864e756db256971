"""Global module hooks: PyTorch's `torch.nn.modules.module.register_module_*_hook`.

They run for every hookable module, before the module's own hooks. Like every other
hook they are part of the jit cache key (see `jhooks/_core/_handles.py`): a jitted function
retraces when one is added or removed.
"""

from __future__ import annotations

from typing import Any, Literal, overload

from .._core import RemovableHandle, add_hook, check_callable
from ._kinds import ForwardEntry, ModuleHooks
from ._types import (
    BackwardHook,
    BackwardPreHook,
    ForwardHook,
    ForwardHookWithKwargs,
    ForwardPreHook,
)

GLOBAL = ModuleHooks()


def register_module_forward_pre_hook(hook: ForwardPreHook[Any]) -> RemovableHandle:
    """A forward pre-hook for every hookable module: PyTorch's function of the same name.

    **Arguments:**

    - `hook`: `hook(module, args) -> None | args`, as for
        `module.register_forward_pre_hook`. It runs before the module's own pre-hooks.

    **Returns:**

    A [`jhooks.RemovableHandle`][]. Jitted functions retrace when it is added or removed.

    **Example:**

    ```python
    with jhooks.register_module_forward_pre_hook(lambda m, args: print(type(m).__name__)):
        net(x)  # prints the name of every module called
    ```
    """
    check_callable(hook)
    return add_hook(GLOBAL.forward_pre, ForwardEntry(hook))


@overload
def register_module_forward_hook(
    hook: ForwardHook[Any], *, with_kwargs: Literal[False] = False, always_call: bool = False
) -> RemovableHandle: ...


@overload
def register_module_forward_hook(
    hook: ForwardHookWithKwargs[Any], *, with_kwargs: Literal[True], always_call: bool = False
) -> RemovableHandle: ...


def register_module_forward_hook(
    hook: Any, *, with_kwargs: bool = False, always_call: bool = False
) -> RemovableHandle:
    """A forward hook for every hookable module: PyTorch's function of the same name.

    **Arguments:**

    - `hook`: `hook(module, args, output) -> None | output`, or
        `hook(module, args, kwargs, output)` with `with_kwargs=True`. It runs before
        the module's own forward hooks.
    - `with_kwargs`: pass the call's keyword arguments too.
    - `always_call`: run the hook even when the module's forward raises (with
        `output=None`), as PyTorch does.

    **Returns:**

    A [`jhooks.RemovableHandle`][].

    **Example:**

    ```python
    shapes = []
    with jhooks.register_module_forward_hook(lambda m, args, out: shapes.append(out.shape)):
        net(x)
    ```
    """
    check_callable(hook)
    return add_hook(GLOBAL.forward, ForwardEntry(hook, with_kwargs, always_call))


def register_module_full_backward_pre_hook(hook: BackwardPreHook[Any]) -> RemovableHandle:
    """A backward pre-hook for every hookable module: PyTorch's function of the same name.

    **Arguments:**

    - `hook`: `hook(module, grad_output) -> None | grad_output`, as for
        `module.register_full_backward_pre_hook`; it runs before the module's own.

    **Returns:**

    A [`jhooks.RemovableHandle`][].

    **Example:**

    ```python
    h = jhooks.register_module_full_backward_pre_hook(jhooks.host(lambda m, g: print(g)))
    ```
    """
    check_callable(hook)
    return add_hook(GLOBAL.full_backward_pre, hook)


def register_module_full_backward_hook(hook: BackwardHook[Any]) -> RemovableHandle:
    """A full backward hook for every hookable module: PyTorch's function of the same name.

    **Arguments:**

    - `hook`: `hook(module, grad_input, grad_output) -> None | grad_input`, as for
        `module.register_full_backward_hook`; it runs before the module's own.

    **Returns:**

    A [`jhooks.RemovableHandle`][].

    **Example:**

    ```python
    h = jhooks.register_module_full_backward_hook(lambda m, gi, go: None)
    ```
    """
    check_callable(hook)
    return add_hook(GLOBAL.full_backward, hook)

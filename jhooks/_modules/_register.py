"""Registering hooks on one module: the typed functions behind every `register_*`.

`jhooks.register_forward_hook(module, hook)` and the other functions here are the
typed public forms; the methods of `jhooks.Module` (`module.register_forward_hook(hook)`,
kept for PyTorch habits) call them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import jax.numpy as jnp

from .._core import Hooks, RemovableHandle, add_hook, check_callable, describe, hook_name
from ._kinds import ForwardEntry, Kind
from ._methods import warn_if_never_called
from ._names import named_parameters
from ._registry import owner, registry_of
from ._types import (
    AnyModule,
    BackwardHook,
    BackwardPreHook,
    ForwardHook,
    ForwardHookWithKwargs,
    ForwardPreHook,
    ForwardPreHookWithKwargs,
    ParameterHook,
)

M = TypeVar("M", bound=AnyModule)


@overload
def register_forward_pre_hook(
    module: M,
    hook: ForwardPreHook[M],
    *,
    prepend: bool = False,
    with_kwargs: Literal[False] = False,
) -> RemovableHandle: ...


@overload
def register_forward_pre_hook(
    module: M,
    hook: ForwardPreHookWithKwargs[M],
    *,
    prepend: bool = False,
    with_kwargs: Literal[True],
) -> RemovableHandle: ...


def register_forward_pre_hook(
    module: Any, hook: Any, *, prepend: bool = False, with_kwargs: bool = False
) -> RemovableHandle:
    """Adds a hook run before `module`'s `__call__`: PyTorch's `register_forward_pre_hook`.

    **Arguments:**

    - `module`: a hookable module (see [`jhooks.hookable`][]).
    - `hook`: `hook(module, args) -> None | args`, where `args` is the tuple of
        positional arguments; a returned non-tuple is wrapped as `(value,)`. With
        `with_kwargs=True`, `hook(module, args, kwargs) -> None | (args, kwargs)`.
    - `prepend`: run before the module's other forward pre-hooks (global ones
        still run first).
    - `with_kwargs`: pass and let the hook replace the keyword arguments.

    **Returns:**

    A [`jhooks.RemovableHandle`][]. Raises a `TypeError` when `module` is not hookable.

    **Example:**

    ```python
    jhooks.register_forward_pre_hook(net.fc1, lambda module, args: args[0] * 2)
    ```
    """
    check_callable(hook)
    warn_if_never_called(module, "forward pre-hook")
    return add_hook(
        registry_of(module).forward_pre, ForwardEntry(hook, with_kwargs), prepend=prepend
    )


@overload
def register_forward_hook(
    module: M,
    hook: ForwardHook[M],
    *,
    prepend: bool = False,
    with_kwargs: Literal[False] = False,
    always_call: bool = False,
) -> RemovableHandle: ...


@overload
def register_forward_hook(
    module: M,
    hook: ForwardHookWithKwargs[M],
    *,
    prepend: bool = False,
    with_kwargs: Literal[True],
    always_call: bool = False,
) -> RemovableHandle: ...


def register_forward_hook(
    module: Any,
    hook: Any,
    *,
    prepend: bool = False,
    with_kwargs: bool = False,
    always_call: bool = False,
) -> RemovableHandle:
    """Adds a hook run after `module`'s `__call__`: PyTorch's `register_forward_hook`.

    **Arguments:**

    - `module`: a hookable module (see [`jhooks.hookable`][]).
    - `hook`: `hook(module, args, output) -> None | output`; a non-`None` return
        replaces the output. With `with_kwargs=True`,
        `hook(module, args, kwargs, output)`.
    - `prepend`: run before the module's other forward hooks.
    - `with_kwargs`: pass the keyword arguments too.
    - `always_call`: run the hook even when the call raises (at trace time),
        with `output=None`; the error is then raised again.

    **Returns:**

    A [`jhooks.RemovableHandle`][]. Raises a `TypeError` when `module` is not hookable.
    On a module whose class has no `__call__` (used through other methods, as
    `embedder.encode`), the hook would never run: a `UserWarning` says so and names
    the method points to use in a run instead (this holds for the pre-hooks and
    backward hooks too).

    **Example:**

    ```python
    jhooks.register_forward_hook(net.fc1, lambda module, args, out: jnp.clip(out, -1, 1))
    ```
    """
    check_callable(hook)
    entry = ForwardEntry(hook, with_kwargs, always_call)
    warn_if_never_called(module, "forward hook")
    return add_hook(registry_of(module).forward, entry, prepend=prepend)


def register_full_backward_pre_hook(
    module: M, hook: BackwardPreHook[M], prepend: bool = False
) -> RemovableHandle:
    """Adds a hook on the gradients of `module`'s outputs: PyTorch's
    `register_full_backward_pre_hook`.

    **Arguments:**

    - `module`: a hookable module (see [`jhooks.hookable`][]).
    - `hook`: `hook(module, grad_output) -> None | grad_output` (`module` with
        shapes in place of arrays, see [`jhooks.Module`][]). `grad_output`
        is a tuple with an entry per array leaf of the output (`None` for an
        integer one, or one that no gradient reached); a returned tuple of the
        same length and shapes replaces it.
    - `prepend`: run before the module's other backward pre-hooks.

    **Returns:**

    A [`jhooks.RemovableHandle`][].

    **Example:**

    ```python
    jhooks.register_full_backward_pre_hook(net.fc1, lambda module, g: (g[0] * 2,))
    ```
    """
    check_callable(hook)
    warn_if_never_called(module, "backward pre-hook")
    return add_hook(registry_of(module).full_backward_pre, hook, prepend=prepend)


def register_full_backward_hook(
    module: M, hook: BackwardHook[M], prepend: bool = False
) -> RemovableHandle:
    """Adds a hook on the gradients of `module`'s inputs: PyTorch's
    `register_full_backward_hook`.

    **Arguments:**

    - `module`: a hookable module (see [`jhooks.hookable`][]).
    - `hook`: `hook(module, grad_input, grad_output) -> None | grad_input`
        (`module` with shapes in place of arrays). `grad_input` has an entry
        per positional argument of the call (`None` for one that is not a
        floating array); a returned tuple of the same length and shapes replaces
        it. When no argument is differentiated the hook is called with `None`
        entries and must return `None`, as in PyTorch. Keyword arguments and
        parameters have no entry.
    - `prepend`: run before the module's other full backward hooks.

    **Returns:**

    A [`jhooks.RemovableHandle`][].

    **Example:**

    ```python
    jhooks.register_full_backward_hook(net.act, lambda m, gi, go: (jnp.maximum(gi[0], 0),))
    ```
    """
    check_callable(hook)
    warn_if_never_called(module, "backward hook")
    return add_hook(registry_of(module).full_backward, hook, prepend=prepend)


def register_backward_hook(module: AnyModule, hook: BackwardHook[Any]) -> RemovableHandle:
    """PyTorch's deprecated name: warns, and registers a full backward hook."""
    check_callable(hook)
    registry = registry_of(module)
    warnings.warn(
        f"register_backward_hook is deprecated, as in PyTorch: use "
        f"register_full_backward_hook. {hook_name(hook)} is registered on "
        f"{owner(module)} as a full backward hook.",
        FutureWarning,
        stacklevel=3,
    )
    return add_hook(registry.full_backward, hook)


def register_parameter_hook(module: AnyModule, name: str, fn: ParameterHook) -> RemovableHandle:
    """Adds a gradient hook on a parameter: PyTorch's `param.register_hook(fn)`.

    **Arguments:**

    - `module`: a hookable module (see [`jhooks.hookable`][]).
    - `name`: the parameter's dotted name from `module`, as listed by
        [`jhooks.named_parameters`][] (`"fc1.bias"`).
    - `fn`: `fn(grad) -> None | grad`, with a gradient of the parameter's shape
        and dtype; a non-`None` return replaces it. Several hooks on one
        parameter run in registration order.

    **Returns:**

    A [`jhooks.RemovableHandle`][].

    The parameter is wrapped when `module` is called, so `fn` runs once per
    call of `module` in a differentiated function, with the gradient summed
    over every use of the parameter inside that call: once per differentiation,
    with the total gradient, when the model is called once (as PyTorch). A
    submodule that appears twice under `module` (the same object under two
    parents) holds one parameter, as in PyTorch: `fn` sees the gradient summed
    over both, which the gradient of its first appearance (the name `name`)
    holds (see "Shared modules" in the semantics). Under `jax.vmap(model)` the
    parameter is shared by the examples, so `fn` still sees the total gradient
    over the batch; under `jax.vmap(jax.grad(loss))` it sees each example's
    gradient (per-example clipping). If `module` is called twice in one
    differentiated function, `fn` runs twice, each time with that call's share
    of the gradient: register the hook on a module that encloses both calls to
    get the total.

    **Example:**

    ```python
    jhooks.register_parameter_hook(net, "fc1.bias", jnp.zeros_like)  # freeze fc1.bias
    ```
    """
    check_callable(fn)
    registry = registry_of(module)
    params = dict(named_parameters(module))
    if name not in params:
        raise ValueError(
            f"register_parameter_hook({name!r}, {hook_name(fn)}) on {owner(module)}: "
            f"no such parameter. Valid names: {', '.join(params) or 'none'}."
        )
    if not jnp.issubdtype(params[name].dtype, jnp.inexact):
        raise TypeError(
            f"register_parameter_hook({name!r}, {hook_name(fn)}) on {owner(module)}: "
            f"the parameter is {describe(params[name])}; only floating-point arrays "
            "have gradients."
        )
    return add_hook(registry.parameters.setdefault(name, Hooks()), fn)


# The registration function of each kind (`_kinds.KINDS`), for `register_module_hooks`.
REGISTER: dict[Kind, Callable[..., RemovableHandle]] = {
    "forward_pre": register_forward_pre_hook,
    "forward": register_forward_hook,
    "full_backward_pre": register_full_backward_pre_hook,
    "full_backward": register_full_backward_hook,
}

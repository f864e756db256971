"""The types of module hooks, as `typing.Protocol`s (as optax's `TransformUpdateFn`).

Each is generic in the module type `M`: `ForwardHook[eqx.nn.Linear]` is a hook for a
`Linear` (and `ForwardHook[nnx.Linear]` for Flax NNX's). Parameters are
positional-only, so a hook may name them as it likes.
Gradient tuples hold a `jax.Array` per differentiable entry and `None` elsewhere;
they are typed `tuple[Any, ...]` so that a hook can use its entries without a check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

import equinox as eqx
import jax

if TYPE_CHECKING:  # never imported at run time: `import jhooks` imports no Flax
    from flax import nnx

# What the `register_*` functions take: an Equinox module, or a Flax NNX one.
AnyModule: TypeAlias = "eqx.Module | nnx.Module"

M = TypeVar("M", bound=AnyModule, contravariant=True)


class ForwardPreHook(Protocol[M]):
    """`hook(module, args) -> None | args`: runs before the module's `__call__`.

    `args` is the tuple of positional arguments; a non-`None` return replaces it (a
    non-tuple is wrapped as `(value,)`). See [`jhooks.register_forward_pre_hook`][].

    **Example:**

    ```python
    def scale_input(module: eqx.nn.Linear, args: tuple) -> tuple:
        return (args[0] * 0.5,)

    hook: jhooks.ForwardPreHook[eqx.nn.Linear] = scale_input
    jhooks.register_forward_pre_hook(model.fc1, hook)
    ```
    """

    def __call__(self, module: M, args: tuple[Any, ...], /) -> Any: ...


class ForwardPreHookWithKwargs(Protocol[M]):
    """`hook(module, args, kwargs) -> None | (args, kwargs)`: a forward pre-hook
    registered with `with_kwargs=True`.

    **Example:**

    ```python
    def no_dropout(module, args, kwargs):
        return args, {**kwargs, "inference": True}

    jhooks.register_forward_pre_hook(model.block, no_dropout, with_kwargs=True)
    ```
    """

    def __call__(self, module: M, args: tuple[Any, ...], kwargs: dict[str, Any], /) -> Any: ...


class ForwardHook(Protocol[M]):
    """`hook(module, args, output) -> None | output`: runs after the module's `__call__`.

    A non-`None` return replaces the output. See [`jhooks.register_forward_hook`][].

    **Example:**

    ```python
    def clip_output(module: eqx.nn.Linear, args: tuple, output: jax.Array) -> jax.Array:
        return jnp.clip(output, -1.0, 1.0)

    hook: jhooks.ForwardHook[eqx.nn.Linear] = clip_output
    jhooks.register_forward_hook(model.fc1, hook)
    ```
    """

    def __call__(self, module: M, args: tuple[Any, ...], output: Any, /) -> Any: ...


class ForwardHookWithKwargs(Protocol[M]):
    """`hook(module, args, kwargs, output) -> None | output`: a forward hook
    registered with `with_kwargs=True`.

    **Example:**

    ```python
    def log_key(module, args, kwargs, output):
        print("called with key", kwargs.get("key"))

    jhooks.register_forward_hook(model.dropout, log_key, with_kwargs=True)
    ```
    """

    def __call__(
        self, module: M, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, /
    ) -> Any: ...


class BackwardPreHook(Protocol[M]):
    """`hook(module, grad_output) -> None | grad_output`: runs on the gradients of the
    module's outputs. See [`jhooks.register_full_backward_pre_hook`][].

    **Example:**

    ```python
    def clamp(module: eqx.nn.Linear, grad_output: tuple) -> tuple:
        return (jnp.clip(grad_output[0], -0.1, 0.1),)

    hook: jhooks.BackwardPreHook[eqx.nn.Linear] = clamp
    jhooks.register_full_backward_pre_hook(model.fc1, hook)
    ```
    """

    def __call__(self, module: M, grad_output: tuple[Any, ...], /) -> Any: ...


class BackwardHook(Protocol[M]):
    """`hook(module, grad_input, grad_output) -> None | grad_input`: runs on the
    gradients of the module's inputs. See [`jhooks.register_full_backward_hook`][].

    **Example:**

    ```python
    def non_negative(module, grad_input: tuple, grad_output: tuple) -> tuple:
        return (jnp.maximum(grad_input[0], 0.0),)

    hook: jhooks.BackwardHook[eqx.Module] = non_negative
    jhooks.register_full_backward_hook(model.act, hook)
    ```
    """

    def __call__(
        self, module: M, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...], /
    ) -> tuple[Any, ...] | None: ...


class ParameterHook(Protocol):
    """`fn(grad) -> None | grad`: runs on the gradient of a parameter, PyTorch's
    `param.register_hook(fn)`. See [`jhooks.register_parameter_hook`][].

    **Example:**

    ```python
    def zero(grad: jax.Array) -> jax.Array:
        return jnp.zeros_like(grad)

    hook: jhooks.ParameterHook = zero
    jhooks.register_parameter_hook(model, "fc.bias", hook)  # PyTorch: fc.bias.register_hook
    ```
    """

    def __call__(self, grad: jax.Array, /) -> jax.Array | None: ...

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
    """

    def __call__(self, module: M, args: tuple[Any, ...], /) -> Any: ...


class ForwardPreHookWithKwargs(Protocol[M]):
    """`hook(module, args, kwargs) -> None | (args, kwargs)`: a forward pre-hook
    registered with `with_kwargs=True`."""

    def __call__(self, module: M, args: tuple[Any, ...], kwargs: dict[str, Any], /) -> Any: ...


class ForwardHook(Protocol[M]):
    """`hook(module, args, output) -> None | output`: runs after the module's `__call__`.

    A non-`None` return replaces the output. See [`jhooks.register_forward_hook`][].
    """

    def __call__(self, module: M, args: tuple[Any, ...], output: Any, /) -> Any: ...


class ForwardHookWithKwargs(Protocol[M]):
    """`hook(module, args, kwargs, output) -> None | output`: a forward hook
    registered with `with_kwargs=True`."""

    def __call__(
        self, module: M, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, /
    ) -> Any: ...


class BackwardPreHook(Protocol[M]):
    """`hook(module, grad_output) -> None | grad_output`: runs on the gradients of the
    module's outputs. See [`jhooks.register_full_backward_pre_hook`][]."""

    def __call__(self, module: M, grad_output: tuple[Any, ...], /) -> Any: ...


class BackwardHook(Protocol[M]):
    """`hook(module, grad_input, grad_output) -> None | grad_input`: runs on the
    gradients of the module's inputs. See [`jhooks.register_full_backward_hook`][]."""

    def __call__(
        self, module: M, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...], /
    ) -> tuple[Any, ...] | None: ...


class ParameterHook(Protocol):
    """`fn(grad) -> None | grad`: runs on the gradient of a parameter, PyTorch's
    `param.register_hook(fn)`. See [`jhooks.register_parameter_hook`][]."""

    def __call__(self, grad: jax.Array, /) -> jax.Array | None: ...

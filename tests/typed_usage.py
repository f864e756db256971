"""A small typed user script: pyright must report no error on it (tests/test_modules_api.py).

It uses the typed module-level functions and the hook Protocols, as a user would.
`_misuse` holds calls that the types must reject: each is marked with a pyright ignore,
and an ignore that is not needed is an error here, so pyright fails if one is accepted.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=true

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

import jhooks


class Net(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(3, 4, key=k1)
        self.fc2 = eqx.nn.Linear(4, 2, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.relu(self.fc1(x)))


def double_input(module: eqx.nn.Linear, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * 2.0,)


def clip_output(module: eqx.Module, args: tuple[Any, ...], output: Any) -> jax.Array:
    return jnp.clip(output, -1.0, 1.0)


def with_kwargs(
    module: eqx.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    assert isinstance(jhooks.module_path(module), str) and not kwargs


def scale_grad_output(module: eqx.nn.Linear, grad_output: tuple[Any, ...]) -> tuple[Any, ...]:
    return (grad_output[0] * 3.0,)


def halve_grad_input(
    module: eqx.nn.Linear, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    if grad_input[0] is None:  # the input is not differentiated
        return None
    return (grad_input[0] * 0.5,)


def freeze(grad: jax.Array) -> jax.Array:
    return jnp.zeros_like(grad)


def main() -> None:
    net: Net = jhooks.hookable(Net(jax.random.PRNGKey(0)))
    handles: list[jhooks.RemovableHandle] = [
        jhooks.register_forward_pre_hook(net.fc1, double_input),
        jhooks.register_forward_pre_hook(net.fc1, lambda m, args: None, prepend=True),
        jhooks.register_forward_hook(net.fc2, clip_output, always_call=True),
        jhooks.register_forward_hook(net, with_kwargs, with_kwargs=True),
        jhooks.register_full_backward_pre_hook(net.fc2, scale_grad_output),
        jhooks.register_full_backward_hook(net.fc1, halve_grad_input, prepend=True),
        jhooks.register_full_backward_hook(net.fc1, lambda m, gi, go: None),
        jhooks.register_parameter_hook(net, "fc1.bias", freeze),
        jhooks.register_parameter_hook(net, "fc2.bias", jnp.zeros_like),
    ]
    handles += [
        jhooks.register_module_forward_pre_hook(lambda m, args: None),
        jhooks.register_module_forward_hook(clip_output),
        jhooks.register_module_forward_hook(with_kwargs, with_kwargs=True, always_call=True),
        jhooks.register_module_full_backward_pre_hook(lambda m, go: None),
        jhooks.register_module_full_backward_hook(lambda m, gi, go: None),
    ]
    hook: jhooks.ForwardHook[eqx.Module] = clip_output
    handles.append(jhooks.register_forward_hook(net.fc1, hook))
    pre: jhooks.ParameterHook = freeze
    handles.append(jhooks.register_parameter_hook(net, "fc2.weight", pre))
    grads, x_grad = jax.grad(lambda n, x: jnp.sum(n(x)), argnums=(0, 1))(net, jnp.ones(3))
    assert jhooks.module_path(net.fc1) == "fc1"
    assert not jnp.any(grads.fc1.bias) and x_grad.shape == (3,)
    for h in handles:
        h.remove()


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(3, 4, rngs=rngs)
        self.linear2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(jax.nn.relu(self.linear1(x)))


def nnx_scale_input(module: nnx.Linear, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * module.in_features,)


def nnx_clip(module: nnx.Module, args: tuple[Any, ...], output: Any) -> jax.Array:
    return jnp.clip(output, -1.0, 1.0)


def nnx_main() -> None:
    net: NNXNet = jhooks.hookable(NNXNet(nnx.Rngs(0)))
    handles: list[jhooks.RemovableHandle] = [
        jhooks.register_forward_pre_hook(net.linear1, nnx_scale_input),
        jhooks.register_forward_hook(net.linear2, nnx_clip),
        jhooks.register_full_backward_pre_hook(net.linear2, lambda m, go: None),
        jhooks.register_full_backward_hook(net.linear1, lambda m, gi, go: None),
        jhooks.register_parameter_hook(net, "linear1.bias", freeze),
    ]
    hook: jhooks.ForwardHook[nnx.Linear] = nnx_clip
    handles.append(jhooks.register_forward_hook(net.linear1, hook))
    grads = nnx.grad(lambda n, x: jnp.sum(n(x)))(net, jnp.ones((2, 3)))
    assert jhooks.module_path(net.linear2) == "linear2"
    assert not jnp.any(dict(jhooks.named_parameters(grads))["linear1.bias"])
    for h in handles:
        h.remove()


def _misuse(net: Net) -> None:  # never called: only type-checked
    def two(module: eqx.Module, args: tuple[Any, ...]) -> None: ...

    def four(m: eqx.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None: ...

    def conv_only(module: eqx.nn.Conv2d, args: tuple[Any, ...], output: Any) -> None: ...

    jhooks.register_forward_hook(net.fc1, two)  # pyright: ignore[reportArgumentType]
    jhooks.register_forward_hook(net.fc1, four)  # pyright: ignore[reportArgumentType]
    jhooks.register_forward_hook(net.fc1, conv_only)  # pyright: ignore[reportArgumentType]
    jhooks.register_forward_pre_hook(net, four, with_kwargs=True)  # pyright: ignore[reportCallIssue, reportArgumentType]
    jhooks.register_parameter_hook(net, "fc1.bias", two)  # pyright: ignore[reportArgumentType]
    jhooks.register_full_backward_hook(net.fc1, two)  # pyright: ignore[reportArgumentType]
    jhooks.register_forward_hook(jnp.ones(3), clip_output)  # pyright: ignore[reportArgumentType]
    nnx_net = NNXNet(nnx.Rngs(0))
    jhooks.register_forward_pre_hook(nnx_net.linear1, double_input)  # pyright: ignore[reportArgumentType]
    jhooks.register_forward_hook(nnx_net.linear1, clip_output)  # pyright: ignore[reportArgumentType]
    jhooks.register_forward_hook(nnx_net.linear1, conv_only)  # pyright: ignore[reportArgumentType]


if __name__ == "__main__":
    main()
    nnx_main()

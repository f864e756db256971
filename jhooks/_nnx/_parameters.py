"""What the call pipeline and `clipped_grad` need of an NNX module: its parameters
wrapped for one call, its shapes for backward hooks, and what `nnx.grad` differentiates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from .._autograd import register_hook
from ._flax_compat import get_raw, set_raw
from ._names import parameter_variables


@contextlib.contextmanager
def parameters_hooked(module: nnx.Module, chains: dict[str, Callable[[Any], Any]]) -> Iterator[Any]:
    """Inside: `module` itself, each parameter named in `chains` holding its value
    wrapped by `jhooks.register_hook(value, chains[name])`; restored on the way out.

    NNX modules are mutable and their state updates (batch statistics, RNG counts)
    must reach the caller, so the call runs on the module itself, not on a copy. A
    parameter the call assigned anew is left as the call left it.
    """
    variables = dict(parameter_variables(module))
    swapped = []
    for name, chain in chains.items():
        variable = variables.get(name)
        if variable is None:
            continue  # the parameter was removed from the module after registration
        old = get_raw(variable)
        new = register_hook(old, chain)
        set_raw(variable, new)
        swapped.append((variable, old, new))
    try:
        yield module
    finally:
        for variable, old, new in swapped:
            if get_raw(variable) is new:
                set_raw(variable, old)


def _shape(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x


def shapes(module: nnx.Module) -> nnx.Module:
    """A copy of `module` whose variables hold `jax.ShapeDtypeStruct`s (as `nnx.eval_shape`
    gives): its class, static attributes, path and hooks, no values of the forward pass."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(_shape, state))


def differentiable(model: nnx.Module) -> tuple[Any, Callable[[Any], Any]]:
    """`(params, rebuild)`: the `nnx.State` of `model`'s `nnx.Param`s (what `nnx.grad`
    differentiates by default) and `rebuild(params)`, a model holding them and
    `model`'s other state. An `nnx.State` is differentiated whole."""
    if isinstance(model, nnx.State):
        return model, lambda new_params: new_params
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def rebuild(new_params: Any) -> nnx.Module:
        return nnx.merge(graphdef, new_params, rest)

    return params, rebuild

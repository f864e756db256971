"""Backward hooks around a whole call, built as PyTorch's `BackwardHook` is.

One identity wrapper on the call's array arguments and one on its outputs, both
instances of the primitive of `_primitive.py`. In the backward pass the output side
runs the pre-hooks on `grad_outputs` and keeps them; the input side then runs the
hooks on `(grad_inputs, grad_outputs)`. The call itself is differentiated by JAX as
usual, so idle wrappers cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._checks import describe, hook_name
from ._primitive import bind, vmapped


def _is_differentiable(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)


def check_grads(hook: Callable, new: Any, expected: Sequence[Any], what: str, owner: str) -> tuple:
    """Checks a tuple of gradients returned by a node or module hook.

    `expected` holds a `jax.ShapeDtypeStruct` per differentiable entry and `None`
    elsewhere; an entry of `new` may be `None` (no gradient) or match.
    """
    if not isinstance(new, (tuple, list)) or len(new) != len(expected):
        got = f"{len(new)} {what} entries" if isinstance(new, (tuple, list)) else describe(new)
        raise ValueError(
            f"hook {hook_name(hook)} of {owner} returned {got}, expected None or a tuple of "
            f"{len(expected)} {what} entries like {describe(tuple(expected))}."
        )
    for i, (n, e) in enumerate(zip(new, expected)):
        if n is None:
            continue
        if e is None or jnp.shape(n) != e.shape or jnp.result_type(n) != e.dtype:
            want = "None (it is not differentiable)" if e is None else describe(e)
            raise ValueError(
                f"hook {hook_name(hook)} of {owner} returned {describe(n)} as {what}[{i}], "
                f"expected {want}."
            )
    return tuple(new)


class _CallState:
    """What the two sides of one call share in the backward pass."""

    def __init__(
        self,
        pre_hooks: Callable[[], list[Callable]],
        hooks: Callable[[], list[Callable]],
        owner: str,
        inputs: list[Any],
        input_index: list[int],
    ):
        self.pre_hooks = pre_hooks
        self.hooks = hooks
        self.owner = owner
        self.input_index = input_index
        self.expected_inputs = self._expected(inputs, input_index)
        self.output_index: list[int] = []
        self.expected_outputs: tuple = ()
        self.inputs_differentiated = False
        self.grad_outputs: tuple | None = None
        self.grad_outputs_levels = 0

    def set_outputs(self, outputs: list[Any], output_index: list[int]) -> None:
        self.output_index = output_index
        self.expected_outputs = self._expected(outputs, output_index)

    @staticmethod
    def _expected(values: list[Any], index: list[int]) -> tuple:
        avals: list[Any] = [None] * len(values)
        for i in index:
            avals[i] = jax.ShapeDtypeStruct(jnp.shape(values[i]), values[i].dtype)
        return tuple(avals)

    @staticmethod
    def pack(index: list[int], cts: list[Any], n: int) -> tuple:
        packed: list[Any] = [None] * n
        for i, ct in zip(index, cts):
            packed[i] = ct
        return tuple(packed)


class _OutputSide:
    def __init__(self, state: _CallState):
        self.state = state

    def differentiated(self) -> None:
        pass

    def transpose(self, cts: list[Any], vmap_levels: int) -> list[Any]:
        state = self.state
        new_cts, state.grad_outputs = vmapped(self._run, vmap_levels)(cts)
        state.grad_outputs_levels = vmap_levels
        return new_cts

    def _run(self, cts: list[Any]) -> tuple[list[Any], tuple]:
        state = self.state
        grad_outputs = state.pack(state.output_index, cts, len(state.expected_outputs))
        for pre_hook in state.pre_hooks():
            new = pre_hook(grad_outputs)
            if new is not None:
                if not isinstance(new, (tuple, list)):
                    new = (new,)
                expected = state.expected_outputs
                grad_outputs = check_grads(pre_hook, new, expected, "grad_output", state.owner)
        if not state.inputs_differentiated:
            # No input is differentiated, so the input side never runs: the hooks are
            # called from here with grad_input entries of None, as in PyTorch.
            grad_inputs = (None,) * len(state.expected_inputs)
            for hook in state.hooks():
                new = hook(grad_inputs, grad_outputs)
                if new is not None and any(g is not None for g in new):
                    raise ValueError(
                        f"hook {hook_name(hook)} of {state.owner} returned gradients for "
                        "inputs, but no input of the call is differentiated: it must "
                        "return None, or a tuple of None."
                    )
        return [grad_outputs[i] for i in state.output_index], grad_outputs


class _InputSide:
    def __init__(self, state: _CallState):
        self.state = state

    def differentiated(self) -> None:
        self.state.inputs_differentiated = True

    def transpose(self, cts: list[Any], vmap_levels: int) -> list[Any]:
        state = self.state
        if state.grad_outputs is None:
            # The gradient reached the inputs without passing through the outputs
            # (as in double backward): PyTorch calls no hook then.
            return cts
        if state.grad_outputs_levels != vmap_levels:
            raise ValueError(
                f"backward hooks of {state.owner}: the call's outputs are batched by "
                "jax.vmap but its array arguments are not. Batch an argument too "
                "(in_axes), or register the hooks outside the vmapped function."
            )
        grad_outputs, state.grad_outputs = state.grad_outputs, None
        return vmapped(self._run, vmap_levels)(cts, grad_outputs)

    def _run(self, cts: list[Any], grad_outputs: tuple) -> list[Any]:
        state = self.state
        grad_inputs = state.pack(state.input_index, cts, len(state.expected_inputs))
        for hook in state.hooks():
            new = hook(grad_inputs, grad_outputs)
            if new is not None:
                expected = state.expected_inputs
                grad_inputs = check_grads(hook, new, expected, "grad_input", state.owner)
        return [grad_inputs[i] for i in state.input_index]


def call_with_backward_hooks(
    fn: Callable,
    args: tuple,
    kwargs: dict[str, Any],
    pre_hooks: Callable[[], list[Callable]],
    hooks: Callable[[], list[Callable]],
    owner: str,
) -> Any:
    """Calls `fn(*args, **kwargs)` with backward pre-hooks and hooks around it.

    **Arguments:**

    - `pre_hooks`: returns the hooks `pre_hook(grad_outputs) -> tuple | None`.
    - `hooks`: returns the hooks `hook(grad_inputs, grad_outputs) -> tuple | None`.
    - `owner`: how errors name the node or module.

    Both lists are read when the backward pass is traced. `grad_inputs` has an entry
    per positional argument (`None` for a non-differentiable one); `grad_outputs`
    one per leaf of the output (`None` for a non-differentiable one).
    """
    args_list = list(args)
    input_index = [i for i, a in enumerate(args_list) if _is_differentiable(a)]
    state = _CallState(pre_hooks, hooks, owner, args_list, input_index)
    wrapped_inputs = bind([args_list[i] for i in input_index], _InputSide(state))
    for i, x in zip(input_index, wrapped_inputs):
        args_list[i] = x
    out = fn(*args_list, **kwargs)
    out_leaves, treedef = jax.tree.flatten(out)
    output_index = [i for i, x in enumerate(out_leaves) if _is_differentiable(x)]
    state.set_outputs(out_leaves, output_index)
    wrapped_outputs = bind([out_leaves[i] for i in output_index], _OutputSide(state))
    for i, x in zip(output_index, wrapped_outputs):
        out_leaves[i] = x
    return jax.tree.unflatten(treedef, out_leaves)

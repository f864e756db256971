"""Backward hooks around a whole call, built as PyTorch's `BackwardHook` is.

One identity wrapper on the call's array arguments and one on its outputs, both
instances of the primitive of `_primitive.py`. In the backward pass the output side
runs the pre-hooks on `grad_outputs` and keeps them; the input side then runs the
hooks on `(grad_inputs, grad_outputs)`. The call itself is differentiated by JAX as
usual, so idle wrappers cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._core import (
    BackwardRule,
    Batched,
    axes,
    bind,
    call_hook,
    check_grads,
    hook_name,
    is_inexact_array,
    per_example,
    run_chain,
)


class _CallState:
    """What the two sides of one call share: static, the same for every backward pass.

    In a backward pass the output side runs first (the input side needs the gradients
    that flow from the outputs through the call) and hands `grad_outputs` to the
    input side through `pending`, a stack that each pass empties again.
    """

    def __init__(
        self,
        pre_hooks: list[Callable],
        hooks: list[Callable],
        owner: str,
        inputs: list[Any],
        input_index: list[int],
        materialize: bool,
    ):
        self.materialize = materialize
        self.pre_hooks = pre_hooks
        self.hooks = hooks
        self.owner = owner
        self.input_index = input_index
        self.expected_inputs = self._expected(inputs, input_index)
        self.output_index: list[int] = []
        self.expected_outputs: tuple = ()
        self.pending: list[tuple] = []

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


class _OutputSide(BackwardRule):
    """Wraps the outputs and the input side's token, the last operand.

    The token is differentiated exactly when some input of the call is, so its
    linearity says whether the input side will run in this backward pass.
    """

    def __init__(self, state: _CallState):
        self.state = state

    def transpose(self, cts: list[Any], linear: list[bool], batched: Batched) -> list[Any]:
        state = self.state
        output_cts, token_linear = cts[:-1], linear[-1]
        if all(ct is None for ct in output_cts):
            return cts  # no gradient reaches the outputs: PyTorch calls no hook
        n = len(state.expected_outputs)
        levels = []
        for level in batched:
            out_axes = axes(level.mask[:-1])
            full: list[int | None] = [None] * n
            for i, a in zip(state.output_index, out_axes):
                full[i] = a
            levels.append(((out_axes,), (out_axes, tuple(full)), level.size))
        run = per_example(lambda c: self._run(c, token_linear), levels, state.owner)
        new_cts, grad_outputs = run(output_cts)
        if token_linear:
            state.pending.append((grad_outputs, batched))
        return [*new_cts, jnp.zeros((), jnp.float32) if token_linear else None]

    def _run(self, output_cts: list[Any], token_linear: bool) -> tuple[list[Any], tuple]:
        state = self.state
        grad_outputs = state.pack(state.output_index, output_cts, len(state.expected_outputs))
        grad_outputs = run_chain(
            state.pre_hooks, grad_outputs, call_hook, self._accept, where=f"of {state.owner}"
        )
        if not token_linear:
            # No input is differentiated, so the input side never runs: the hooks are
            # called from here with grad_input entries of None, as in PyTorch.
            grad_inputs = (None,) * len(state.expected_inputs)
            call = lambda hook, gi: call_hook(hook, gi, grad_outputs)  # noqa: E731
            run_chain(state.hooks, grad_inputs, call, self._refuse, where=f"of {state.owner}")
        return [grad_outputs[i] for i in state.output_index], grad_outputs

    def _accept(self, pre_hook: Callable, new: Any, grad_outputs: tuple) -> tuple:
        if not isinstance(new, (tuple, list)):
            new = (new,)
        state = self.state
        return check_grads(pre_hook, new, state.expected_outputs, "grad_output", state.owner)

    def _refuse(self, hook: Callable, new: Any, grad_inputs: tuple) -> tuple:
        if any(g is not None for g in new):
            raise ValueError(
                f"hook {hook_name(hook)} of {self.state.owner} returned gradients for "
                "inputs, but no input of the call is differentiated: it must "
                "return None, or a tuple of None."
            )
        return grad_inputs


class _InputSide(BackwardRule):
    """Wraps the call's differentiable arguments and makes the token, the last output."""

    token = True

    def __init__(self, state: _CallState):
        self.state = state

    def transpose(self, cts: list[Any], linear: list[bool], batched: Batched) -> list[Any]:
        state = self.state
        input_cts, token_ct = cts[:-1], cts[-1]
        if token_ct is None or not state.pending:
            # The gradient reached the inputs without passing through the outputs:
            # PyTorch calls no hook then.
            return [*input_cts, None]
        grad_outputs, out_batched = state.pending.pop()
        if len(out_batched) != len(batched):
            raise ValueError(
                f"backward hooks of {state.owner}: jax.vmap batches the call's outputs but "
                "none of its array arguments. Batch an argument too (in_axes), or "
                "register the hooks outside the vmapped function."
            )
        n = len(state.expected_outputs)
        levels = []
        for level, out_level in zip(batched, out_batched):
            in_axes = axes(level.mask[:-1])
            full: list[int | None] = [None] * n
            for i, a in zip(state.output_index, axes(out_level.mask[:-1])):
                full[i] = a
            levels.append(((in_axes, tuple(full)), in_axes, level.size))
        run = lambda c, go: self._run(c, linear[:-1], go)  # noqa: E731
        new_cts = per_example(run, levels, state.owner)(input_cts, grad_outputs)
        return [*new_cts, None]

    def _run(self, input_cts: list[Any], linear: list[bool], grad_outputs: tuple) -> list[Any]:
        # An argument that is not differentiated (`jax.lax.stop_gradient`, a constant)
        # is one that does not require grad in PyTorch, and one no gradient reaches has
        # an undefined gradient there: a module hook gets zeros for both (PyTorch's
        # BackwardHook materializes them), a node hook `None`. What a hook returns for
        # an argument that is not differentiated is dropped, as there.
        state = self.state
        if state.materialize:
            expected = [state.expected_inputs[i] for i in state.input_index]
            input_cts = [
                jnp.zeros(e.shape, e.dtype) if ct is None or not d else ct
                for ct, d, e in zip(input_cts, linear, expected)
            ]
        else:
            input_cts = [ct if d else None for ct, d in zip(input_cts, linear)]
        grad_inputs = state.pack(state.input_index, input_cts, len(state.expected_inputs))
        call = lambda hook, gi: call_hook(hook, gi, grad_outputs)  # noqa: E731
        grad_inputs = run_chain(
            state.hooks, grad_inputs, call, self._accept, where=f"of {state.owner}"
        )
        return [grad_inputs[i] if d else None for i, d in zip(state.input_index, linear)]

    def _accept(self, hook: Callable, new: Any, grad_inputs: tuple) -> tuple:
        state = self.state
        return check_grads(hook, new, state.expected_inputs, "grad_input", state.owner)


def call_with_backward_hooks(
    fn: Callable,
    args: tuple,
    kwargs: dict[str, Any],
    pre_hooks: list[Callable],
    hooks: list[Callable],
    owner: str,
    materialize_grads: bool = True,
) -> Any:
    """Calls `fn(*args, **kwargs)` with backward pre-hooks and hooks around it.

    **Arguments:**

    - `pre_hooks`: the hooks `pre_hook(grad_outputs) -> tuple | None`.
    - `hooks`: the hooks `hook(grad_inputs, grad_outputs) -> tuple | None`.
    - `owner`: how errors name the node or module.
    - `materialize_grads`: what `grad_inputs` holds, while some argument is
        differentiated, for one that is not or that no gradient reaches: zeros (True,
        PyTorch's module hooks) or `None` (False, PyTorch's autograd-node hooks).

    The hooks are those registered when the call is traced. `grad_inputs` has an
    entry per positional argument (`None` for a non-differentiable one);
    `grad_outputs` one per leaf of the output (`None` for a non-differentiable one).
    """
    args_list = list(args)
    input_index = [i for i, a in enumerate(args_list) if is_inexact_array(a)]
    state = _CallState(
        list(pre_hooks), list(hooks), owner, args_list, input_index, materialize_grads
    )
    token = jnp.zeros((), jnp.float32)
    *wrapped_inputs, token = bind([*(args_list[i] for i in input_index), token], _InputSide(state))
    for i, x in zip(input_index, wrapped_inputs):
        args_list[i] = x
    out = fn(*args_list, **kwargs)
    out_leaves, treedef = jax.tree.flatten(out)
    output_index = [i for i, x in enumerate(out_leaves) if is_inexact_array(x)]
    state.set_outputs(out_leaves, output_index)
    *wrapped_outputs, _ = bind([*(out_leaves[i] for i in output_index), token], _OutputSide(state))
    for i, x in zip(output_index, wrapped_outputs):
        out_leaves[i] = x
    return jax.tree.unflatten(treedef, out_leaves)

"""Value hooks: `register_hook`, `retain_grad` and `register_multi_grad_hook`."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp

from .._core import (
    BackwardRule,
    Batched,
    axes,
    bind,
    call_hook,
    check_callable,
    check_like,
    describe,
    guided,
    hook_name,
    is_inexact_array,
    per_example,
    run_chain,
)
from ._grad import current_context

T = TypeVar("T")


def _hooked_leaves(leaves: list[Any]) -> list[int]:
    """Which leaves a hook chain wraps: the floating ones (the others have no gradient)."""
    return [i for i, x in enumerate(leaves) if is_inexact_array(x)]


def _gradients(cts: list[Any], linear: list[bool], avals: list[Any]) -> list[Any]:
    """What hooks are told of each wrapped leaf: `None` where it is not differentiated
    (PyTorch's `requires_grad=False`), zeros where it is but no gradient reached it."""
    return [
        None if not differentiated else jnp.zeros(s.shape, s.dtype) if ct is None else ct
        for ct, differentiated, s in zip(cts, linear, avals)
    ]


def _accept_gradient(hook: Callable, new: Any, grad: Any) -> Any:
    return check_like(hook, new, grad, "gradient")


class _Chain(BackwardRule):
    """The hooks on one value, run in registration order in the backward pass.

    It is a parameter of the primitive, so it lives in cached jaxprs: it keeps no
    tracer (its output is held weakly, only to recognise the value in later calls).
    """

    def __init__(self, leaves: list[Any], treedef: Any):
        self.hooks: list[Callable] = []
        self.treedef = treedef
        self.index = _hooked_leaves(leaves)
        self.avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
        self.context: Any = None
        self.position: int | None = None
        self.outputs: list[weakref.ref] = []
        # (name, tag) for each `retain_grad` on this value inside a function staged out
        # within `jhooks.grad` (found in the jaxpr by `_harvest.Harvester`).
        self.retained: list[tuple[str, int]] = []  # pyright: ignore[reportIncompatibleVariableOverride]

    def owner(self) -> str:
        names = ", ".join(hook_name(h) for h in self.hooks)
        return f"value hook(s) {names}"

    def transpose(self, cts: list[Any], linear: list[bool], batched: Batched) -> list[Any]:
        if not self.hooks:
            return cts
        levels = [((axes(level.mask),), axes(level.mask), level.size) for level in batched]
        return per_example(lambda c: self._run(c, linear), levels, self.owner())(cts)

    def _run(self, cts: list[Any], linear: list[bool]) -> list[Any]:
        full: list[Any] = [None] * len(self.avals)
        avals = [self.avals[i] for i in self.index]
        for i, ct in zip(self.index, _gradients(cts, linear, avals)):
            full[i] = ct
        grad = jax.tree.unflatten(self.treedef, full)
        grad = run_chain(self.hooks, grad, call_hook, _accept_gradient, where=_where)
        leaves = jax.tree.leaves(grad, is_leaf=lambda x: x is None)
        return [leaves[i] if d else None for i, d in zip(self.index, linear)]


def _where(hook: Any) -> str:
    """Where a value hook runs, for guided errors: a run's backward hook registered as a
    value hook has its point's name."""
    name = getattr(hook, "name", None)
    if isinstance(name, str):
        return f"at hook point {name!r} (backward)"
    return "on a value's gradient (jhooks.register_hook)"


# The chain that produced a value, by the id of the value's first hooked leaf. The
# chain holds its outputs weakly, and an entry is trusted only while they are alive.
_chains: weakref.WeakValueDictionary[int, _Chain] = weakref.WeakValueDictionary()


def _chain_of(value: Any) -> _Chain | None:
    leaves, treedef = jax.tree.flatten(value)
    index = _hooked_leaves(leaves)
    chain = _chains.get(id(leaves[index[0]])) if index else None
    if chain is None or chain.treedef != treedef or chain.index != index:
        return None
    outputs = [ref() for ref in chain.outputs]
    if any(a is not leaves[i] for a, i in zip(outputs, index)):
        return None
    return chain


def _new_chain(value: Any, what: str) -> tuple[_Chain, Any]:
    leaves, treedef = jax.tree.flatten(value)
    leaves = [jnp.asarray(x) for x in leaves]
    chain = _Chain(leaves, treedef)
    if not chain.index:
        raise ValueError(
            f"cannot {what} {describe(value)}: it holds no floating-point array, so no "
            "gradient can reach it."
        )
    hooked = [leaves[i] for i in chain.index]
    context = current_context()
    if context is not None and context.at_base():
        chain.context = weakref.ref(context)
        chain.position = context.next_index()
        for name in context.plan.get(chain.position, ()):
            probe = jax.tree.leaves(context.probes[name])
            hooked = [x + p for x, p in zip(hooked, probe)]
    outputs = bind(hooked, chain)
    chain.outputs = [weakref.ref(x) for x in outputs]
    for i, x in zip(chain.index, outputs):
        leaves[i] = x
    _chains[id(outputs[0])] = chain
    return chain, jax.tree.unflatten(treedef, leaves)


def _chained(value: Any, what: str) -> tuple[_Chain, Any]:
    """The chain that made `value` and `value`, or a new chain and the value it wraps."""
    chain = _chain_of(value)
    return (chain, value) if chain is not None else _new_chain(value, what)


def register_hook(value: T, fn: Callable, *more_fns: Callable) -> T:
    """Registers backward hooks on a value: PyTorch's `y.register_hook(fn)`.

    **Arguments:**

    - `value`: an array, or a pytree of arrays, computed in the function being
        differentiated.
    - `fn`, `*more_fns`: hooks `fn(grad) -> grad | None`, run in this order in the
        backward pass. `grad` has `value`'s shape, dtype and pytree structure; a
        non-`None` return replaces it for the hooks after it and for everything
        upstream of `value`.

    **Returns:**

    `value`, unchanged. Use the returned value from then on: uses of the original
    made before the call are not hooked. Calling `register_hook` or `retain_grad`
    again on the returned value adds to the same chain.

    A hook is not called when no gradient reaches the value. In forward mode
    (`jax.jvp`, `jax.jacfwd`) hooks do nothing.

    **Example:**

    ```python
    def loss(x):
        y = jhooks.register_hook(jnp.sin(x), lambda g: jnp.clip(g, -1.0, 1.0))
        return jnp.sum(10 * y)

    jax.grad(loss)(x)  # cos(x), since the clipped gradient of y is 1
    ```
    """
    hooks = (fn, *more_fns)
    for hook in hooks:
        check_callable(hook)
    chain, value = _chained(value, "register a hook on")
    chain.hooks.extend(hooks)
    return value


def retain_grad(value: T, name: str) -> T:
    """Keeps the gradient of a value: PyTorch's `y.retain_grad()` and `y.grad`.

    **Arguments:**

    - `value`: an array or pytree of floating arrays, computed inside a function
        differentiated by [`jhooks.grad`][] or [`jhooks.value_and_grad`][].
    - `name`: the key of the gradient in the `retained` dict they return.

    **Returns:**

    `value`, unchanged. The retained gradient is the one after every hook registered
    on the value, before or after this call, as in PyTorch. Under plain `jax.grad`
    nothing is retained and this is the identity.

    It may be called inside `lax.scan` (or `lax.fori_loop` with Python int bounds):
    the gradient comes back stacked along a new leading axis of the scan's length,
    one per enclosing scan, outermost first. Inside `lax.cond` it is the gradient in
    the branch that ran (retain the name in every branch); inside a nested `jax.jit`
    or `jax.checkpoint`, as anywhere else. Inside `lax.while_loop` it raises a
    `ValueError` naming the value.

    **Example:**

    ```python
    def loss(x):
        y = jhooks.retain_grad(x * 3.0, "y")
        return jnp.sum(y**2)

    grads, retained = jhooks.grad(loss)(x)  # retained["y"] == 6 * x * 3

    def scanned(ws, x):
        def layer(h, w):
            return jhooks.retain_grad(jnp.tanh(h @ w), "h"), None

        return jnp.sum(jax.lax.scan(layer, x, ws)[0])

    grads, retained = jhooks.grad(scanned)(ws, x)  # retained["h"]: (len(ws), *x.shape)
    ```
    """
    if not isinstance(name, str):
        raise TypeError(f"retain_grad takes a string name, got {name!r}.")
    leaves = jax.tree.leaves(value)
    if not all(is_inexact_array(jnp.asarray(x)) for x in leaves):
        raise TypeError(
            f"retain_grad({name!r}) needs floating-point arrays, got {describe(value)}: "
            "only they have gradients."
        )
    chain, value = _chained(value, f"retain_grad({name!r}) on")
    context = current_context()
    if context is not None:
        if not context.at_base():
            # Inside lax.scan, jit, checkpoint, cond: the chain, a parameter of the
            # primitive in the staged jaxpr, names the value; jhooks.grad finds it there.
            if (name, context.tag) not in chain.retained:  # twice on one value: once
                chain.retained.append((name, context.tag))
            return value
        if chain.context is None or chain.context() is not context:
            raise ValueError(
                f"retain_grad({name!r}) was called on a value made outside the function "
                "being differentiated by jhooks.grad; call it where the value is computed."
            )
        if context.discovering:
            assert chain.position is not None  # numbered by the same context
            context.record(name, chain.position, value)
    return value


class _MultiGradHook(BackwardRule):
    """One hook over several values, called once per backward pass."""

    def __init__(
        self, fn: Callable, mode: str, treedefs: list[Any], avals: list[Any], index: list[int]
    ):
        self.fn = fn
        self.mode = mode
        self.treedefs = treedefs
        self.avals = avals
        self.index = index  # which leaves are wrapped: the floating ones

    def transpose(self, cts: list[Any], linear: list[bool], batched: Batched) -> list[Any]:
        levels = [((axes(level.mask),), None, level.size) for level in batched]
        owner = f"multi-grad hook {hook_name(self.fn)}"
        per_example(lambda c: self._run(c, linear), levels, owner)(cts)
        return cts

    def _run(self, cts: list[Any], linear: list[bool]) -> None:
        # A value gets a gradient when one of its leaves is differentiated and reached;
        # the hook is called when one value does, as PyTorch calls it when one of its
        # tensors is in the backward pass.
        full: list[Any] = [None] * len(self.avals)
        reached = [False] * len(self.avals)
        avals = [self.avals[i] for i in self.index]
        for i, ct, grad in zip(self.index, cts, _gradients(cts, linear, avals)):
            full[i], reached[i] = grad, ct is not None and grad is not None
        grads, start = [], 0
        for treedef in self.treedefs:
            stop = start + treedef.num_leaves
            part = full[start:stop] if any(reached[start:stop]) else None
            grads.append(None if part is None else jax.tree.unflatten(treedef, part))
            start = stop
        if all(g is None for g in grads):
            return
        given = tuple(grads) if self.mode == "all" else next(g for g in grads if g is not None)
        result = guided(call_hook, self.fn, given)
        if result is not None:
            raise ValueError(
                f"multi-grad hook {hook_name(self.fn)} returned {describe(result)}: "
                "multi-grad hooks observe gradients and must return None."
            )


def register_multi_grad_hook(
    values: Sequence[Any], fn: Callable, *, mode: Literal["all", "any"] = "all"
) -> Any:
    """One hook on several values: PyTorch's `torch.autograd.graph.register_multi_grad_hook`.

    **Arguments:**

    - `values`: a tuple or list of arrays (or pytrees of arrays).
    - `fn`: with `mode="all"`, `fn(grads)` is called once with a tuple holding the
        gradient of each value, `None` for a value no gradient reached; with
        `mode="any"`, `fn(grad)` is called once with the gradient of the first value
        (in the order given) that a gradient reached. It must return `None`.
    - `mode`: `"all"` or `"any"`.

    **Returns:**

    `values`, unchanged, in a container of the same type (a namedtuple stays one):
    use them from then on. Integer leaves have no gradient: their entries are `None`.

    **Example:**

    ```python
    a, b = jhooks.register_multi_grad_hook((a, b), jhooks.host(print))
    ```
    """
    check_callable(fn)
    if mode not in ("all", "any"):
        raise ValueError(
            f'register_multi_grad_hook for hook {hook_name(fn)}: mode must be "all" or '
            f'"any", got {mode!r}.'
        )
    if not isinstance(values, (tuple, list)):
        raise TypeError(
            f"register_multi_grad_hook for hook {hook_name(fn)} takes a tuple or list of "
            f"values, got {describe(values)} of type {type(values).__name__}. Pass a "
            "single value as `(value,)`; for a dict, pass `tuple(d.values())`."
        )
    flat = [jax.tree.flatten(v) for v in values]
    leaves = [jnp.asarray(x) for leaves, _ in flat for x in leaves]
    index = _hooked_leaves(leaves)
    if not index:
        raise ValueError(
            f"register_multi_grad_hook for hook {hook_name(fn)}: {describe(tuple(values))} "
            "holds no floating-point array, so no gradient can reach it."
        )
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    treedefs = [treedef for _, treedef in flat]
    rule = _MultiGradHook(fn, mode, treedefs, avals, index)
    for i, x in zip(index, bind([leaves[i] for i in index], rule)):
        leaves[i] = x
    it = iter(leaves)
    results = [jax.tree.unflatten(td, [next(it) for _ in range(td.num_leaves)]) for td in treedefs]
    if hasattr(values, "_fields"):  # a namedtuple
        return type(values)(*results)
    return type(values)(results)

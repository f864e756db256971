"""Value hooks: `register_hook`, `retain_grad` and `register_multi_grad_hook`."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp

from ._checks import check_callable, check_like, describe, hook_name
from ._grad import current_context
from ._primitive import bind, vmapped

T = TypeVar("T")


def _zeros_for(cts: list[Any], like: list[Any]) -> list[Any]:
    return [jnp.zeros(s.shape, s.dtype) if ct is None else ct for ct, s in zip(cts, like)]


class _Chain:
    """The hooks on one value, run in registration order in the backward pass."""

    def __init__(self, leaves: list[Any], treedef: Any):
        self.hooks: list[Callable] = []
        self.treedef = treedef
        self.avals = [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in leaves]
        self.context: Any = None
        self.index: int | None = None
        self.output: Any = None
        self.output_leaves: list[Any] = []

    def differentiated(self) -> None:
        pass

    def transpose(self, cts: list[Any], vmap_levels: int) -> list[Any]:
        if not self.hooks:
            return cts
        return vmapped(self._run, vmap_levels)(cts)

    def _run(self, cts: list[Any]) -> list[Any]:
        grad = jax.tree.unflatten(self.treedef, _zeros_for(cts, self.avals))
        for hook in self.hooks:
            new = hook(grad)
            if new is not None:
                check_like(hook, new, grad, "gradient")
                grad = new
        return jax.tree.leaves(grad)


# The chain that produced a value, by the id of the value's first leaf. A chain holds
# its output leaves, so an id here cannot be reused while its entry lives; the entry
# lives as long as the traced program that holds the chain.
_chains: weakref.WeakValueDictionary[int, _Chain] = weakref.WeakValueDictionary()


def _chain_of(value: Any) -> _Chain | None:
    leaves, treedef = jax.tree.flatten(value)
    chain = _chains.get(id(leaves[0])) if leaves else None
    if (
        chain is None
        or chain.treedef != treedef
        or len(chain.output_leaves) != len(leaves)
        or any(a is not b for a, b in zip(chain.output_leaves, leaves))
    ):
        return None
    return chain


def _new_chain(value: Any) -> _Chain:
    leaves, treedef = jax.tree.flatten(value)
    if not leaves:
        raise ValueError(f"cannot hook {value!r}: it holds no arrays.")
    leaves = [jnp.asarray(x) for x in leaves]
    chain = _Chain(leaves, treedef)
    context = current_context()
    if context is not None and context.at_base():
        chain.context = weakref.ref(context)
        chain.index = context.next_index()
        for name in context.plan.get(chain.index, ()):
            probe = jax.tree.leaves(context.probes[name])
            leaves = [x + p for x, p in zip(leaves, probe)]
    chain.output_leaves = bind(leaves, chain)
    chain.output = jax.tree.unflatten(treedef, chain.output_leaves)
    _chains[id(chain.output_leaves[0])] = chain
    return chain


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
    chain = _chain_of(value) or _new_chain(value)
    chain.hooks.extend(hooks)
    return chain.output


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

    **Example:**

    ```python
    def loss(x):
        y = jhooks.retain_grad(x * 3.0, "y")
        return jnp.sum(y**2)

    grads, retained = jhooks.grad(loss)(x)  # retained["y"] == 6 * x * 3
    ```
    """
    if not isinstance(name, str):
        raise TypeError(f"retain_grad takes a string name, got {name!r}.")
    leaves = jax.tree.leaves(value)
    if not all(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves):
        raise TypeError(
            f"retain_grad({name!r}) needs floating-point arrays, got {describe(value)}: "
            "only they have gradients."
        )
    chain = _chain_of(value) or _new_chain(value)
    context = current_context()
    if context is not None:
        if not context.at_base():
            raise ValueError(
                f"retain_grad({name!r}) was called inside a function that JAX stages out "
                "within the function differentiated by jhooks.grad (jax.jit, lax.scan, "
                "jax.checkpoint, lax.cond, ...). Gradients are retained only at the "
                "function's own level (vmap is fine): call retain_grad on that function's "
                "output instead."
            )
        if chain.context is None or chain.context() is not context:
            raise ValueError(
                f"retain_grad({name!r}) was called on a value made outside the function "
                "being differentiated by jhooks.grad; call it where the value is computed."
            )
        if context.discovering:
            context.record(name, chain.index, chain.output)
    return chain.output


class _MultiGradHook:
    """One hook over several values, called once per backward pass."""

    def __init__(self, fn: Callable, mode: str, treedefs: list[Any], avals: list[Any]):
        self.fn = fn
        self.mode = mode
        self.treedefs = treedefs
        self.avals = avals

    def differentiated(self) -> None:
        pass

    def transpose(self, cts: list[Any], vmap_levels: int) -> list[Any]:
        vmapped(self._run, vmap_levels)(cts)
        return cts

    def _run(self, cts: list[Any]) -> None:
        grads, start = [], 0
        for treedef in self.treedefs:
            stop = start + treedef.num_leaves
            part = cts[start:stop]
            if all(ct is None for ct in part):
                grads.append(None)
            else:
                filled = _zeros_for(part, self.avals[start:stop])
                grads.append(jax.tree.unflatten(treedef, filled))
            start = stop
        if self.mode == "all":
            result = self.fn(tuple(grads))
        else:
            result = self.fn(next(g for g in grads if g is not None))
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

    `values`, unchanged, in a container of the same type: use them from then on.

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
    values_seq = list(values)
    flat = [jax.tree.flatten(v) for v in values_seq]
    leaves = [jnp.asarray(x) for leaves, _ in flat for x in leaves]
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    treedefs = [treedef for _, treedef in flat]
    out = iter(bind(leaves, _MultiGradHook(fn, mode, treedefs, avals)))
    results = [jax.tree.unflatten(td, [next(out) for _ in range(td.num_leaves)]) for td in treedefs]
    return type(values)(results) if isinstance(values, (tuple, list)) else tuple(results)

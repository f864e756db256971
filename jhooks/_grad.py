"""`jhooks.grad` and `jhooks.value_and_grad`: JAX's, plus the gradients `retain_grad` asked for.

A retained gradient reaches the caller through a zero "probe" added to the value
just before its hook chain: the gradient with respect to the probe is the gradient
after every hook of the chain. Where the probes go is found by tracing the function
once abstractly first (`jax.eval_shape`), since `retain_grad` may be called on a value
after hooks were put on it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import partial_eval as pe

from ._checks import check_callable

_local = threading.local()


class RetainContext:
    """The state of one `jhooks.grad` call: numbers hook chains, records or places probes."""

    def __init__(self, plan: dict[int, list[str]] | None):
        self.discovering = plan is None
        self.plan = plan or {}
        self.probes: dict[str, Any] = {}
        self.shapes: dict[str, tuple[int, Any]] = {}
        self._count = 0
        self._base: Any = None

    def at_base(self) -> bool:
        """Whether JAX is tracing the differentiated function itself, possibly under
        `vmap` or `grad`, rather than a function nested in it that JAX stages out and
        may cache (`jit`, `scan`, `checkpoint`, `cond`...). Chains are numbered, and
        retained, only at this level, so caches of nested functions cannot make the
        two passes number them differently."""
        trace = core.trace_ctx.trace
        while trace is not self._base:
            if trace is None or isinstance(trace, pe.DynamicJaxprTrace):
                return False
            trace = getattr(trace, "parent_trace", None)
        return True

    def next_index(self) -> int:
        self._count += 1
        return self._count

    def record(self, name: str, index: int, value: Any) -> None:
        if name in self.shapes:
            raise ValueError(
                f"retain_grad name {name!r} is used twice in one differentiated function; "
                "give every retained value its own name."
            )
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), value)
        self.shapes[name] = (index, shapes)

    def __enter__(self) -> RetainContext:
        # Entered inside the traced function: the trace now current is the base level.
        self._base = core.trace_ctx.trace
        _local.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _local.stack.pop()


def current_context() -> RetainContext | None:
    """The innermost `jhooks.grad` call being traced, if any."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def value_and_grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, dict[str, Any]]]:
    """Like `jax.value_and_grad`, and also returns the gradients retained by `retain_grad`.

    **Arguments:**

    - `fun`: the function to differentiate. It returns a scalar, or `(scalar, aux)`
        when `has_aux=True`.
    - `argnums`: which positional arguments to differentiate, as in `jax.grad`.
    - `has_aux`: whether `fun` returns `(scalar, aux)`.

    **Returns:**

    A function returning `(value, grads, retained)`, where `value` is `fun`'s output
    (`(out, aux)` when `has_aux`), `grads` the gradients with respect to `argnums`, and
    `retained` a dict from each name given to `retain_grad` to the gradient of the
    output with respect to that value, after every hook registered on it.

    **Example:**

    ```python
    def loss(x):
        h = jhooks.retain_grad(jnp.tanh(x), "h")
        return jnp.sum(h**2)

    value, grads, retained = jhooks.value_and_grad(loss)(x)
    retained["h"]  # 2 * tanh(x), what `h.grad` gives in PyTorch
    ```
    """
    check_callable(fun, "the function passed to jhooks.value_and_grad")
    argnum_tuple = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def value_and_grad_fun(*args: Any, **kwargs: Any) -> tuple[Any, Any, dict[str, Any]]:
        discovery = RetainContext(plan=None)

        def discover(*args: Any) -> Any:
            with discovery:
                return fun(*args, **kwargs)

        jax.eval_shape(discover, *args)
        plan: dict[int, list[str]] = {}
        for name, (index, _) in discovery.shapes.items():
            plan.setdefault(index, []).append(name)
        probes = {
            name: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            for name, (_, shapes) in discovery.shapes.items()
        }

        def with_probes(probes: dict[str, Any], *args: Any) -> Any:
            with RetainContext(plan) as context:
                context.probes = probes
                return fun(*args, **kwargs)

        shifted = (0, *(n + 1 for n in argnum_tuple))
        value, (retained, *grads) = jax.value_and_grad(with_probes, shifted, has_aux=has_aux)(
            probes, *args
        )
        return value, grads[0] if isinstance(argnums, int) else tuple(grads), retained

    return value_and_grad_fun


def grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """Like `jax.grad`, and also returns the gradients retained by `retain_grad`.

    **Arguments:** as for [`jhooks.value_and_grad`][].

    **Returns:**

    A function returning `(grads, retained)`: `grads` is what `jax.grad` returns
    (`(grads, aux)` when `has_aux=True`) and `retained` the dict of retained gradients.

    **Example:**

    ```python
    grads, retained = jhooks.grad(loss)(x)
    ```
    """
    value_and_grad_fun = value_and_grad(fun, argnums, has_aux)

    @functools.wraps(fun)
    def grad_fun(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        value, grads, retained = value_and_grad_fun(*args, **kwargs)
        if has_aux:
            return (grads, value[1]), retained
        return grads, retained

    return grad_fun

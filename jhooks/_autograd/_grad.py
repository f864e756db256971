"""`jhooks.grad` and `jhooks.value_and_grad`: JAX's, plus the gradients `retain_grad` asked for.

A retained gradient reaches the caller through a zero "probe" added to the value
just before its hook chain: the gradient with respect to the probe is the gradient
after every hook of the chain. Where the probes go is found by tracing the function
once abstractly first (`jax.make_jaxpr`), since `retain_grad` may be called on a value
after hooks were put on it. Values retained inside `lax.scan`, `lax.cond`, nested
`jax.jit` or `jax.checkpoint` are found in that jaxpr, and then the function is
differentiated through `_harvest.Harvester` (see `_grad_loops`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import (
    Emitted,
    ThreadStack,
    check_callable,
    collecting,
    current_trace,
    reaches,
    retaining_key,
    zero_probe,
)
from ._grad_loops import (
    mark_emit,
    may_hold_staged_emits,
    nested_retains,
    value_and_grad_harvested,
    with_staged_emits,
)

_grads: ThreadStack[RetainContext] = ThreadStack("jhooks.grad calls being traced")

# The tag of the `jhooks.grad` call being traced is part of the cache key of the
# functions JAX stages out (jit, scan...): `retaining_key`, in `_core._handles` with
# the rest of the jit key. One traced there, whose chains `retain_grad` names (see
# `_grad_loops`), is never reused outside such a call, nor the reverse.
_retaining = retaining_key


class RetainContext:
    """The state of one `jhooks.grad` call: numbers hook chains, records or places probes."""

    def __init__(self, plan: dict[int, list[str]] | None, tag: int = -1):
        self.discovering = plan is None
        self.tag = tag  # names this call's retains inside staged functions
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
        return reaches(self._base)

    def next_index(self) -> int:
        self._count += 1
        return self._count

    def record(self, name: str, index: int, value: Any) -> None:
        if name in self.shapes and self.shapes[name][0] == index:
            return  # the same value retained twice under one name: PyTorch allows it
        if name in self.shapes:
            raise ValueError(
                f"retain_grad name {name!r} is used twice in one differentiated function; "
                "give every retained value its own name."
            )
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), value)
        self.shapes[name] = (index, shapes)

    def __enter__(self) -> RetainContext:
        # Entered inside the traced function: the trace now current is the base level.
        self._base = current_trace()
        _grads.push(self)
        self._scope = _retaining(self.tag)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._scope.__exit__(*exc_info)
        _grads.pop()


def current_context() -> RetainContext | None:
    """The innermost `jhooks.grad` call being traced, if any."""
    return _grads.top()


def _is_differentiable_leaf(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)) or hasattr(
        leaf, "__jax_array__"
    )


def check_differentiable(caller: str, fun: Callable, args: tuple, positions: list[int]) -> None:
    """Raises a `TypeError` pointing to `jhooks.filter_grad` when a differentiated
    argument holds a leaf that is not an array (an Equinox model's activation function)."""
    for n in positions:
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[n])[0]:
            if not _is_differentiable_leaf(leaf):
                where = jax.tree_util.keystr(path) or "itself"
                raise TypeError(
                    f"{caller} of {getattr(fun, '__qualname__', fun)!r}: argument {n} holds "
                    f"a {type(leaf).__name__} at {where}, which is not an array and cannot be "
                    "differentiated. An Equinox model holds functions and other non-arrays: "
                    "use jhooks.filter_grad or jhooks.filter_value_and_grad (Equinox's "
                    "eqx.filter_grad convention: the inexact arrays of the first argument are "
                    "differentiated, everything else passed through)."
                )


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> Callable[..., tuple[Any, Any, dict[str, Any]]]:
    """Like `jax.value_and_grad`, and also returns the gradients retained by `retain_grad`.

    **Arguments:**

    - `fun`: the function to differentiate. It returns a scalar, or `(scalar, aux)`
        when `has_aux=True`.
    - `argnums`, `has_aux`, `holomorphic`, `allow_int`: as for `jax.value_and_grad`.

    **Returns:**

    A function returning `(value, grads, retained)`, where `value` is `fun`'s output
    (`(out, aux)` when `has_aux`), `grads` the gradients with respect to `argnums`, and
    `retained` a dict from each name given to `retain_grad` to the gradient of the
    output with respect to that value, after every hook registered on it, and from
    each name given to [`jhooks.emit`][] in a backward hook to the value emitted. A
    value retained inside `lax.scan` comes back stacked along the scan's axis (one per
    enclosing scan, outermost first); see [`jhooks.retain_grad`][].

    Arguments that are not differentiated may be anything `jax.grad` accepts (Python
    numbers used as indices, strings, modules holding functions). A differentiated
    argument must hold only arrays (and numbers): one holding anything else, such as an
    Equinox model's activation function, raises a `TypeError` pointing to
    [`jhooks.filter_value_and_grad`][], which takes Equinox models.

    **Example:**

    ```python
    def loss(x):
        h = jhooks.retain_grad(jnp.tanh(x), "h")
        return jnp.sum(h**2)

    value, grads, retained = jhooks.value_and_grad(loss)(x)
    retained["h"]  # 2 * tanh(x), what `h.grad` gives in PyTorch
    ```
    """
    return make_value_and_grad(
        fun, argnums, has_aux, holomorphic, allow_int, "jhooks.value_and_grad"
    )


def make_value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int],
    has_aux: bool,
    holomorphic: bool,
    allow_int: bool,
    caller: str,
) -> Callable[..., tuple[Any, Any, dict[str, Any]]]:
    """`value_and_grad`, with errors that name `caller` (`jhooks.filter_grad`...)."""
    check_callable(fun, f"the function passed to {caller}")
    argnum_tuple = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def value_and_grad_fun(*args: Any, **kwargs: Any) -> tuple[Any, Any, dict[str, Any]]:
        for n in argnum_tuple:
            if not -len(args) <= n < len(args):
                raise ValueError(
                    f"{caller} of {getattr(fun, '__qualname__', fun)!r}: argnums "
                    f"{argnums} asks for argument {n}, but it was called with {len(args)} "
                    "positional arguments."
                )
        positions = [n % len(args) for n in argnum_tuple]
        check_differentiable(caller, fun, args, positions)
        tag = -1 - len(_grads)
        staged: list[str] = []  # names emitted in staged backward passes

        def run(*args: Any) -> tuple[Any, Any, dict[str, Any]]:
            with collecting(Emitted(current_trace(), mark_emit(tag))) as emitted:
                value, grads, retained = _value_and_grad(
                    args, positions, tag, fun, kwargs, options, staged
                )
            emitted.merge_into(retained, "a gradient kept by retain_grad")
            staged.extend(emitted.staged)
            return value, grads, retained

        options: dict[str, Any] = dict(
            has_aux=has_aux, holomorphic=holomorphic, allow_int=allow_int
        )
        value, grads, retained = run(*args)
        if staged:
            # Values emitted in backward passes that JAX stages out: reaped from the jaxpr.
            value, grads, retained = with_staged_emits(run, args, tag)
        return value, grads[0] if isinstance(argnums, int) else tuple(grads), retained

    return value_and_grad_fun


def _value_and_grad(
    args: tuple,
    positions: list[int],
    tag: int,
    fun: Callable,
    kwargs: dict,
    options: dict,
    staged: list[str],
) -> tuple[Any, list[Any], dict[str, Any]]:
    """`jax.value_and_grad` of `fun` at `positions`, with the retained gradients; adds to
    `staged` when values emitted in staged backward passes must be looked for."""
    discovery = RetainContext(plan=None, tag=tag)

    def call(context: RetainContext, differentiated: tuple) -> Any:
        # Only the differentiated arguments are abstract here, as in jax.grad; the
        # others (indices, strings, functions) are used as they are.
        call_args = list(args)
        for n, a in zip(positions, differentiated):
            call_args[n] = a
        with context:
            return fun(*call_args, **kwargs)

    def discover(*differentiated: Any) -> None:
        call(discovery, differentiated)

    # Also finds the values retained inside staged functions (scan, jit, cond...).
    nested, hooks_staged = nested_retains(discover, tuple(args[n] for n in positions), tag)
    if hooks_staged and may_hold_staged_emits(tag):
        staged.append("")  # a cached backward pass may hold emit marks: look for them
    plan: dict[int, list[str]] = {}
    for name, (index, _) in discovery.shapes.items():
        plan.setdefault(index, []).append(name)
    probes = {
        name: jax.tree.map(zero_probe, shapes) for name, (_, shapes) in discovery.shapes.items()
    }

    def with_probes(probes: dict[str, Any], *args: Any) -> Any:
        with RetainContext(plan, tag) as context:
            context.probes = probes
            return fun(*args, **kwargs)

    def probed(probes: dict[str, Any], differentiated: tuple) -> Any:
        context = RetainContext(plan, tag)
        context.probes = probes
        return call(context, differentiated)

    if nested:
        return value_and_grad_harvested(
            probed, probes, tuple(args[n] for n in positions), tag, **options
        )
    shifted = (0, *(n + 1 for n in positions))
    value, (retained, *grads) = jax.value_and_grad(with_probes, shifted, **options)(probes, *args)
    return value, grads, retained


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
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
    value_and_grad_fun = make_value_and_grad(
        fun, argnums, has_aux, holomorphic, allow_int, "jhooks.grad"
    )

    return grad_of(value_and_grad_fun, fun, has_aux)


def grad_of(
    value_and_grad_fun: Callable[..., tuple[Any, Any, dict[str, Any]]], fun: Callable, has_aux: bool
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """The `grad` form of a `value_and_grad` function: `(grads, retained)`, or
    `((grads, aux), retained)` with `has_aux`."""

    @functools.wraps(fun)
    def grad_fun(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        value, grads, retained = value_and_grad_fun(*args, **kwargs)
        if has_aux:
            return (grads, value[1]), retained
        return grads, retained

    return grad_fun

"""`jhooks.filter_grad` and `jhooks.filter_value_and_grad`: Equinox's convention.

As `eqx.filter_grad` and `eqx.filter_value_and_grad`: the inexact arrays of the
first argument (an Equinox model) are differentiated, everything else in it (ints,
functions, static fields) and every other argument is passed through. Built on
`jhooks.value_and_grad`, so the gradients that `retain_grad` keeps and the values
that `emit` sends come back too, in the same place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, overload

import equinox as eqx

from ._grad import grad_of, make_value_and_grad


def _filtered(fun: Callable, has_aux: bool, caller: str) -> Callable:
    """`(x, *args, **kwargs) -> (value, grads, retained)` with `x` split by
    `eqx.is_inexact_array` and only the inexact part differentiated."""

    def split_call(diff: Any, nondiff: Any, *args: Any, **kwargs: Any) -> Any:
        return fun(eqx.combine(diff, nondiff), *args, **kwargs)

    split_call.__qualname__ = getattr(fun, "__qualname__", repr(fun))
    differentiated = make_value_and_grad(split_call, 0, has_aux, False, False, caller)

    @functools.wraps(fun)
    def filtered(*args: Any, **kwargs: Any) -> tuple[Any, Any, dict[str, Any]]:
        if not args:
            raise TypeError(
                f"{caller} of {getattr(fun, '__qualname__', fun)!r}: the first argument (the "
                "one differentiated, as in Equinox) must be passed positionally."
            )
        diff, nondiff = eqx.partition(args[0], eqx.is_inexact_array)
        return differentiated(diff, nondiff, *args[1:], **kwargs)

    return filtered


@overload
def filter_value_and_grad(
    fun: Callable, *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, dict[str, Any]]]: ...


@overload
def filter_value_and_grad(
    fun: None = None, *, has_aux: bool = False
) -> Callable[[Callable], Callable[..., tuple[Any, Any, dict[str, Any]]]]: ...


def filter_value_and_grad(
    fun: Callable | None = None, *, has_aux: bool = False
) -> (
    Callable[..., tuple[Any, Any, dict[str, Any]]]
    | Callable[[Callable], Callable[..., tuple[Any, Any, dict[str, Any]]]]
):
    """`eqx.filter_value_and_grad` that also returns the gradients `retain_grad` kept.

    **Arguments:**

    - `fun`: the function to differentiate, `fun(model, *args, **kwargs)`. It returns
        a scalar, or `(scalar, aux)` when `has_aux=True`. Its first argument is
        differentiated with respect to its inexact (floating or complex) arrays;
        everything else in it and every other argument is passed through, as Equinox
        does. As a decorator: `@jhooks.filter_value_and_grad` or
        `@jhooks.filter_value_and_grad(has_aux=True)`.
    - `has_aux`: as for `eqx.filter_value_and_grad`.

    **Returns:**

    A function returning `(value, grads, retained)`, as [`jhooks.value_and_grad`][]:
    `value` is `fun`'s output (`(loss, aux)` when `has_aux`), `grads` what
    `eqx.filter_value_and_grad` returns as gradients (the first argument's structure,
    `None` where a leaf is not an inexact array), and `retained` the dict of the
    gradients kept by [`jhooks.retain_grad`][] and the values sent by
    [`jhooks.emit`][]. Equinox's `(value, grads)` is the first two.

    **Example:**

    ```python
    model = jhooks.hookable(eqx.nn.MLP(2, 2, 8, 2, key=key))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads, retained = jhooks.filter_value_and_grad(loss_fn)(model, x, y)
    model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
    ```
    """
    if fun is None:
        return functools.partial(filter_value_and_grad, has_aux=has_aux)
    return _filtered(fun, has_aux, "jhooks.filter_value_and_grad")


@overload
def filter_grad(
    fun: Callable, *, has_aux: bool = False
) -> Callable[..., tuple[Any, dict[str, Any]]]: ...


@overload
def filter_grad(
    fun: None = None, *, has_aux: bool = False
) -> Callable[[Callable], Callable[..., tuple[Any, dict[str, Any]]]]: ...


def filter_grad(
    fun: Callable | None = None, *, has_aux: bool = False
) -> (
    Callable[..., tuple[Any, dict[str, Any]]]
    | Callable[[Callable], Callable[..., tuple[Any, dict[str, Any]]]]
):
    """`eqx.filter_grad` that also returns the gradients `retain_grad` kept.

    **Arguments:** as for [`jhooks.filter_value_and_grad`][].

    **Returns:**

    A function returning `(grads, retained)`, as [`jhooks.grad`][]: `grads` is what
    `eqx.filter_grad` returns (`(grads, aux)` when `has_aux=True`) and `retained` the
    dict of retained gradients and emitted values.

    **Example:**

    ```python
    grads, retained = jhooks.filter_grad(loss_fn)(model, x, y)
    grads.layers[0].weight  # as eqx.filter_grad(loss_fn)(model, x, y).layers[0].weight
    ```
    """
    if fun is None:
        return functools.partial(filter_grad, has_aux=has_aux)
    value_and_grad_fun = _filtered(fun, has_aux, "jhooks.filter_grad")

    return grad_of(value_and_grad_fun, fun, has_aux)

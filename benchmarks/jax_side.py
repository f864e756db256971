"""The jhooks side of a benchmark: the jitted optax step and each hooked variant of a model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import optax

import jhooks

from . import hooks as H
from .models import Case


def make_jax_step(loss_fn: Callable, optim: optax.GradientTransformation) -> Callable:
    @eqx.filter_jit
    def step(batch: tuple, model: Any, opt_state: Any) -> tuple:
        x, y = batch
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        return loss, eqx.apply_updates(model, updates), opt_state

    return step


def jax_variant(case: Case, flavor: str, hooks: str) -> tuple[Any, Callable, list]:
    """`(model, loss_fn, handles)` for one variant of `case`."""
    if flavor == "plain":
        model = case.eqx_model()
        return model, lambda m, x, y: case.jax_loss(m(x), y), []
    if flavor == "value":
        model = case.eqx_model()
        if hooks == "host":

            def loss_fn(m: Any, x: Any, y: Any) -> Any:
                return case.jax_loss(jhooks.register_hook(m(x), H.log_grad_norm), y)

            return model, loss_fn, []
        tap = H.value_tap(hooks)
        return model, lambda m, x, y: case.jax_loss(m(x, tap), y), []
    net = jhooks.hookable(case.eqx_model())  # type: ignore[attr-defined]
    handles = H.install_module_hooks(net, hooks)
    return net, lambda m, x, y: case.jax_loss(m(x), y), handles

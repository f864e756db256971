"""Edge attribution (EAP, EAP-IG) between the writers and the readers of the residual stream.

The residual stream at a reader is the sum of what the writers before it wrote, so the
edge `u -> v` is scored as `(clean_u - corrupt_u) . dmetric/d(input of v)`, summed over
positions: Syed et al.'s EAP, with the gradient integrated along the path for EAP-IG
(Hanna et al.). Writer values are `[position, *writer_axes, d_model]` and reader values
`[position, *reader_axes, d_model]` (an axis of heads, say); the score of an edge is
`[*writer_axes, *reader_axes]`. Each writer's difference is contracted against each
reader's gradient on its own, so no `[position, writers, d_model]` tensor is built.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._runs import Selector
from ._caches import activations, difference, names_filter, with_gradients
from ._layers import refuse_looped_edges
from ._nodes import along_path
from ._plan import Plan


def edge_scores(plan: Plan, objective: Callable, fn: Callable, clean: Any, corrupt: Any) -> dict:
    """`{(writer, reader): score}` for each writer reached before the reader."""
    extra = [plan.interpolate] if plan.interpolate else []
    writers, readers = Selector(plan.writers, "writers"), Selector(plan.readers, "readers")
    select = names_filter(_as_list(plan.writers) + _as_list(plan.readers), extra)
    if callable(plan.writers) or callable(plan.readers):
        select = names_filter(lambda n: writers(n) or readers(n), extra)
    refuse_looped_edges(fn, corrupt, select, writers, readers)
    clean_values = activations(fn, clean, select)
    if plan.method == "ig":
        values = activations(fn, corrupt, select)
        order = list(values)
        if plan.interpolate is None:
            first = next((n for n in order if writers(n)), None)
            plan = _with_interpolate(plan, first)
        reading = [n for n in order if readers(n)]
        grads = along_path(plan, objective, corrupt, select, clean_values, values, reading)
    else:
        _, values, grads = with_gradients(objective, corrupt, select)
        order = list(values)
    scores = {}
    for i, v in enumerate(order):
        if not readers(v):
            continue
        for u in order[:i]:
            if writers(u) and u != v:
                delta = difference(clean_values[u], values[u], u)
                scores[(u, v)] = edge(delta, grads[v], u, v)
    return scores


def _as_list(spec: Any) -> list:
    if callable(spec):
        return []
    return [spec] if isinstance(spec, str) else list(spec)


def _with_interpolate(plan: Plan, point: str | None) -> Plan:
    if point is None:
        raise ValueError("attribution(edges=True, method='ig'): no writer was reached.")
    return dataclasses.replace(plan, interpolate=point)


def edge(delta: Any, grad: Any, writer: str, reader: str) -> jax.Array:
    """`sum over position and d_model of delta[p, *a, d] * grad[p, *b, d]`: `[*a, *b]`."""
    if not (isinstance(delta, jax.Array) and isinstance(grad, jax.Array)):
        raise TypeError(
            f"attribution(edges=True): writer {writer!r} and reader {reader!r} must hold "
            "one floating-point array each."
        )
    if delta.ndim < 1 or grad.ndim < 1 or delta.shape[-1] != grad.shape[-1]:
        raise ValueError(_shapes(writer, delta, reader, grad))
    if delta.ndim == 1 or grad.ndim == 1:
        if delta.ndim != grad.ndim:
            raise ValueError(_shapes(writer, delta, reader, grad))
        return jnp.dot(delta, grad)
    if delta.shape[0] != grad.shape[0]:
        raise ValueError(_shapes(writer, delta, reader, grad))
    letters = iter(string.ascii_letters[2:])
    a = "".join(next(letters) for _ in range(delta.ndim - 2))
    b = "".join(next(letters) for _ in range(grad.ndim - 2))
    return jnp.einsum(f"p{a}z,p{b}z->{a}{b}", delta, grad)


def _shapes(writer: str, delta: jax.Array, reader: str, grad: jax.Array) -> str:
    return (
        f"attribution(edges=True): writer {writer!r} holds {tuple(delta.shape)} and reader "
        f"{reader!r} {tuple(grad.shape)}; expected [position, ..., d_model] for both, with "
        "the same positions and d_model (or [d_model] for both)."
    )

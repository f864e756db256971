"""The main thread waits for a program whose hooks run on values, forward and backward.

A hook on values runs inside a host callback, on an XLA thread, while the program that
calls it is executing. Its Python may compute with JAX (`float(g.mean())`,
`jnp.linalg.norm(g)`, `np.asarray` of an array a hook kept): each is one more XLA
execution on the CPU device, enqueued from the callback. XLA's CPU client runs a
device's executions in the order they were enqueued, and lets at most 32 be enqueued
at once (its in-flight limit, a semaphore, taken before an execution is enqueued).
Had the main thread gone on dispatching after the program (a training loop: `jax.grad`
returns without waiting, the next step is dispatched), 32 executions would queue behind
the program, which waits for its callback, which waits for a free slot: a deadlock
(both threads in `xla::Semaphore::Acquire`).

So the main thread waits for such a program before it goes on: for the forward, on
the run's outputs (`wait_for`: under a differentiation, on the concrete values under
its tracers); for the backward pass, each differentiated argument of the program
passes through `waiting`, an identity whose backward rule the backward pass runs on the
main thread after the program's backward was dispatched: the cotangent it receives is
an output of that backward, and it waits for it, so the backward's host calls have
returned before the backward pass goes on.
"""

from __future__ import annotations

from typing import Any

import jax

from .._core import differentiated_primal, is_differentiated, is_tracer


def wait_for(tree: Any) -> None:
    """Blocks until the arrays of `tree` are computed, the concrete values under a
    differentiation's tracers included (a tracer has nothing to wait for)."""
    values = [differentiated_primal(x) if is_tracer(x) else x for x in jax.tree.leaves(tree)]
    jax.block_until_ready([x for x in values if isinstance(x, jax.Array)])


def waiting(values: list, args: tuple) -> tuple[list, tuple]:
    """A program's constants and arguments, the differentiated ones passed through
    `_waits`: the backward pass waits there for the program's backward."""
    flat = [*values, *args]
    where = [i for i, x in enumerate(flat) if is_differentiated(x)]
    if not where:
        return values, args
    for i, x in zip(where, _waits([flat[i] for i in where])):
        flat[i] = x
    return flat[: len(values)], tuple(flat[len(values) :])


@jax.custom_vjp
def _waits(xs: list) -> list:
    return xs


def _forward(xs: list) -> tuple[list, None]:
    return xs, None


def _backward(_: None, cts: list) -> tuple[list]:
    wait_for(cts)  # the cotangents are the program's backward's outputs
    return (cts,)


_waits.defvjp(_forward, _backward)

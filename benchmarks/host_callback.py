"""What one host callback costs by itself: the floor under every `jhooks.host` hook."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jhooks

from .timing import Timed, interleave


def host_callback_cost(reps: int, min_time: float) -> dict[str, Any]:
    """What one host callback costs by itself: a tiny jitted function, with and without.

    A host hook (`jhooks.host`) is one `jax.debug.callback`; this is its floor.
    """
    print("\n== host callback cost", flush=True)
    sink: list = []
    x = jnp.ones(16)

    def observe(v: Any) -> None:
        sink.append(v)

    fns = {
        "no callback": jax.jit(lambda x: x * 2),
        "jax.debug.callback": jax.jit(
            lambda x: (jax.debug.callback(observe, x.sum(), ordered=False), x * 2)[1]
        ),
        "jax.debug.callback ordered": jax.jit(
            lambda x: (jax.debug.callback(observe, x.sum(), ordered=True), x * 2)[1]
        ),
        "jhooks.host": jax.jit(lambda x: (jhooks.host(observe)(x.sum()), x * 2)[1]),
    }
    out: dict[str, Any] = {}
    timed = {}
    for name, fn in fns.items():
        box: dict[str, Any] = {}

        def run(fn: Callable = fn, box: dict = box) -> None:
            box["y"] = fn(x)

        timed[name] = Timed(run, lambda box=box: jax.block_until_ready(box["y"]))
    times = interleave(timed, reps, min_time)
    for name, ts in times.items():
        out[name] = {"call_s": statistics.median(ts), "times_s": ts}
    return out

"""One process of `benchmarks/scaling.py`: a data-parallel DP-SGD step against the plain step.

Run by `scaling.py` as `python -m benchmarks.scaling_step OPTIONS_JSON RESULT_PATH`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` set before JAX is imported; with
`"coordinator"` in the options it joins the other processes through `jax.distributed`
(gloo CPU collectives) first. Every device of every process forms one `data` mesh; the batch
is split over it and the parameters are replicated. Three jitted steps, the same sharding:

- `plain`: `jax.grad` of the batch's mean loss, then `optax.sgd`;
- `clipped`: `jhooks.clipped_grad` (per-example clipping to `MAX_NORM`, ghost norms), the
  clipped sum divided by the batch, then `optax.sgd`;
- `dp_sgd`: the same with Gaussian noise of standard deviation `NOISE * MAX_NORM` added to
  the clipped sum before the division (drawn in the program, the same on every device).

Writes the per-step times of interleaved rounds (wall clock, and this process's CPU time),
the load average and each compiled program's collectives
(`count_ops` of `jitted.lower(...).compile().as_text()`) to RESULT_PATH as JSON.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jhooks

from .timing import Timed, interleave
from .xla_stats import count_ops

MAX_NORM = 1.0
NOISE = 1.0
LR = 0.05
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


class MLP(eqx.Module):
    layers: list

    def __init__(self, features: int, width: int, depth: int, classes: int, *, key):
        sizes = [features] + [width] * (depth - 1) + [classes]
        keys = jax.random.split(key, depth)
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes, sizes[1:], keys)]

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i == 0 else jax.nn.relu(x))
        return x


def example_loss(model, x, y):
    return -jax.nn.log_softmax(model(x))[y]


def make_steps(static: Any, batch: int) -> dict[str, Any]:
    """The jitted steps `(params, xs, ys, step) -> params`, by name."""
    optimizer = optax.sgd(LR)

    def update(params, grads):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    @jax.jit
    def plain(params, xs, ys, step):
        def mean_loss(params):
            model = eqx.combine(params, static)
            return jnp.mean(jax.vmap(example_loss, (None, 0, 0))(model, xs, ys))

        return update(params, jax.grad(mean_loss)(params))

    def clipped_sum(params, xs, ys):
        model = eqx.combine(params, static)
        return jhooks.clipped_grad(example_loss, MAX_NORM)(model, xs, ys)[0]

    @jax.jit
    def clipped(params, xs, ys, step):
        return update(params, jax.tree.map(lambda g: g / batch, clipped_sum(params, xs, ys)))

    @jax.jit
    def dp_sgd(params, xs, ys, step):
        leaves, treedef = jax.tree.flatten(clipped_sum(params, xs, ys))
        keys = jax.random.split(jax.random.fold_in(jax.random.key(0), step), len(leaves))
        noisy = [
            (g + NOISE * MAX_NORM * jax.random.normal(k, g.shape, g.dtype)) / batch
            for g, k in zip(leaves, keys)
        ]
        return update(params, jax.tree.unflatten(treedef, noisy))

    return {"plain": plain, "clipped": clipped, "dp_sgd": dp_sgd}


def collectives(jitted, *args) -> dict[str, int]:
    """The collectives of the compiled program, by kind (an async `-start` counts as one)."""
    ops = count_ops(jitted.lower(*args).compile().as_text())
    return {
        kind: ops.get(kind, 0) + ops.get(kind + "-start", 0)
        for kind in COLLECTIVES
        if ops.get(kind, 0) + ops.get(kind + "-start", 0)
    }


class CpuTimed(Timed):
    """`Timed` that also records the process's CPU time per step of each run: this
    process's work, summed over its devices' threads, whatever else the machine runs."""

    def __init__(self, step):
        super().__init__(step)
        self.cpu_s: list[float] = []

    def run(self, n: int) -> float:
        start = time.process_time()
        wall = super().run(n)
        self.cpu_s.append((time.process_time() - start) / n)
        return wall


def agreed_inner(timed: dict[str, CpuTimed], min_time: float) -> None:
    """Steps per round for each variant, the same in every process (the largest wanted):
    processes that run one program must run it equally often, or the collectives hang."""
    from jax.experimental import multihost_utils

    for t in timed.values():
        t.run(2)
        per_step = t.run(3)
        wanted = np.int32(max(1, math.ceil(min_time / max(per_step, 1e-9))))
        t.inner = int(np.max(multihost_utils.process_allgather(wanted)))


def run(options: dict[str, Any]) -> dict[str, Any]:
    if "coordinator" in options:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            options["coordinator"],
            num_processes=options["processes"],
            process_id=options["process_id"],
            initialization_timeout=60,
        )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch, features = options["batch"], options["width"]

    def place(a: np.ndarray, spec: P) -> jax.Array:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    model = MLP(features, options["width"], options["depth"], 10, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    params = jax.tree.map(lambda a: place(np.asarray(a), P()), params)
    rng = np.random.default_rng(0)
    xs = place(rng.standard_normal((batch, features)).astype(np.float32), P("data"))
    ys = place(rng.integers(0, 10, batch).astype(np.int32), P("data"))
    step = np.int32(0)
    steps = make_steps(static, batch)
    args = (params, xs, ys, step)

    # Each step waits for its result: launched many times without waiting, a program with
    # collectives hung on 2 simulated devices (XLA's rendezvous timed out after 40 s, one
    # device's part never arriving); a training loop that waits avoids it.
    timed = {
        name: CpuTimed(lambda fn=fn: jax.block_until_ready(fn(*args))) for name, fn in steps.items()
    }
    min_time, reps = options["min_time"], options["reps"]
    load_start = os.getloadavg()
    if jax.process_count() > 1:
        agreed_inner(timed, min_time)
        times = interleave(timed, reps, min_time, calibrate=False)
    else:
        times = interleave(timed, reps, min_time)
    result = {
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "batch": batch,
        "times_s": times,
        "cpu_times_s": {name: t.cpu_s[-reps:] for name, t in timed.items()},  # the rounds'
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "inner": {name: t.inner for name, t in timed.items()},
        "collectives": {name: collectives(fn, *args) for name, fn in steps.items()},
    }
    if "coordinator" in options:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("scaling done")
        jax.distributed.shutdown()
    return result


def main(argv: list[str]) -> int:
    options = json.loads(argv[0])
    result = run(options)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

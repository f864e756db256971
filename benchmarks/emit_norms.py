"""Per-layer gradient norms with `jhooks.emit` in a jitted optax step, vs the plain step.

Prints a table and writes `benchmarks/results/emit_<backend>.json`:

    .venv/bin/python -m benchmarks.emit_norms [--quick]

Both steps are timed in interleaved rounds (median), so machine noise hits both alike.
Target (issue 12): the step with norms within 5% of the step without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import jhooks

TARGET = 1.05


def make_params(depth: int, width: int) -> list:
    keys = jax.random.split(jax.random.key(0), depth)
    return [jax.random.normal(k, (width, width)) / jnp.sqrt(width) for k in keys]


def loss(ws: list, xs: jax.Array, with_norms: bool) -> jax.Array:
    h = xs
    for i, w in enumerate(ws):
        h = jnp.tanh(h @ w)
        if with_norms:
            h = jhooks.register_hook(
                h, lambda g, i=i: jhooks.emit(f"layer{i}", jnp.sqrt(jnp.sum(g * g)))
            )
    return jnp.mean(h**2)


def make_steps(opt: optax.GradientTransformation):
    @jax.jit
    def plain(ws, state, xs):
        grads = jax.grad(loss)(ws, xs, False)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(ws, updates), state

    @jax.jit
    def with_norms(ws, state, xs):
        grads, norms = jhooks.grad(loss)(ws, xs, True)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(ws, updates), state, jnp.stack(list(norms.values()))

    return plain, with_norms


def time_once(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def memory_mib(fn, *args) -> float:
    stats = fn.lower(*args).compile().memory_analysis()
    total = stats.temp_size_in_bytes + stats.output_size_in_bytes + stats.argument_size_in_bytes
    return total / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    options = parser.parse_args()
    depth, width, batch = (4, 32, 8) if options.quick else (12, 256, 64)
    rounds, per_round = (3, 2) if options.quick else (21, 10)
    ws = make_params(depth, width)
    xs = jax.random.normal(jax.random.key(1), (batch, width))
    opt = optax.adam(1e-3)
    state = opt.init(ws)
    plain, with_norms = make_steps(opt)
    time_once(plain, ws, state, xs)
    time_once(with_norms, ws, state, xs)
    times: dict[str, list[float]] = {"plain": [], "with_norms": []}
    for _ in range(rounds):
        for name, fn in (("plain", plain), ("with_norms", with_norms)):
            times[name].append(min(time_once(fn, ws, state, xs) for _ in range(per_round)))
    median = {name: statistics.median(t) for name, t in times.items()}
    ratio = median["with_norms"] / median["plain"]
    result = {
        "backend": jax.default_backend(),
        "model": f"MLP {depth}x{width}, batch {batch}, adam",
        "median_step_s": median,
        "ratio": ratio,
        "target": TARGET,
        "pass": ratio <= TARGET,
        "memory_mib": {
            "plain": memory_mib(plain, ws, state, xs),
            "with_norms": memory_mib(with_norms, ws, state, xs),
        },
        "rounds": rounds,
    }
    print(f"{result['model']} on {result['backend']}, median of {rounds} interleaved rounds")
    print(f"{'step':<12}{'time (ms)':>12}{'memory (MiB)':>15}")
    for name in ("plain", "with_norms"):
        print(f"{name:<12}{1e3 * median[name]:>12.3f}{result['memory_mib'][name]:>15.2f}")
    verdict = "PASS" if result["pass"] else "MISS"
    print(f"ratio {ratio:.3f} (target <= {TARGET}): {verdict}")
    if not options.quick:
        out = Path(__file__).parent / "results" / f"emit_{result['backend']}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compile time against depth: hooks on unrolled and scan-over-layers models.

    .venv/bin/python -m benchmarks.compile_depth [--quick]

Prints a table and writes `benchmarks/results/compile_depth_<backend>.json`. Times are
`jax.jit(f).lower(...).compile()` (tracing included), the median of interleaved rounds.
Targets (issue 11): an unrolled model with forward and backward module hooks on every
block compiles within 1.3x of the same model without hooks; a scan-over-layers model's
`run_with_cache(incl_bwd=True)` of every point compiles in time independent of depth
(the 48-layer time within 1.3x of the 12-layer one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import jhooks

WIDTH = 128


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=k1)
        self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


def unrolled(depth: int) -> list[Block]:
    return [Block(k) for k in jax.random.split(jax.random.key(0), depth)]


def scanned(depth: int) -> Block:
    return eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), depth))


def unrolled_loss(blocks: list, x: jax.Array) -> jax.Array:
    for block in blocks:
        x = block(x)
    return jnp.sum(x**2)


def scanned_loss(stack: Block, x: jax.Array) -> jax.Array:
    params, static = eqx.partition(stack, eqx.is_array)

    @jax.checkpoint
    def body(x, p):
        x = eqx.combine(p, static)(x)
        return jhooks.hook_point(x, "resid"), None

    x, _ = jax.lax.scan(body, x, params)
    return jnp.sum(x**2)


def compile_seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start


def cases(depth: int):
    x = jnp.ones(WIDTH)
    blocks = jhooks.hookable(unrolled(depth))
    stack = scanned(depth)

    def plain():
        return compile_seconds(jax.grad(unrolled_loss), blocks, x)

    def hooked():
        handles = jhooks.register_module_hooks(
            blocks,
            Block,
            forward=lambda m, args, out: out * 1.0,
            full_backward=lambda m, grad_input, grad_output: None,
        )
        try:
            return compile_seconds(jax.grad(unrolled_loss), blocks, x)
        finally:
            handles.remove()

    def scan_cache():
        return compile_seconds(
            lambda stack, x: jhooks.run_with_cache(
                lambda x: scanned_loss(stack, x), x, incl_bwd=True
            ),
            stack,
            x,
        )

    def scan_plain():
        return compile_seconds(jax.grad(scanned_loss), stack, x)

    return {
        "unrolled": plain,
        "unrolled+hooks": hooked,
        "scan grad": scan_plain,
        "scan cache+grads": scan_cache,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    options = parser.parse_args()
    depths, rounds = ((2, 4), 1) if options.quick else ((12, 24, 48), 3)
    results: dict[str, dict[str, float]] = {}
    for depth in depths:
        runs = cases(depth)
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                samples[name].append(run())
        results[str(depth)] = {name: statistics.median(s) for name, s in samples.items()}
    names = list(next(iter(results.values())))
    print(f"compile seconds (lower + compile), median of {rounds}, on {jax.default_backend()}")
    print(f"{'depth':>6}" + "".join(f"{n:>18}" for n in names) + f"{'hooks/plain':>13}")
    for depth, row in results.items():
        ratio = row["unrolled+hooks"] / row["unrolled"]
        print(f"{depth:>6}" + "".join(f"{row[n]:>18.2f}" for n in names) + f"{ratio:>13.2f}")
    first, last = results[str(depths[0])], results[str(depths[-1])]
    hook_ratio = max(r["unrolled+hooks"] / r["unrolled"] for r in results.values())
    scan_growth = last["scan cache+grads"] / first["scan cache+grads"]
    verdicts = {
        "unrolled hooks / plain <= 1.3": hook_ratio <= 1.3,
        "scan cache deepest / shallowest <= 1.3": scan_growth <= 1.3,
    }
    for what, ok in verdicts.items():
        figure = hook_ratio if "unrolled" in what else scan_growth
        print(f"{'PASS' if ok else 'MISS'}  {what}  ({figure:.2f})")
    if not options.quick:
        out = Path(__file__).parent / "results" / f"compile_depth_{jax.default_backend()}.json"
        payload = {"seconds": results, "hook_ratio": hook_ratio, "scan_growth": scan_growth}
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

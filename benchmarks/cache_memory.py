"""Compiled memory of `jhooks.run_with_cache`, against returning the activation by hand.

Memory is what XLA's `memory_analysis()` reports for the compiled program (temporary
buffers plus outputs): deterministic, unlike time. A cache with `names_filter`
selecting one point should cost what returning that one activation by hand costs, and
with `incl_bwd=True` what returning it and its gradient by hand costs.

Run: `.venv/bin/python benchmarks/cache_memory.py`
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jhooks


def deep(ws, x, probe=None, keep=None):
    """A tanh MLP with a hook point after every layer; `keep` returns one by hand."""
    kept = None
    for i, w in enumerate(ws):
        x = jnp.tanh(x @ w)
        if i == keep and probe is not None:
            x = x + probe  # the gradient with respect to a zero probe is that of x
        x = jhooks.hook_point(x, f"layer{i}")
        if i == keep:
            kept = x
    loss = jnp.mean(x**2)
    return loss if keep is None else (loss, kept)


def memory(fn, *args) -> int:
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def row(depth: int, width: int, batch: int) -> list[str]:
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(width, width)).astype(np.float32)) for _ in range(depth)]
    x = jnp.asarray(rng.normal(size=(batch, width)).astype(np.float32))
    k = depth // 2
    name = f"layer{k}"
    probe = jnp.zeros((batch, width), jnp.float32)

    plain = memory(lambda ws, x: deep(ws, x), ws, x)
    by_hand = memory(lambda ws, x: deep(ws, x, keep=k), ws, x)
    one = memory(lambda ws, x: jhooks.run_with_cache(deep, ws, x, names_filter=name), ws, x)
    every = memory(lambda ws, x: jhooks.run_with_cache(deep, ws, x), ws, x)

    def grad_by_hand(ws, x, probe):
        (loss, kept), g = jax.value_and_grad(lambda p: deep(ws, x, probe=p, keep=k), has_aux=True)(
            probe
        )
        return loss, kept, g

    grad_hand = memory(grad_by_hand, ws, x, probe)
    grad_one = memory(
        lambda ws, x: jhooks.run_with_cache(deep, ws, x, names_filter=name, incl_bwd=True), ws, x
    )
    mib = [plain, by_hand, one, every, grad_hand, grad_one]
    return [f"{depth}x{width}, batch {batch}", *(f"{m / 2**20:.2f}" for m in mib)]


HEADER = [
    "model",
    "no cache",
    "1 act by hand",
    "cache 1 point",
    "cache all",
    "act+grad by hand",
    "cache 1 point+grad",
]


# (depth, width, batch) of each tanh MLP measured.
CONFIGS = [(8, 256, 128), (8, 1024, 256), (16, 512, 512)]


def rows() -> list[list[str]]:
    """One row of the table per model in `CONFIGS`."""
    return [row(*config) for config in CONFIGS]


def main() -> None:
    header = HEADER
    table_rows = rows()
    widths = [max(len(r[i]) for r in [header, *table_rows]) for i in range(len(header))]
    print(f"compiled memory in MiB (temp + output), {jax.devices()[0].platform}")
    for r in [header, *table_rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()

"""Compiled memory of `jhooks.clipped_grad` against the plain gradient on the models of
`fine_tune_models` (issue 35: within 1.2x of the plain gradient).

    python -m benchmarks.clipping_fine_tune [--batch 32] [--quick]

For each case: XLA's compiled temporary memory (`memory_analysis().temp_size_in_bytes`)
of the plain gradient of the summed loss (`eqx.filter_grad` of `Σ_i loss_i`, the examples
by `jax.vmap`) and of `clipped_grad`'s step, and their ratio; and what `vmap(grad)` would
hold in per-example gradients alone (batch x parameters, float32). Nothing is run: the
figures are the compiler's, the same on every run of one JAX version and machine.
"""

from __future__ import annotations

import argparse
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp

import jhooks

from .fine_tune_models import GemmaLM, MoELM, next_token_loss

FULL = {"vocab": 8192, "d": 256, "heads": 4, "length": 64}
QUICK = {"vocab": 256, "d": 32, "heads": 2, "length": 16}


def cases(quick: bool) -> dict:
    s = QUICK if quick else FULL
    common = {"vocab": s["vocab"], "d": s["d"], "heads": s["heads"], "key": jax.random.key(0)}
    hidden, experts = 4 * s["d"], 8
    return {
        "gemma (RMSNorm 1 + scale, QKV split, 4 layers)": GemmaLM(
            hidden=hidden, depth=4, qkv="split", **common
        ),
        "gemma (QKV sliced W[:, :d])": GemmaLM(hidden=hidden, depth=4, qkv="slice", **common),
        **{
            f"moe ({experts} experts, top 2, {routing})": MoELM(
                hidden=2 * s["d"], experts=experts, top=2, depth=2, routing=routing, **common
            )
            for routing in ("gather", "take", "vmap", "loop")
        },
    }


def temp_bytes(fn, model, ids) -> int:
    params, static = eqx.partition(model, eqx.is_array)
    run = jax.jit(lambda p, ids: fn(eqx.combine(p, static), ids))
    return run.lower(params, ids).compile().memory_analysis().temp_size_in_bytes


def plain(model, ids):
    return eqx.filter_grad(lambda m: jnp.sum(jax.vmap(next_token_loss, (None, 0))(m, ids)))(model)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--allow-fallback",
        action="store_true",
        help="measure a per-example fallback instead of failing on its warning (to compare "
        "with a jhooks that has fewer ghost rules)",
    )
    args = parser.parse_args(argv)
    length = (QUICK if args.quick else FULL)["length"]
    vocab = (QUICK if args.quick else FULL)["vocab"]
    ids = jax.random.randint(jax.random.key(1), (args.batch, length), 0, vocab)
    rows = []
    print(f"batch {args.batch}, sequence {length}, JAX {jax.__version__}, {jax.devices()[0]}")
    print("| model | parameters | plain grad temp | clipped_grad temp | ratio | vmap(grad) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, model in cases(args.quick).items():
        n = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
        with warnings.catch_warnings():
            # A fallback is a failure here, unless measuring one.
            warnings.simplefilter("ignore" if args.allow_fallback else "error")
            clipped = temp_bytes(jhooks.clipped_grad(next_token_loss, 1.0), model, ids)
        base = temp_bytes(plain, model, ids)
        row = {"model": name, "parameters": n, "plain": base, "clipped": clipped}
        rows.append(row)
        print(
            f"| {name} | {n / 1e6:.2f} M | {base / 2**20:.1f} MiB | {clipped / 2**20:.1f} MiB "
            f"| {clipped / base:.2f}x | {args.batch * n * 4 / 2**20:.0f} MiB |"
        )
    return rows


if __name__ == "__main__":
    main()

"""Attribution in one compiled program: AtP against a forward and the exact sweep, EAP-IG's
cost in steps, per-example edge scores by vmap against a loop.

```
python -m benchmarks.attribution          # writes benchmarks/results/attribution_cpu.{json,txt}
python -m benchmarks.attribution --quick  # a small model, few repetitions
```

On the GPT-2-shaped model of `benchmarks/attribution_models.py` (heads split in and out):

- `atp`: `jhooks.attribution(..., nodes="blocks.*.attn.hook_z")` (every head at every
  position: N nodes) against one jitted forward of the same model (weights as
  arguments) and against the exact sweep (every node patched alone, `lax.map` in one
  jitted program); targets: AtP <= 4.5 forwards, AtP >= N/5 times faster than the sweep;
- `eap_ig`: edges between every writer and reader with `method="ig"` at 5, 30 and 50
  steps (batch size 1): the cost of an added step from 5 to 30 and from 30 to 50 (best
  rounds; target: within 1.2x of each other) and XLA's compiled memory (temp + output;
  target: 50 steps <= 1.1x 5 steps);
- `per_example`: EAP on 32 prompts, `per_example=True` (one program, `vmap`) against a
  loop of 32 calls (each the same compiled program of one prompt); target >= 3x.

Times are medians of interleaved rounds (variants in turn). The machine is shared (2
cores, other jobs running): compare the ratios, measured side by side, not the times.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jhooks

from .attribution_models import READERS, WRITERS, gpt, init_gpt
from .machine import machine_info
from .timing import Timed, interleave, paired_ratio

RESULTS = Path(__file__).parent / "results"


def _block(x: Any) -> None:
    jax.block_until_ready(x)


def _memory(fn: Any, *args: Any) -> int:
    mem = fn.lower(*args).compile().memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--out", default=str(RESULTS / "attribution_cpu.json"))
    args = parser.parse_args(argv)
    shape = dict(layers=2, heads=2, d_model=16, d_head=8, d_mlp=32, max_len=8)
    if not args.quick:
        shape = dict(layers=4, heads=4, d_model=64, d_head=16, d_mlp=128, max_len=16)
    reps = 2 if args.quick else args.reps
    seq, layers, heads = shape["max_len"], shape["layers"], shape["heads"]
    params = init_gpt(jax.random.PRNGKey(0), vocab=50, **shape)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (32, seq), 0, 50)
    corrupted = tokens.at[:, seq // 2].set((tokens[:, seq // 2] + 7) % 50)
    answers = jnp.stack([tokens[:, 0], (tokens[:, 0] + 1) % 50], axis=1)
    clean, corrupt, answer = tokens[0], corrupted[0], answers[0]

    def metric(logits: jax.Array, answer: jax.Array) -> jax.Array:
        return logits[-1, answer[0]] - logits[-1, answer[1]]

    def model(p: dict) -> Any:
        return lambda t: gpt(p, t)

    z = "blocks.*.attn.hook_z"
    forward = jax.jit(lambda p, t: gpt(p, t))
    atp = jax.jit(
        lambda p, c, k, a: jhooks.attribution(metric, model(p), c, k, nodes=z, metric_args=(a,))
    )

    @jax.jit
    def sweep(p: dict, c: jax.Array, k: jax.Array, a: jax.Array) -> jax.Array:
        _, cache = jhooks.run_with_cache(model(p), c, names_filter=z)
        base = metric(gpt(p, k), a)

        def effect(index: jax.Array) -> jax.Array:
            layer, pos, head = index // (seq * heads), (index // heads) % seq, index % heads

            def patch(value: jax.Array, name: str) -> jax.Array:
                here = layer == int(name.split(".")[1])
                source = jnp.where(here, cache[name][pos, head], value[pos, head])
                return value.at[pos, head].set(source)

            out = jhooks.run_with_hooks(model(p), k, fwd_hooks=[(z, patch)])
            return metric(out, a) - base

        return jax.lax.map(effect, jnp.arange(layers * seq * heads))

    n_nodes = layers * seq * heads
    case = (params, clean, corrupt, answer)
    timed = {
        "forward": Timed(lambda: forward(params, clean), lambda: _block(forward(params, clean))),
        "atp": Timed(lambda: atp(*case), lambda: _block(atp(*case))),
        "sweep": Timed(lambda: sweep(*case), lambda: _block(sweep(*case))),
    }
    times = interleave(timed, reps, args.min_time)
    atp_rows = {
        "nodes": n_nodes,
        "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "atp_over_forward": paired_ratio(times, "atp", "forward"),
        "sweep_over_atp": paired_ratio(times, "sweep", "atp"),
        "target_sweep_over_atp": n_nodes / 5,
    }

    def eap_ig(steps: int) -> Any:
        return jax.jit(
            lambda p, c, k, a: jhooks.attribution(
                metric,
                model(p),
                c,
                k,
                edges=True,
                method="ig",
                steps=steps,
                writers=WRITERS,
                readers=READERS,
                metric_args=(a,),
            )  # fmt: skip
        )

    steps_list = [5, 30, 50]
    programs = {s: eap_ig(s) for s in steps_list}
    memory = {s: _memory(programs[s], *case) for s in steps_list}
    timed = {
        f"{s} steps": Timed(lambda f=f: f(*case), lambda f=f: _block(f(*case)))
        for s, f in programs.items()
    }
    times = interleave(timed, reps, args.min_time)
    # Linear in the steps: the cost of a step (the slope between successive step
    # counts) is the same; the two runs of activations are a fixed cost beside it.
    # The best round of each (other jobs on a shared machine only add time).
    total = {s: min(times[f"{s} steps"]) for s in steps_list}
    slopes = [(total[b] - total[a]) / (b - a) for a, b in zip(steps_list, steps_list[1:])]
    ig_rows = {
        "ms": {s: 1e3 * total[s] for s in steps_list},
        "ms_per_added_step": [1e3 * x for x in slopes],
        "slope_spread": max(slopes) / min(slopes),
        "memory_bytes": memory,
        "memory_50_over_5": memory[50] / memory[5],
    }

    def eap(c: jax.Array, k: jax.Array, a: jax.Array, per_example: bool = False) -> Any:
        return jhooks.attribution(
            metric, model(params), c, k, edges=True, writers=WRITERS, readers=READERS,
            metric_args=(a,), per_example=per_example,
        )  # fmt: skip

    def loop() -> Any:
        return [eap(tokens[i], corrupted[i], answers[i]) for i in range(len(tokens))]

    def batched() -> Any:
        return eap(tokens, corrupted, answers, per_example=True)

    timed = {
        "vmap": Timed(batched, lambda: _block(batched())),
        "loop": Timed(loop, lambda: _block(loop())),
    }
    times = interleave(timed, reps, args.min_time)
    vmap_rows = {
        "examples": len(tokens),
        "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "loop_over_vmap": paired_ratio(times, "loop", "vmap"),
    }

    lines: list[str] = []
    lines.append(f"attribution, GPT shape {shape}, {jax.default_backend()} (shared machine)")
    lines.append(f"{'AtP, ' + str(n_nodes) + ' nodes':34s} {'ms':>9s}")
    for k, v in atp_rows["ms"].items():
        lines.append(f"  {k:32s} {v:9.2f}")
    lines.append(f"  AtP / forward {atp_rows['atp_over_forward']:.2f}x (target <= 4.5)")
    lines.append(
        f"  sweep / AtP {atp_rows['sweep_over_atp']:.1f}x (target >= N/5 = {n_nodes / 5:.1f})"
    )
    lines.append(f"{'EAP-IG':34s} {'ms':>9s} {'MiB':>9s}")
    for s in steps_list:
        lines.append(f"  {str(s) + ' steps':32s} {ig_rows['ms'][s]:9.2f} {memory[s] / 2**20:9.3f}")
    added = ", ".join(f"{x:.3f}" for x in ig_rows["ms_per_added_step"])
    lines.append(f"  ms per added step (5->30, 30->50): {added}")
    lines.append(f"  their spread {ig_rows['slope_spread']:.2f}x (target <= 1.2: linear)")
    lines.append(f"  memory 50 / 5 steps {ig_rows['memory_50_over_5']:.3f}x (target <= 1.1)")
    lines.append(f"EAP on {len(tokens)} prompts         ms")
    for k, v in vmap_rows["ms"].items():
        lines.append(f"  {k:32s} {v:9.2f}")
    lines.append(f"  loop / vmap {vmap_rows['loop_over_vmap']:.2f}x (target >= 3)")
    print("\n".join(lines))
    saved = {
        "machine": machine_info(),
        "shape": shape,
        "quick": args.quick,
        "atp": atp_rows,
        "eap_ig": ig_rows,
        "per_example": vmap_rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1, default=str))
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return saved


if __name__ == "__main__":
    main()

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
  steps (batch size 1), each program compiled once ahead of the timing: the time per
  step `t(s) / s` (target: largest / smallest <= 1.2), the cost of an added step from 5
  to 30 and from 30 to 50 (free of the fixed cost of the two runs of activations;
  target: within 1.2x of each other), each a median over rounds, and XLA's compiled
  memory (temp + output; target: 50 steps <= 1.1x 5 steps);
- `per_example`: EAP on 32 prompts, `per_example=True` (one program, `vmap`) against a
  loop of 32 calls of `jhooks.attribution` (each the same compiled program of one
  prompt; target >= 3x), and, for reference, against a loop of 32 calls of a `jax.jit`
  of the one-prompt call (no jhooks code between the calls).

Every time is per call, compilation excluded (each variant runs twice before it is
timed), the variants of a section run in turn, round after round (9 rounds), and every
ratio is the median of the rounds' ratios. The machine is shared (2 cores, other jobs
running): compare the ratios, measured side by side, not the times. About 2.5 minutes
on a loaded 2-core CPU, most of it compiling.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jhooks

from .attribution_models import READERS, WRITERS, gpt, init_gpt
from .machine import machine_info
from .tables import table
from .timing import Timed, interleave, paired_ratio

RESULTS = Path(__file__).parent / "results"


def _block(x: Any) -> None:
    jax.block_until_ready(x)


def _memory(compiled: Any) -> int:
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--min-time", type=float, default=0.25)
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

    steps_list = [5, 30, 50]

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

    # Each program compiled once, ahead of the timing: its memory is read from it and
    # the timed calls call it.
    programs = {s: eap_ig(s).lower(*case).compile() for s in steps_list}
    memory = {s: _memory(programs[s]) for s in steps_list}
    timed = {
        f"{s} steps": Timed(lambda f=f: f(*case), lambda f=f: _block(f(*case)))
        for s, f in programs.items()
    }
    times = interleave(timed, reps, args.min_time)
    ig_rows = _linearity(times, steps_list)
    ig_rows["memory_bytes"] = memory
    ig_rows["memory_50_over_5"] = memory[50] / memory[5]

    def eap(c: jax.Array, k: jax.Array, a: jax.Array, per_example: bool = False) -> Any:
        return jhooks.attribution(
            metric, model(params), c, k, edges=True, writers=WRITERS, readers=READERS,
            metric_args=(a,), per_example=per_example,
        )  # fmt: skip

    one = jax.jit(eap)

    def loop() -> Any:
        return [eap(tokens[i], corrupted[i], answers[i]) for i in range(len(tokens))]

    def loop_jitted() -> Any:
        return [one(tokens[i], corrupted[i], answers[i]) for i in range(len(tokens))]

    def batched() -> Any:
        return eap(tokens, corrupted, answers, per_example=True)

    timed = {
        "vmap": Timed(batched, lambda: _block(batched())),
        "loop": Timed(loop, lambda: _block(loop())),
        "loop of jax.jit": Timed(loop_jitted, lambda: _block(loop_jitted())),
    }
    times = interleave(timed, reps, args.min_time)
    vmap_rows = {
        "examples": len(tokens),
        "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "loop_over_vmap": paired_ratio(times, "loop", "vmap"),
        "jitted_loop_over_vmap": paired_ratio(times, "loop of jax.jit", "vmap"),
    }

    rows = _rows(n_nodes, atp_rows, ig_rows, vmap_rows, steps_list)
    lines = [
        f"attribution, GPT shape {shape}, {jax.default_backend()}, medians of {reps} "
        f"interleaved rounds, compilation excluded (shared machine: load average "
        f"{os.getloadavg()[0]:.1f} at the end)",
        table(["measure", "value", "target", "met"], rows),
    ]
    print("\n".join(lines))
    saved = {
        "machine": machine_info(),
        "shape": shape,
        "quick": args.quick,
        "reps": reps,
        "atp": atp_rows,
        "eap_ig": ig_rows,
        "per_example": vmap_rows,
        "table": [dict(zip(["measure", "value", "target", "met"], r)) for r in rows],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1, default=str))
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return saved


def _linearity(times: dict[str, list[float]], steps_list: list[int]) -> dict[str, Any]:
    """EAP-IG's time against its number of steps, round by round (the variants of a
    round ran side by side): the time per step `t(s) / s`, and the cost of an added step
    (the slope between successive step counts, free of the fixed cost of the two runs
    of activations), each as the median over the rounds."""
    rounds = list(zip(*(times[f"{s} steps"] for s in steps_list)))
    per_step = {s: statistics.median(r[i] / s for r in rounds) for i, s in enumerate(steps_list)}
    slopes = [
        [(r[i + 1] - r[i]) / (b - a) for r in rounds]
        for i, (a, b) in enumerate(zip(steps_list, steps_list[1:]))
    ]
    slope_ratio = statistics.median(later / first for first, later in zip(*slopes))
    return {
        "ms": {s: 1e3 * statistics.median(times[f"{s} steps"]) for s in steps_list},
        "ms_per_step": {s: 1e3 * v for s, v in per_step.items()},
        "per_step_spread": statistics.median(
            max(r[i] / s for i, s in enumerate(steps_list))
            / min(r[i] / s for i, s in enumerate(steps_list))
            for r in rounds
        ),
        "ms_per_added_step": [1e3 * statistics.median(x) for x in slopes],
        "added_step_ratio": slope_ratio,
        # a step that costs nothing or less is no linear growth
        "added_step_spread": max(slope_ratio, 1 / slope_ratio) if slope_ratio > 0 else math.inf,
    }


def _rows(n_nodes: int, atp: dict, ig: dict, vmap: dict, steps_list: list[int]) -> list[list[Any]]:
    """The table: measure, value, target, whether it is met."""
    ms = atp["ms"]
    rows: list[list[Any]] = [
        ["forward, AtP, exact sweep (ms)", f"{ms['forward']:.2f}, {ms['atp']:.2f}, "
         f"{ms['sweep']:.1f}", "", ""],
        [f"AtP of {n_nodes} nodes / forward", f"{atp['atp_over_forward']:.2f}x", "<= 4.5x",
         atp["atp_over_forward"] <= 4.5],
        ["exact sweep / AtP", f"{atp['sweep_over_atp']:.1f}x", f">= N/5 = {n_nodes / 5:.1f}x",
         atp["sweep_over_atp"] >= n_nodes / 5],
    ]  # fmt: skip
    steps = ", ".join(str(s) for s in steps_list)
    rows += [
        [f"EAP-IG at {steps} steps (ms)", ", ".join(f"{ig['ms'][s]:.2f}" for s in steps_list),
         "", ""],
        ["  time per step t(s)/s (ms)",
         ", ".join(f"{ig['ms_per_step'][s]:.3f}" for s in steps_list), "", ""],
        ["  time per step, largest / smallest", f"{ig['per_step_spread']:.2f}x", "<= 1.2x",
         ig["per_step_spread"] <= 1.2],
        ["  cost of an added step, 5->30, 30->50 (ms)",
         ", ".join(f"{x:.3f}" for x in ig["ms_per_added_step"]), "", ""],
        ["  cost of an added step, 30->50 / 5->30", f"{ig['added_step_ratio']:.2f}x",
         "within 1.2x", ig["added_step_spread"] <= 1.2],
        ["  compiled memory (MiB)",
         ", ".join(f"{ig['memory_bytes'][s] / 2**20:.3f}" for s in steps_list), "", ""],
        ["  compiled memory, 50 / 5 steps", f"{ig['memory_50_over_5']:.3f}x", "<= 1.1x",
         ig["memory_50_over_5"] <= 1.1],
    ]  # fmt: skip
    v = vmap["ms"]
    n = vmap["examples"]
    rows += [
        [f"EAP on {n} prompts: vmap, loop, loop of jax.jit (ms)",
         f"{v['vmap']:.1f}, {v['loop']:.1f}, {v['loop of jax.jit']:.1f}", "", ""],
        [f"  loop of {n} calls / per_example=True", f"{vmap['loop_over_vmap']:.2f}x", ">= 3x",
         vmap["loop_over_vmap"] >= 3],
        [f"  loop of {n} jitted calls / per_example=True",
         f"{vmap['jitted_loop_over_vmap']:.2f}x", "", ""],
    ]  # fmt: skip
    return rows


if __name__ == "__main__":
    main()

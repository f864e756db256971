"""Case 3: trace + compile time of the step, hooks on every layer against none, by depth."""

from __future__ import annotations

import statistics
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import optax

from .jax_side import jax_variant, make_jax_step
from .models import mlp_case
from .settings import HAS_MODULE_HOOKS, LR
from .xla_stats import compiled_stats


def compile_cost(depths: list[int], reps: int, warm_up: bool = True) -> dict[str, Any]:
    print(f"\n== compile cost: MLPs of width 64 and depth {depths}", flush=True)
    case_names = [("plain", "plain", "none"), ("value:identity", "value", "identity")]
    if HAS_MODULE_HOOKS:
        case_names.append(("module:identity", "module", "identity"))
    optim = optax.sgd(LR)
    out: dict[str, Any] = {}
    for depth in depths:
        case = mlp_case(64, depth)
        x_np, y_np = case.batch()
        batch = (jnp.asarray(x_np), jnp.asarray(y_np))
        made = {}
        for name, flavor, hooks in case_names:
            model, loss_fn, handles = jax_variant(case, flavor, hooks)
            made[name] = (model, loss_fn, handles, optim.init(eqx.filter(model, eqx.is_array)))
        results: dict[str, dict[str, list[float]]] = {
            n: {"trace_lower_s": [], "compile_s": []} for n, _, _ in case_names
        }
        for r in range(-1 if warm_up else 0, reps):  # round -1 warms up, not recorded
            names = [n for n, _, _ in case_names]
            shift = max(r, 0) % len(names)
            for name in names[shift:] + names[:shift]:
                model, loss_fn, _, opt_state = made[name]
                step = make_jax_step(loss_fn, optim)  # a new function: nothing cached
                stats = compiled_stats(step, (batch, model, opt_state))
                if r < 0:
                    continue
                results[name]["trace_lower_s"].append(stats["trace_lower_s"])
                results[name]["compile_s"].append(stats["compile_s"])
        row = {}
        for name in results:
            tl, cs = results[name]["trace_lower_s"], results[name]["compile_s"]
            totals = [a + b for a, b in zip(tl, cs)]
            row[name] = {
                "trace_lower_s": statistics.median(tl),
                "compile_s": statistics.median(cs),
                "total_s": statistics.median(totals),
                "totals_s": totals,
            }
        for name in row:
            if name != "plain":
                row[name]["ratio_to_plain"] = statistics.median(
                    a / b for a, b in zip(row[name]["totals_s"], row["plain"]["totals_s"])
                )
        out[str(depth)] = row
        print(
            f"   depth {depth}: " + ", ".join(f"{n} {row[n]['total_s']:.2f} s" for n in row),
            flush=True,
        )
    return out

"""Cases 1, 2 and 4: one model's training step in every variant, jhooks against PyTorch."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import torch

from .jax_side import jax_variant, make_jax_step
from .models import Case
from .settings import LR, TORCH_KINDS, TORCH_THREADS, variant_names
from .timing import Timed, interleave, paired_ratio
from .torch_side import torch_compiled, torch_step, torch_variant
from .xla_stats import compiled_stats


def bench_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n== {case.name}: {case.description}", flush=True)
    x_np, y_np = case.batch()
    batch = (jnp.asarray(x_np), jnp.asarray(y_np))
    xt, yt = torch.from_numpy(x_np), torch.from_numpy(y_np)
    optim = optax.sgd(LR)
    timed: dict[str, Timed] = {}
    variants: dict[str, dict[str, Any]] = {}
    keep: list = []  # handles and models, alive for the whole case
    source = case.eqx_model()

    for name, flavor, hooks in variant_names():
        model, loss_fn, handles = jax_variant(case, flavor, hooks)
        step = make_jax_step(loss_fn, optim)
        opt_state = optim.init(eqx.filter(model, eqx.is_array))
        stats = compiled_stats(step, (batch, model, opt_state))
        state = {"model": model, "opt": opt_state, "loss": None}

        def run(step: Callable = step, state: dict = state) -> None:
            state["loss"], state["model"], state["opt"] = step(batch, state["model"], state["opt"])

        key = f"jhooks {name}"
        timed[key] = Timed(run, lambda state=state: jax.block_until_ready(state["loss"]))
        variants[key] = {"framework": "jhooks", "flavor": flavor, "hooks": hooks, **stats}
        keep.append((handles, model))

    torch_names = [(n, f, h) for n, f, h in variant_names() if h != "idle"]
    for name, flavor, hooks in torch_names:
        model, forward, handles = torch_variant(case, flavor, hooks, source)
        for kind, threads in TORCH_KINDS.items():
            if kind != "torch":
                model, forward, more = torch_variant(case, flavor, hooks, source)
                handles = handles + more
            key = f"{kind} {name}"
            timed[key] = Timed(torch_step(case, model, forward, xt, yt), threads=threads)
            variants[key] = {
                "framework": "torch",
                "flavor": flavor,
                "hooks": hooks,
                "threads": threads,
            }
            keep.append((handles, model))
    jax_loss = float(case.jax_loss(source(batch[0]), batch[1]))
    torch.set_num_threads(TORCH_THREADS)
    torch_model, _, _ = torch_variant(case, "plain", "none", source)
    with torch.no_grad():
        torch_loss = float(case.torch_loss(torch_model(xt), yt))
    loss_check = {
        "jax_loss": jax_loss,
        "torch_loss": torch_loss,
        "abs_diff": abs(jax_loss - torch_loss),
    }

    compile_reports: dict[str, Any] = {}
    if args.torch_compile:
        for name, flavor, hooks in torch_names:
            if name not in args.torch_compile_variants:
                continue
            print(f"   torch.compile {name} ...", flush=True)
            report, step_fn = torch_compiled(
                case, flavor, hooks, source, xt, yt, args.torch_compile_limit
            )
            compile_reports[name] = report
            if step_fn is not None:
                timed[f"torch.compile {name}"] = Timed(step_fn, threads=1)
                variants[f"torch.compile {name}"] = {
                    "framework": "torch.compile",
                    "flavor": flavor,
                    "hooks": hooks,
                    "threads": 1,
                    **report,
                }

    times = interleave(timed, args.reps, args.min_time)
    torch.set_num_threads(TORCH_THREADS)
    for key, ts in times.items():
        variants[key]["step_s"] = statistics.median(ts)
        variants[key]["times_s"] = ts
    ratios: dict[str, float] = {}
    for name, _, _ in variant_names():
        if name == "plain":
            continue
        ratios[f"jhooks {name} / jhooks plain"] = paired_ratio(
            times, f"jhooks {name}", "jhooks plain"
        )
    for name, _, hooks in variant_names():
        if hooks == "idle":
            continue
        for other in (*TORCH_KINDS, "torch.compile"):
            if f"{other} {name}" in times:
                ratios[f"jhooks {name} / {other} {name}"] = paired_ratio(
                    times, f"jhooks {name}", f"{other} {name}"
                )
    del keep
    return {
        "description": case.description,
        "variants": variants,
        "ratios": ratios,
        "loss_check": loss_check,
        "torch_compile": compile_reports,
    }

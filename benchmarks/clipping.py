"""Per-example clipping: `jhooks.clipped_grad` vs `vmap(grad)` + clip vs plain `grad` vs Opacus.

```
.venv/bin/python -m benchmarks.clipping           # the full run; writes results/clipping_cpu.json
.venv/bin/python -m benchmarks.clipping --quick   # a short smoke run (small models)
```

Each variant computes the gradient of one batch (no optimizer update):

- `plain`: `eqx.filter_grad` of the summed loss: the floor, no clipping;
- `clipped_grad`: `jhooks.clipped_grad(loss, C)`: per-example clipped sum by ghost norms;
- `clipped_grad_1pass`, `clipped_grad_2pass` (GPT-shaped cases): its two routes forced
  (`passes=1`: every site's activations and output gradients kept, one backward pass;
  `passes=2`: the norms in the backward pass, the clipped sum in a second one);
  `norms_only`: the default route's first backward pass alone (its norms; XLA drops the
  second pass), which shows what the second pass costs;
- `vmap_grad`: `jax.vmap(eqx.filter_grad(loss))`, per-example norms, clip, sum: the
  per-example gradients are materialised (batch x parameters);
- `torch_plain`: the same model in PyTorch eager, the gradient of the summed loss (no
  clipping): PyTorch's floor on this machine, for scale;
- `opacus_ghost`: the same PyTorch model wrapped in Opacus'
  `GradSampleModuleFastGradientClipping(use_ghost_clipping=True)` and its two backward
  passes (what `DPLossFastGradientClipping.backward` runs).

PyTorch runs with its default threads and with one (`_1t`); the comparison with Opacus
takes, round by round, the faster of the two.

JAX steps are `jax.jit`-compiled; time is the median over `--reps` interleaved rounds of
the per-step time, each round long enough to last `--min-time` s; a ratio is the median
over the rounds of the ratio within a round. Memory is XLA's
`memory_analysis()` of the compiled step, temporaries + outputs (the inputs, model and
batch, are the same for every variant). Targets (issue 12): `clipped_grad` memory <= 1.3x
plain, time <= 2.5x plain, and faster than Opacus ghost clipping; for the GPT-shaped model
(`--cases gpt gpt-noremat`, issue 17; `clipping_gpt.py`, with and without `jax.checkpoint`
per layer): memory <= 1.2x, time <= 1.3x, no fallback
warning (Opacus runs its twin with the output layer untied: it refuses tied weights).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import jhooks

from .clipping_gpt import make_gpt_case
from .timing import Timed, interleave, paired_ratio

MAX_NORM = 1.0
TARGET_MEMORY = 1.3
TARGET_TIME = 2.5
# vmap(grad) is compiled (memory) but not run when its temporaries exceed this (the other
# variants always run: their ratios are the point).
RUN_LIMIT_BYTES = 3 << 30
RESULTS = Path(__file__).parent / "results" / "clipping_cpu.json"
TORCH_THREADS = torch.get_num_threads()  # PyTorch's default


# --------------------------------------------------------------------------- models


class MLP(eqx.Module):
    layers: list

    def __init__(self, width: int, depth: int, classes: int, *, key):
        keys = jax.random.split(key, depth)
        sizes = [width] * depth + [classes]
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes, sizes[1:], keys)]

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i == 0 else jax.nn.relu(x))
        return x


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, d: int, heads: int, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.fc1 = eqx.nn.Linear(d, 4 * d, key=k2)
        self.fc2 = eqx.nn.Linear(4 * d, d, key=k3)

    def __call__(self, h):
        x = jax.vmap(self.ln1)(h)
        h = h + self.attn(x, x, x)
        x = jax.vmap(self.ln2)(h)
        return h + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))


class Transformer(eqx.Module):
    """Token + position embeddings, pre-norm blocks, mean pooling, a linear classifier."""

    tok: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: list
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab, d, length, heads, depth, classes, *, key):
        ks = jax.random.split(key, depth + 3)
        self.tok = eqx.nn.Embedding(vocab, d, key=ks[0])
        self.pos = eqx.nn.Embedding(length, d, key=ks[1])
        self.blocks = [Block(d, heads, key=k) for k in ks[3:]]
        self.ln = eqx.nn.LayerNorm(d)
        self.head = eqx.nn.Linear(d, classes, key=ks[2])

    def __call__(self, ids):
        h = jax.vmap(self.tok)(ids) + jax.vmap(self.pos)(jnp.arange(ids.shape[0]))
        for block in self.blocks:
            h = block(h)
        return self.head(jnp.mean(jax.vmap(self.ln)(h), axis=0))


class TorchMLP(nn.Module):
    def __init__(self, width, depth, classes):
        super().__init__()
        sizes = [width] * depth + [classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i == 0 else F.relu(x))
        return x


class TorchBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h):
        b, t, d = h.shape
        x = self.ln1(h)

        def split(z):
            return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        h = h + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))


class TorchTransformer(nn.Module):
    def __init__(self, vocab, d, length, heads, depth, classes):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(TorchBlock(d, heads) for _ in range(depth))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, ids):
        b, t = ids.shape
        h = self.tok(ids) + self.pos(torch.arange(t).repeat(b, 1))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h).mean(dim=1))


def xent(model, x, y):
    return -jax.nn.log_softmax(model(x))[y]


def make_case(name: str, batch: int, quick: bool) -> dict[str, Any]:
    if name.startswith("gpt"):  # gpt, gpt-noremat, gpt-onehot, gpt-noremat-onehot
        head = "onehot" if name.endswith("-onehot") else "gather"
        return make_gpt_case(batch, quick, remat="noremat" not in name, head=head)
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    if name.startswith("mlp"):
        width, depth = (64, 2) if quick else (1024, 4)
        x = rng.standard_normal((batch, width), dtype=np.float32)
        eqx_model, torch_model = MLP(width, depth, 10, key=key), TorchMLP(width, depth, 10)
        label = f"mlp{depth}x{width}"
    else:
        vocab, d, length, heads, depth = (32, 16, 8, 2, 1) if quick else (512, 64, 32, 4, 2)
        x = rng.integers(0, vocab, (batch, length), dtype=np.int32)
        eqx_model = Transformer(vocab, d, length, heads, depth, 10, key=key)
        torch_model = TorchTransformer(vocab, d, length, heads, depth, 10)
        label = f"transformer{depth}x{d}x{length}"
    y = rng.integers(0, 10, (batch,), dtype=np.int32)
    return {
        "label": f"{label} b{batch}",
        "eqx": eqx_model,
        "torch": torch_model,
        "x": x,
        "y": y,
    }


# --------------------------------------------------------------------------- variants


def jax_variants(loss: Callable = xent, routes: bool = False) -> dict[str, Callable]:
    """The JAX variants; `routes`: also `clipped_grad`'s two routes forced (`passes=1`,
    `passes=2`) and its first backward pass alone (`norms_only`: the norms, with the
    clipped sum dropped by XLA), to show where the time of the default route goes."""

    def plain(model, xs, ys):
        return eqx.filter_grad(lambda m: jnp.sum(jax.vmap(loss, (None, 0, 0))(m, xs, ys)))(model)

    def vmap_grad(model, xs, ys):
        per = jax.vmap(eqx.filter_grad(loss), in_axes=(None, 0, 0))(model, xs, ys)
        leaves = jax.tree.leaves(per)
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in leaves))
        w = jnp.minimum(1, MAX_NORM / norms)
        return jax.tree.map(lambda g: jnp.tensordot(w, g, 1), per), norms

    variants = {
        "plain": plain,
        "clipped_grad": jhooks.clipped_grad(loss, MAX_NORM),
        "vmap_grad": vmap_grad,
    }
    if routes:
        clipped = variants["clipped_grad"]
        variants["clipped_grad_1pass"] = jhooks.clipped_grad(loss, MAX_NORM, passes=1)
        variants["clipped_grad_2pass"] = jhooks.clipped_grad(loss, MAX_NORM, passes=2)
        variants["norms_only"] = lambda model, xs, ys: clipped(model, xs, ys)[1]
    return variants


def cross_entropy(model: nn.Module, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def opacus_step(case: dict[str, Any], module: nn.Module) -> Callable[[], Any]:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    # Opacus records activations in forward hooks, which a checkpoint would rerun.
    if getattr(module, "remat", False):
        module.remat = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = GradSampleModuleFastGradientClipping(
            module, max_grad_norm=MAX_NORM, use_ghost_clipping=True, loss_reduction="sum"
        )
    x = torch.from_numpy(case["x"])
    if x.dtype == torch.int32:
        x = x.long()
    y = torch.from_numpy(case["y"]).long()
    params = [p for p in gsm.parameters() if p.requires_grad]
    per_example_losses = case.get("torch_losses", cross_entropy)

    def step():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch: "Full backward hook is firing ..."
            return ghost_step()

    def ghost_step():
        # What opacus' DPTensorFastGradientClipping.backward runs, without the optimizer.
        losses = per_example_losses(gsm, x, y)
        losses.sum().backward(retain_graph=True)
        for p in params:
            p.grad = None
        coeff = gsm.get_clipping_coef()
        gsm.disable_hooks()
        (coeff * losses).sum().backward()
        gsm.enable_hooks()
        return [p.grad for p in params]

    return step


def on_arrays(fn: Callable, model: Any) -> tuple[Callable, Any]:
    """`fn` as a function of the model's arrays, for `jax.jit` (the rest is static)."""
    params, static = eqx.partition(model, eqx.is_array)
    return (lambda p, *a: fn(eqx.combine(p, static), *a)), params


def torch_plain_step(case: dict[str, Any]) -> Callable[[], Any]:
    """The gradient of the summed loss in eager PyTorch, no Opacus: its floor."""
    model = copy.deepcopy(case["torch"])  # Opacus adds hooks to case["torch"]'s layers
    x = torch.from_numpy(case["x"])
    x = x.long() if x.dtype == torch.int32 else x
    y = torch.from_numpy(case["y"]).long()
    params = [p for p in model.parameters() if p.requires_grad]

    per_example_losses = case.get("torch_losses", cross_entropy)

    def step():
        for p in params:
            p.grad = None
        per_example_losses(model, x, y).sum().backward()
        return [p.grad for p in params]

    return step


def memory(compiled: Any) -> dict[str, int]:
    """XLA's memory analysis of a compiled step, in bytes."""
    stats = compiled.memory_analysis()
    return {
        "temp": int(stats.temp_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "argument": int(stats.argument_size_in_bytes),
        "total": int(stats.temp_size_in_bytes + stats.output_size_in_bytes),
    }


def run_case(case: dict[str, Any], reps: int, min_time: float) -> dict[str, Any]:
    model = case["eqx"]
    xs, ys = jnp.asarray(case["x"]), jnp.asarray(case["y"])
    out: dict[str, Any] = {"memory": {}, "time_s": {}, "skipped": []}
    timed: dict[str, Timed] = {}
    routes = case["label"].startswith("gpt")
    for name, fn in jax_variants(case.get("loss", xent), routes).items():
        fn, params = on_arrays(fn, model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # Compiled once: its memory is read off the executable that is then timed.
            compiled = jax.jit(fn).lower(params, xs, ys).compile()
        out["memory"][name] = memory(compiled)
        if name == "clipped_grad":  # a per-example fallback warns when traced
            out["fallback_warnings"] = [str(w.message) for w in caught]
        if name == "vmap_grad" and out["memory"][name]["temp"] > RUN_LIMIT_BYTES:
            out["skipped"].append(name)
            continue
        timed[name] = Timed(lambda f=compiled, p=params: jax.block_until_ready(f(p, xs, ys)))
    # PyTorch runs with its default threads and with one: on a small shared machine
    # its default can be the slower by far (threads waiting on each other).
    for threads, suffix in ((TORCH_THREADS, ""), (1, "_1t")):
        timed["torch_plain" + suffix] = Timed(torch_plain_step(case), threads=threads)
        opacus = opacus_step(case, copy.deepcopy(case["torch"]))
        timed["opacus_ghost" + suffix] = Timed(opacus, threads=threads)
    times = interleave(timed, reps, min_time)
    # Opacus at its best: the faster thread setting, round by round.
    times["opacus_ghost_best"] = [
        min(a, b) for a, b in zip(times["opacus_ghost"], times["opacus_ghost_1t"])
    ]
    out["time_s"] = {n: statistics.median(t) for n, t in times.items()}
    out["rounds_s"] = times
    out["ratios"] = {
        "memory_clipped_vs_plain": out["memory"]["clipped_grad"]["total"]
        / out["memory"]["plain"]["total"],
        "memory_vmap_vs_plain": out["memory"]["vmap_grad"]["total"]
        / out["memory"]["plain"]["total"],
        "time_clipped_vs_plain": paired_ratio(times, "clipped_grad", "plain"),
        "time_clipped_vs_opacus_ghost": paired_ratio(times, "clipped_grad", "opacus_ghost_best"),
    }
    if "vmap_grad" in times:
        out["ratios"]["time_vmap_vs_plain"] = paired_ratio(times, "vmap_grad", "plain")
    for name in ("clipped_grad_1pass", "clipped_grad_2pass", "norms_only"):
        if name in times:
            out["ratios"][f"time_{name}_vs_plain"] = paired_ratio(times, name, "plain")
            out["ratios"][f"memory_{name}_vs_plain"] = (
                out["memory"][name]["total"] / out["memory"]["plain"]["total"]
            )
    r = out["ratios"]
    # Issue 17's targets for the GPT-shaped model, issue 12's for the others.
    target_memory, target_time = (
        (1.2, 1.3)
        if case["label"].startswith("gpt")
        else (
            TARGET_MEMORY,
            TARGET_TIME,
        )
    )
    out["targets"] = {
        f"memory <= {target_memory}x plain": r["memory_clipped_vs_plain"] <= target_memory,
        f"time <= {target_time}x plain": r["time_clipped_vs_plain"] <= target_time,
        "faster than Opacus ghost": r["time_clipped_vs_opacus_ghost"] < 1.0,
        "no fallback warning": not out["fallback_warnings"],
    }
    return out


VARIANTS = (
    "plain",
    "clipped_grad",
    "clipped_grad_1pass",
    "clipped_grad_2pass",
    "norms_only",
    "vmap_grad",
    "torch_plain",
    "torch_plain_1t",
    "opacus_ghost",
    "opacus_ghost_1t",
)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def table(results: dict[str, Any]) -> str:
    rows = [
        "| case | variant | time (ms) | time vs plain | memory (MiB) | memory vs plain |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, res in results.items():
        rounds, plain_m = res["rounds_s"], res["memory"]["plain"]["total"]
        for name in VARIANTS:
            if name not in res["time_s"] and name not in res["memory"]:
                continue  # not a variant of this case
            t = res["time_s"].get(name)
            m = res["memory"].get(name, {}).get("total")
            r = paired_ratio(rounds, name, "plain") if t else 0
            rows.append(
                f"| {label} | {name} | "
                + (f"{t * 1e3:.2f} | {r:.2f}x" if t else "not run | -")
                + " | "
                + (f"{_mib(m)} | {m / plain_m:.2f}x" if m is not None else "eager | -")
                + " |"
            )
    lines = ["\n".join(rows), ""]
    for label, res in results.items():
        marks = ", ".join(f"{k}: {'PASS' if ok else 'MISS'}" for k, ok in res["targets"].items())
        r = res["ratios"]
        lines.append(
            f"- {label}: clipped_grad {r['time_clipped_vs_plain']:.2f}x plain time, "
            f"{r['memory_clipped_vs_plain']:.2f}x plain memory, "
            f"{r['time_clipped_vs_opacus_ghost']:.2f}x Opacus ghost time (its faster thread "
            f"setting, round by round) ({marks})"
        )
        routes = [
            f"{name}: {r[f'time_{name}_vs_plain']:.2f}x time, "
            f"{r[f'memory_{name}_vs_plain']:.2f}x memory"
            for name in ("clipped_grad_1pass", "clipped_grad_2pass", "norms_only")
            if f"time_{name}_vs_plain" in r
        ]
        if routes:
            lines.append(f"  - {label}, against plain: " + "; ".join(routes))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, short timing")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--min-time", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cases", nargs="+", default=["mlp", "transformer", "gpt", "gpt-noremat"])
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    min_time = args.min_time or (0.02 if args.quick else 0.5)
    out_path = args.out or (RESULTS.with_name("clipping_quick.json") if args.quick else RESULTS)
    start = time.perf_counter()
    load = list(os.getloadavg())
    results = {}
    for name in args.cases:
        default = [32, 128] if name.startswith("gpt") else [64, 256]
        batches = args.batches or ([4, 8] if args.quick else default)
        for batch in batches:
            case = make_case(name, batch, args.quick)
            print(f"running {case['label']} ...", flush=True)
            results[case["label"]] = run_case(case, reps, min_time)
            save(out_path, results, args, reps, min_time, load, start)  # case by case
    text = save(out_path, results, args, reps, min_time, load, start)
    print(text)
    print(f"wrote {out_path}")
    return json.loads(out_path.read_text())


def save(out_path: Path, results: dict, args, reps: int, min_time: float, load, start) -> str:
    """Writes what has been measured so far; returns its table."""
    text = table(results)
    saved = {
        "machine": {
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "platform": platform.platform(),
            "cores": os.cpu_count(),
            "jax_backend": jax.default_backend(),
            "torch_threads": TORCH_THREADS,
            "load_average_start": load,
            "load_average_end": list(os.getloadavg()),
        },
        "settings": {"quick": args.quick, "reps": reps, "min_time": min_time, "max_norm": MAX_NORM},
        "cases": results,
        "table": text,
        "wall_s": time.perf_counter() - start,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(saved, indent=1))
    return text


if __name__ == "__main__":
    main()

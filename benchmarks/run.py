"""Runs every jhooks benchmark, prints the tables and writes them as JSON (and Markdown).

```
bash scripts/bench.sh            # sets up .venv, then: python -m benchmarks.run
python -m benchmarks.run --quick # a short smoke run
```

Every figure is a ratio of two variants measured side by side in this one process:
the variants are run in turn, round after round (`--reps` rounds, each variant
running enough steps to last `--min-time` seconds), and each ratio is the median over
the rounds of the ratio within a round. Steps are timed until `block_until_ready`.

Cases:

1. a jitted Equinox + optax training step (`eqx.filter_jit`), hooked vs plain;
2. the same step in PyTorch eager (and `torch.compile`) with the same model, hooks
   and batch;
3. the trace + compile time of the step with hooks on every layer vs none, for MLPs of
   growing depth;
4. the compiled memory (`memory_analysis()`) and XLA operations of the hooked step vs
   the plain one.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import torch

import jhooks

from . import hooks as H
from .models import Case, block_case, cnn_case, copy_weights, mlp_case

HAS_MODULE_HOOKS = hasattr(jhooks, "hookable") and hasattr(jhooks, "named_modules")
LR = 1e-2
HOOK_SETS = ("identity", "clip", "host")
TORCH_THREADS = torch.get_num_threads()  # PyTorch's default
# PyTorch eager is timed with its default threads and with one thread (`torch1`):
# on a small shared machine its default can be the slower of the two by far.
TORCH_KINDS = {"torch": TORCH_THREADS, "torch1": 1}

# --------------------------------------------------------------------------- targets

IDENTITY_STEP = 1.02
CLIP_STEP = 1.10
VS_TORCH = {"mlp8x64": 0.5, "cnn": 0.5, "mlp8x256": 0.8}
COMPILE_RATIO = 1.3
# Linear growth: the hooked compile time per layer at the deepest depth is at most this
# multiple of the one at the middle depth (a quadratic cost would give depth ratio 4).
COMPILE_LINEAR = 1.5


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "gpu": jax.default_backend() == "gpu",
        "torch_threads": torch.get_num_threads(),
        "load_average_start": list(os.getloadavg()),
        "jhooks_commit": commit,
        "versions": {
            name: version(name)
            for name in ("jhooks", "jax", "jaxlib", "equinox", "optax", "torch", "numpy")
        },
        "module_hooks_available": HAS_MODULE_HOOKS,
    }


# --------------------------------------------------------------------------- timing


class Timed:
    """A function run in a timed loop: `step()` runs one step, `block()` waits for it."""

    def __init__(
        self,
        step: Callable[[], Any],
        block: Callable[[], Any] = lambda: None,
        threads: int | None = None,
    ):
        self.step = step
        self.block = block
        self.threads = threads  # PyTorch's intra-op threads while this runs
        self.inner = 1

    def run(self, n: int) -> float:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        start = time.perf_counter()
        for _ in range(n):
            self.step()
        self.block()
        return (time.perf_counter() - start) / n

    def calibrate(self, min_time: float) -> None:
        n = 1
        while True:
            elapsed = self.run(n) * n
            if elapsed >= min_time or n >= 1 << 16:
                break
            n = max(n * 2, int(n * 1.2 * min_time / max(elapsed, 1e-9)))
        self.inner = n


def interleave(timed: dict[str, Timed], reps: int, min_time: float) -> dict[str, list[float]]:
    """Per-step times of every variant, round after round, in a rotating order."""
    for t in timed.values():
        t.run(2)
        t.calibrate(min_time)
    names = list(timed)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed[name].run(timed[name].inner))
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


# --------------------------------------------------------------------------- JAX side


def make_jax_step(loss_fn: Callable, optim: optax.GradientTransformation) -> Callable:
    @eqx.filter_jit
    def step(batch: tuple, model: Any, opt_state: Any) -> tuple:
        x, y = batch
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        return loss, eqx.apply_updates(model, updates), opt_state

    return step


def jax_variant(case: Case, flavor: str, hooks: str) -> tuple[Any, Callable, list]:
    """`(model, loss_fn, handles)` for one variant of `case`."""
    if flavor == "plain":
        model = case.eqx_model()
        return model, lambda m, x, y: case.jax_loss(m(x), y), []
    if flavor == "value":
        model = case.eqx_model()
        if hooks == "host":

            def loss_fn(m: Any, x: Any, y: Any) -> Any:
                return case.jax_loss(jhooks.register_hook(m(x), H.log_grad_norm), y)

            return model, loss_fn, []
        tap = H.value_tap(hooks)
        return model, lambda m, x, y: case.jax_loss(m(x, tap), y), []
    net = jhooks.hookable(case.eqx_model())  # type: ignore[attr-defined]
    handles = H.install_module_hooks(net, hooks)
    return net, lambda m, x, y: case.jax_loss(m(x), y), handles


def count_ops(hlo_text: str) -> dict[str, int]:
    """How many of each XLA operation an optimized HLO module holds (fusion bodies too)."""
    ops: collections.Counter[str] = collections.Counter()
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
        if m and m.group(1) != "parameter":
            ops[m.group(1)] += 1
    return dict(sorted(ops.items()))


def count_lowered_ops(mlir_text: str) -> dict[str, int]:
    """How many of each operation the lowered (not yet optimized) StableHLO holds."""
    ops = collections.Counter(re.findall(r"\b((?:stablehlo|chlo|func)\.[a-z_]+)\b", mlir_text))
    return dict(sorted(ops.items()))


def compiled_stats(step: Callable, args: tuple) -> dict[str, Any]:
    """Trace + lower time, compile time, memory and operations of `step(*args)`."""
    t0 = time.perf_counter()
    lowered = step.lower(*args)  # type: ignore[attr-defined]
    t1 = time.perf_counter()
    runnable = lowered.compile()
    t2 = time.perf_counter()
    compiled = runnable.compiled
    mem = compiled.memory_analysis()
    memory = {
        key: int(getattr(mem, key + "_in_bytes"))
        for key in ("argument_size", "output_size", "alias_size", "temp_size")
    }
    return {
        "trace_lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "memory": memory,
        "ops": count_ops(compiled.as_text()),
        "lowered_ops": count_lowered_ops(lowered.as_text()),
    }


# --------------------------------------------------------------------------- PyTorch side


def torch_variant(case: Case, flavor: str, hooks: str, source: Any) -> tuple[Any, Callable, list]:
    """`(model, forward, handles)`: a PyTorch copy of `source` with the variant's hooks."""
    model = case.torch_model()
    copy_weights(source, model)
    handles: list = []
    if flavor == "plain":
        return model, model, handles
    if flavor == "value":
        if hooks == "host":

            def forward(x: torch.Tensor) -> torch.Tensor:
                out = model(x)
                out.register_hook(H.torch_log_grad_norm)
                return out

            return model, forward, handles
        tap = H.torch_value_tap(hooks)
        return model, lambda x: model(x, tap), handles
    handles = H.install_torch_module_hooks(model, hooks)
    return model, model, handles


def torch_step(case: Case, model: Any, forward: Callable, x: Any, y: Any) -> Callable:
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = case.torch_loss(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


def torch_compiled(
    case: Case, flavor: str, hooks: str, source: Any, x: Any, y: Any, limit: int
) -> tuple[dict[str, Any], Callable | None]:
    """Tries `torch.compile` on the variant: `(report, step or None)`.

    The report says whether it compiled within `limit` seconds, how many graph breaks
    Dynamo took, and whether its gradients equal those of PyTorch eager with the same
    hooks (so the hooks ran as they do in eager mode).
    """
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)  # as it is timed
    breaks_before = sum(counters["graph_break"].values())
    model, _, _ = torch_variant(case, flavor, hooks, source)
    eager, eager_forward, _ = torch_variant(case, flavor, hooks, source)
    compiled = torch.compile(model)
    forward: Callable
    if flavor == "value":
        tap = H.torch_value_tap(hooks)
        forward = lambda x: compiled(x, tap)  # noqa: E731
    else:
        forward = compiled
    report: dict[str, Any] = {}
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    start = time.perf_counter()
    try:
        case.torch_loss(forward(x), y).backward()
        report["compile_s"] = time.perf_counter() - start
        report["status"] = "compiled"
    except _Timeout:
        report["status"] = f"timed out after {limit} s"
    except Exception as e:  # noqa: BLE001 - any failure is a finding to report
        report["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    report["graph_breaks"] = sum(counters["graph_break"].values()) - breaks_before
    if report["status"] != "compiled":
        return report, None
    case.torch_loss(eager_forward(x), y).backward()
    report["grads_match_eager"] = all(
        torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
        for a, b in zip(model.parameters(), eager.parameters())
    )
    return report, torch_step(case, model, forward, x, y)


# --------------------------------------------------------------------------- case 1, 2, 4


def variant_names() -> list[tuple[str, str, str]]:
    """`(name, flavor, hooks)` of every jhooks variant."""
    out = [("plain", "plain", "none")]
    out += [(f"value:{h}", "value", h) for h in HOOK_SETS]
    if HAS_MODULE_HOOKS:
        out += [("module:idle", "module", "idle")]
        out += [(f"module:{h}", "module", h) for h in HOOK_SETS]
    return out


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


# --------------------------------------------------------------------------- case 3


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


# --------------------------------------------------------------------------- host callbacks


def host_callback_cost(reps: int, min_time: float) -> dict[str, Any]:
    """What one host callback costs by itself: a tiny jitted function, with and without.

    A host hook (`jhooks.host`) is one `jax.debug.callback`; this is its floor.
    """
    print("\n== host callback cost", flush=True)
    sink: list = []
    x = jnp.ones(16)

    def observe(v: Any) -> None:
        sink.append(v)

    fns = {
        "no callback": jax.jit(lambda x: x * 2),
        "jax.debug.callback": jax.jit(
            lambda x: (jax.debug.callback(observe, x.sum(), ordered=False), x * 2)[1]
        ),
        "jax.debug.callback ordered": jax.jit(
            lambda x: (jax.debug.callback(observe, x.sum(), ordered=True), x * 2)[1]
        ),
        "jhooks.host": jax.jit(lambda x: (jhooks.host(observe)(x.sum()), x * 2)[1]),
    }
    out: dict[str, Any] = {}
    timed = {}
    for name, fn in fns.items():
        box: dict[str, Any] = {}

        def run(fn: Callable = fn, box: dict = box) -> None:
            box["y"] = fn(x)

        timed[name] = Timed(run, lambda box=box: jax.block_until_ready(box["y"]))
    times = interleave(timed, reps, min_time)
    for name, ts in times.items():
        out[name] = {"call_s": statistics.median(ts), "times_s": ts}
    return out


def cache_memory() -> list[list[str]]:
    """The table of `benchmarks/cache_memory.py` (run_with_cache vs by hand), in MiB."""
    from . import cache_memory as cm

    print("\n== run_with_cache memory", flush=True)
    return [cm.row(*config) for config in [(8, 256, 128), (8, 1024, 256), (16, 512, 512)]]


# --------------------------------------------------------------------------- target checks


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def add(target: str, where: str, value: Any, limit: Any, ok: bool) -> None:
        checks.append(
            {"target": target, "where": where, "value": value, "limit": limit, "pass": bool(ok)}
        )

    for case_name, res in results["steps"].items():
        ratios = res["ratios"]
        variants = res["variants"]
        plain = variants["jhooks plain"]
        for name, _flavor, hooks in variant_names():
            key = f"jhooks {name}"
            if hooks in ("identity", "idle"):
                r = ratios[f"{key} / jhooks plain"]
                add(
                    "identity hooks: step time / plain",
                    f"{case_name} {name}",
                    r,
                    IDENTITY_STEP,
                    r <= IDENTITY_STEP,
                )
                same = variants[key]["ops"] == plain["ops"]
                lowered_same = variants[key]["lowered_ops"] == plain["lowered_ops"]
                add(
                    "identity hooks: same compiled operations",
                    f"{case_name} {name}",
                    "same"
                    if same
                    else f"optimized HLO: {_ops_diff(variants[key]['ops'], plain['ops'])}; "
                    f"lowered ops: {'same' if lowered_same else 'differ'}",
                    "same",
                    same,
                )
                mem = variants[key]["memory"] == plain["memory"]
                add(
                    "identity hooks: same memory",
                    f"{case_name} {name}",
                    variants[key]["memory"]["temp_size"],
                    plain["memory"]["temp_size"],
                    mem,
                )
            if hooks == "clip":
                r = ratios[f"{key} / jhooks plain"]
                add(
                    "gradient-modifying hooks: step time / plain",
                    f"{case_name} {name}",
                    r,
                    CLIP_STEP,
                    r <= CLIP_STEP,
                )
            if case_name in VS_TORCH and hooks not in ("idle", "none"):
                # Against the faster of PyTorch's thread settings: the larger ratio.
                r = max(ratios[f"{key} / {kind} {name}"] for kind in TORCH_KINDS)
                limit = VS_TORCH[case_name]
                add(
                    "jhooks hooked / PyTorch eager hooked",
                    f"{case_name} {name}",
                    r,
                    limit,
                    r <= limit,
                )
    cost = results.get("compile_cost") or {}
    depths = sorted(int(d) for d in cost)
    for depth in depths:
        for name, row in cost[str(depth)].items():
            if name != "plain":
                r = row["ratio_to_plain"]
                add(
                    "compile time, hooks on every layer / none",
                    f"depth {depth} {name}",
                    r,
                    COMPILE_RATIO,
                    r <= COMPILE_RATIO,
                )
    if len(depths) >= 2:
        mid, top = depths[-2], depths[-1]
        for name in cost[str(top)]:
            if name == "plain":
                continue
            growth = (cost[str(top)][name]["total_s"] / top) / (
                cost[str(mid)][name]["total_s"] / mid
            )
            add(
                "compile time grows linearly: per-layer time, deepest / next",
                f"{name} {top} vs {mid} layers",
                growth,
                COMPILE_LINEAR,
                growth <= COMPILE_LINEAR,
            )
    return checks


def _ops_diff(a: dict[str, int], b: dict[str, int]) -> str:
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k} {b.get(k, 0)}->{a.get(k, 0)}" for k in keys if a.get(k) != b.get(k))


# --------------------------------------------------------------------------- output


def _fmt(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def table(headers: list[str], rows: list[list[Any]], markdown: bool = False) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def report(results: dict[str, Any], markdown: bool = False) -> str:
    out = []
    m = results["machine"]
    out.append(
        f"Machine: {m['cpu']}, {m['cores']} cores, backend {m['jax_backend']}, "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + f"; torch threads {m['torch_threads']}."
    )
    head = "### " if markdown else ""
    for case_name, res in results["steps"].items():
        v = res["variants"]
        out.append(f"\n{head}Training step: {case_name} ({res['description']})\n")
        rows = []
        for name, _flavor, hooks in variant_names():
            row: list[Any] = [name, f"{v['jhooks ' + name]['step_s'] * 1e6:.0f}"]
            r = res["ratios"].get(f"jhooks {name} / jhooks plain")
            row.append(f"{r:.3f}" if r is not None else "1")
            for other in (*TORCH_KINDS, "torch.compile"):
                key = f"{other} {name}"
                if hooks == "idle":
                    row += ["", ""]
                elif key in v:
                    ratio = res["ratios"][f"jhooks {name} / {key}"]
                    row += [f"{v[key]['step_s'] * 1e6:.0f}", f"{ratio:.3f}"]
                else:
                    row += ["-", "-"]
            rows.append(row)
        out.append(
            table(
                [
                    "variant",
                    "jhooks µs",
                    "/ plain",
                    f"eager µs ({TORCH_THREADS}T)",
                    "jhooks / eager",
                    "eager µs (1T)",
                    "jhooks / eager 1T",
                    "compile µs (1T)",
                    "jhooks / compiled",
                ],
                rows,
                markdown,
            )
        )
        mem_rows = []
        plain = v["jhooks plain"]
        for name, _, _ in variant_names():
            s = v["jhooks " + name]
            mem_rows.append(
                [
                    name,
                    s["memory"]["temp_size"],
                    s["memory"]["argument_size"],
                    s["memory"]["output_size"],
                    sum(s["ops"].values()),
                    "same" if s["ops"] == plain["ops"] else _ops_diff(s["ops"], plain["ops"]),
                    sum(s["lowered_ops"].values()),
                    "same"
                    if s["lowered_ops"] == plain["lowered_ops"]
                    else _ops_diff(s["lowered_ops"], plain["lowered_ops"]),
                ]
            )
        out.append("")
        out.append(
            table(
                [
                    "variant",
                    "temp B",
                    "argument B",
                    "output B",
                    "optimized HLO ops",
                    "vs plain",
                    "lowered ops",
                    "vs plain",
                ],
                mem_rows,
                markdown,
            )
        )
        if res["torch_compile"]:
            out.append("")
            tc_rows = [
                [
                    n,
                    r["status"],
                    _fmt(r.get("compile_s", "-")),
                    r["graph_breaks"],
                    _fmt(r.get("grads_match_eager", "-")),
                ]
                for n, r in res["torch_compile"].items()
            ]
            out.append(
                table(
                    [
                        "torch.compile variant",
                        "status",
                        "compile s",
                        "graph breaks",
                        "grads = eager",
                    ],
                    tc_rows,
                    markdown,
                )
            )
        lc = res["loss_check"]
        out.append(
            f"\nFirst loss, same weights and batch: jax {lc['jax_loss']:.6f}, "
            f"torch {lc['torch_loss']:.6f}."
        )
    cost = results.get("compile_cost")
    if cost:
        out.append(f"\n{head}Compile cost (trace + lower + compile), MLP width 64\n")
        names = list(next(iter(cost.values())))
        rows = []
        for depth, row in cost.items():
            r = [depth]
            for n in names:
                r.append(f"{row[n]['total_s']:.2f}")
                if n != "plain":
                    r.append(f"{row[n]['ratio_to_plain']:.3f}")
            rows.append(r)
        headers = ["layers"]
        for n in names:
            headers.append(f"{n} s")
            if n != "plain":
                headers.append("/ plain")
        out.append(table(headers, rows, markdown))
    host = results.get("host_callback")
    if host:
        out.append(f"\n{head}Host callback cost (a tiny jitted function)\n")
        base = host["no callback"]["call_s"]
        out.append(
            table(
                ["function", "µs per call", "added µs"],
                [
                    [n, f"{r['call_s'] * 1e6:.0f}", f"{(r['call_s'] - base) * 1e6:.0f}"]
                    for n, r in host.items()
                ],
                markdown,
            )
        )
    if results.get("cache_memory"):
        from .cache_memory import HEADER as cache_memory_header

        out.append(
            f"\n{head}run_with_cache memory, MiB of temp + output (benchmarks/cache_memory.py)\n"
        )
        out.append(table(cache_memory_header, results["cache_memory"], markdown))
    out.append(f"\n{head}Targets\n")
    out.append(
        table(
            ["target", "where", "value", "limit", "result"],
            [
                [
                    c["target"],
                    c["where"],
                    c["value"] if not isinstance(c["value"], float) else f"{c['value']:.3f}",
                    c["limit"],
                    "PASS" if c["pass"] else "MISS",
                ]
                for c in results["targets"]
            ],
            markdown,
        )
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    with warnings.catch_warnings():
        # PyTorch warns whenever a full backward hook fires on a module whose inputs
        # need no gradient (the first layer of every model here): expected, as in jhooks.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _main(argv)


def _main(argv: list[str] | None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--cases", nargs="*", help="model cases to run (default: all)")
    parser.add_argument("--reps", type=int, help="timing rounds (default 15, quick 3)")
    parser.add_argument("--min-time", type=float, help="seconds per variant per round")
    parser.add_argument("--depths", type=int, nargs="*", help="compile-cost depths")
    parser.add_argument(
        "--no-torch-compile", dest="torch_compile", action="store_false", default=None
    )
    parser.add_argument(
        "--torch-compile-limit", type=int, default=180, help="seconds allowed for one torch.compile"
    )
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/cpu.json)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.reps = args.reps or (3 if quick else 21)
    args.min_time = args.min_time or (0.005 if quick else 0.05)
    args.depths = args.depths or ([2, 4] if quick else [8, 32, 128])
    if args.torch_compile is None:
        args.torch_compile = not quick
    args.torch_compile_variants = {"plain", "value:clip", "module:identity", "module:clip"}
    backend = jax.default_backend()
    out_path = args.out or Path(__file__).parent / "results" / f"{backend}.json"

    all_cases = {
        "mlp8x64": lambda: mlp_case(64),
        "mlp8x256": lambda: mlp_case(256),
        "cnn": cnn_case,
        "transformer": block_case,
    }
    if quick:
        all_cases["mlp2x16"] = lambda: mlp_case(16, depth=2, batch=8)
    names = args.cases or (["mlp2x16"] if quick else ["mlp8x64", "mlp8x256", "cnn", "transformer"])
    results: dict[str, Any] = {
        "machine": machine_info(),
        "settings": {
            "quick": quick,
            "reps": args.reps,
            "min_time_s": args.min_time,
            "lr": LR,
            "clip": H.CLIP,
            "depths": args.depths,
            "torch_compile": args.torch_compile,
        },
        "steps": {},
    }
    start = time.perf_counter()
    for name in names:
        results["steps"][name] = bench_case(all_cases[name](), args)
    results["host_callback"] = host_callback_cost(args.reps, args.min_time)
    if not quick:
        results["cache_memory"] = cache_memory()
    results["compile_cost"] = compile_cost(args.depths, 1 if quick else 3, warm_up=not quick)
    results["targets"] = check_targets(results)
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["wall_s"] = time.perf_counter() - start
    text = report(results)
    print("\n" + text)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1))
    out_path.with_suffix(".md").write_text(report(results, markdown=True) + "\n")
    print(f"\nwrote {out_path} and {out_path.with_suffix('.md')} in {results['wall_s']:.0f} s")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

"""DP-SGD with `jhooks.clipped_grad`, data parallel on 1 to 8 devices and on two processes.

```
.venv/bin/python -m benchmarks.scaling           # the full run; writes results/scaling_cpu.json
.venv/bin/python -m benchmarks.scaling --quick   # a short smoke run (a tiny model)
```

For each size the step runs in a fresh process (`benchmarks/scaling_step.py`), since
`XLA_FLAGS=--xla_force_host_platform_device_count=N` must be set before JAX is imported:
1, 2, 4 and 8 simulated CPU devices in one process, then two processes joined by
`jax.distributed` (gloo CPU collectives), 2 devices each, one 4-device mesh. The global
batch is the same everywhere, split over the devices; the parameters are replicated.

In each, the DP-SGD step (clipped sum, Gaussian noise, SGD) and the plain sharded step
(`jax.grad` of the mean loss, SGD) are timed in interleaved rounds (`timing.interleave`;
in two processes each round runs the same number of steps in both, agreed beforehand).
Reported: time per example of each, the ratio clipped / plain (median over the rounds of
the ratio within a round), that ratio against the 1-device ratio (target: at most
`TARGET`), the same ratio of the process's CPU time (less sensitive to the machine's other
load), and the collectives of each compiled program. Simulated devices share this
machine's cores: they speed nothing up, so the time per example is no scaling curve; what
carries over to real devices is the ratio to the plain step and the collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .machine import machine_info
from .processes import free_port, run_together
from .tables import table
from .timing import paired_ratio

TARGET = 1.1  # clipped/plain at each size, over clipped/plain on one device
ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "scaling_cpu.json"
TIMEOUT_S = 600
VARIANTS = ("plain", "clipped", "dp_sgd")  # the steps of `scaling_step.make_steps`


def child_env(devices: int) -> dict[str, str]:
    """This environment with `devices` host devices and no persistent compilation cache."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    for name in list(env):
        if name.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_NUM_CPU")):
            del env[name]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def spawn(options: list[dict[str, Any]], devices: int, folder: Path) -> list[dict[str, Any]]:
    """Runs one `scaling_step` process per entry of `options`, together; their results.

    As soon as one fails, or at the deadline, the others are killed (they would wait for
    their peer); the error names the process and ends with its stderr.
    """
    commands = [
        [
            sys.executable,
            "-m",
            "benchmarks.scaling_step",
            json.dumps(opts),
            str(folder / f"result{i}.json"),
        ]
        for i, opts in enumerate(options)
    ]
    logs = [(None, folder / f"err{i}.txt") for i in range(len(options))]
    codes = run_together(commands, logs, child_env(devices), TIMEOUT_S, cwd=ROOT)
    for i, code in enumerate(codes):
        if code != 0:
            stderr = (folder / f"err{i}.txt").read_text()[-3000:]
            raise RuntimeError(
                f"scaling_step process {i} of {len(codes)} ({devices} devices) exited with "
                f"{code} (negative: killed at the {TIMEOUT_S} s deadline or by a "
                f"failing peer):\n{stderr}"
            )
    return [json.loads((folder / f"result{i}.json").read_text()) for i in range(len(codes))]


def run_setup(base: dict[str, Any], devices: int, processes: int) -> dict[str, Any]:
    """One setup's result (process 0's, for several processes), tried twice on new ports
    when another program took the coordinator's port."""
    for attempt in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            if processes == 1:
                return spawn([base], devices, Path(tmp))[0]
            coordinator = f"localhost:{free_port()}"
            options = [
                base | {"coordinator": coordinator, "processes": processes, "process_id": i}
                for i in range(processes)
            ]
            try:
                return spawn(options, devices, Path(tmp))[0]
            except RuntimeError as error:
                if attempt == 1 or "in use" not in str(error):
                    raise
    raise AssertionError("unreachable")


def summarize(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    times, batch = raw["times_s"], raw["batch"]
    step = {variant: statistics.median(t) for variant, t in times.items()}
    return {
        "setup": name,
        "devices": raw["devices"],
        "processes": raw["processes"],
        "batch": batch,
        "step_s": step,
        "per_example_s": {variant: s / batch for variant, s in step.items()},
        "ratios": {v: paired_ratio(times, v, "plain") for v in VARIANTS if v != "plain"},
        "cpu_ratios": {
            v: paired_ratio(raw["cpu_times_s"], v, "plain") for v in VARIANTS if v != "plain"
        },
        "load_average": raw["load_average"],
        "collectives": raw["collectives"],
        "raw": raw,
    }


def fmt_collectives(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none"


def report(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        f"MLP {s['depth']}x{s['width']}, global batch {s['batch']}, median of {s['reps']} "
        f"interleaved rounds, {results['machine']['cores']} cores; ratios: median over the "
        f"rounds; 'vs 1 device': the ratio over the 1-device ratio (target <= {TARGET}); "
        "CPU: the ratio of process 0's CPU time; load: the 1-minute load average at the start"
    ]
    headers = ["setup", "plain µs/ex", "clipped µs/ex", "DP-SGD µs/ex"]
    headers += ["clipped/plain", "vs 1 device", "DP-SGD/plain", "vs 1 device"]
    headers += ["clipped/plain CPU", "load"]
    rows = []
    for r in results["setups"]:
        row = [r["setup"]] + [f"{r['per_example_s'][v] * 1e6:.1f}" for v in VARIANTS]
        for v in ("clipped", "dp_sgd"):
            verdict = "PASS" if r["pass"][v] else "MISS"
            row += [f"{r['ratios'][v]:.3f}", f"{r['vs_one_device'][v]:.3f} {verdict}"]
        row.append(f"{r['cpu_ratios']['clipped']:.3f}")
        row.append(f"{r['load_average']['start'][0]:.1f}")
        rows.append(row)
    lines.append(table(headers, rows))
    lines.append("\nCollectives in each compiled program (plain / clipped / DP-SGD):")
    for r in results["setups"]:
        counts = [fmt_collectives(r["collectives"][v]) for v in VARIANTS]
        lines.append(f"  {r['setup']}: " + " / ".join(counts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny model, a short run")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--processes", type=int, default=2, help="processes of 2 devices each (0: none)"
    )
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--min-time", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if 1 not in args.sizes:
        parser.error("--sizes must include 1: every ratio is compared to one device")
    width, depth, batch = (16, 2, 16) if args.quick else (512, 4, 256)
    reps = args.reps or (2 if args.quick else 15)
    min_time = args.min_time if args.min_time is not None else (0.01 if args.quick else 1.0)
    base = {"width": width, "depth": depth, "batch": batch, "reps": reps, "min_time": min_time}
    start = time.perf_counter()
    setups = []
    for n in sorted(args.sizes):
        name = f"1 process, {n} device{'s' if n > 1 else ''}"
        setups.append(summarize(name, run_setup(base, n, 1)))
    if args.processes:
        name = f"{args.processes} processes x 2 devices"
        setups.append(summarize(name, run_setup(base, 2, args.processes)))
    per_device = batch // max(args.sizes)
    if per_device != batch:  # one device with the batch each of the most devices holds
        name = f"1 process, 1 device, batch {per_device}"
        setups.append(summarize(name, run_setup(base | {"batch": per_device}, 1, 1)))
    one = setups[0]["ratios"]
    for r in setups:
        r["vs_one_device"] = {v: r["ratios"][v] / one[v] for v in one}
        r["pass"] = {v: x <= TARGET for v, x in r["vs_one_device"].items()}
    results = {
        "machine": machine_info(),
        "settings": base | {"quick": args.quick, "target": TARGET},
        "setups": setups,
        "wall_s": time.perf_counter() - start,
    }
    print(report(results))
    out = args.out or (None if args.quick else RESULTS)
    if out is not None:
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()

"""Runs every jhooks benchmark, prints the tables and writes them as JSON (and Markdown).

```
bash scripts/bench.sh             # sets up .venv, then: python -m benchmarks.run
python -m benchmarks.run --quick  # a short smoke run
python -m benchmarks.run --strict # exit status 1 if any target is missed
```

Exit status: 0 when every benchmark ran and its results were written; 1 when one failed
with an error (the traceback says which), or with `--strict` when a target is missed; 2 for
bad arguments. A MISS is a finding, not an error, unless `--strict` is given: timing targets
depend on the machine and its load, so a full run on a shared CPU records them and goes on.

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

5. the cost of a warm `run_with_hooks` call (its guards) and the memory of 2,000-call
   sweeps of fresh hooks (`run_overhead.py`).

The code: `training_step.py` (cases 1, 2, 4), `compile_cost.py` (case 3), `host_callback.py`,
`cache_memory.py` and `run_overhead.py` measure; `jax_side.py`, `torch_side.py`, `timing.py`,
`xla_stats.py`, `machine.py` and `settings.py` are what they share; `targets.py` checks the
figures (PASS or MISS) and `tables.py` prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax

from . import cache_memory, run_overhead
from . import hooks as H
from .compile_cost import compile_cost
from .host_callback import host_callback_cost
from .machine import machine_info
from .models import block_case, cnn_case, mlp_case
from .settings import LR, variant_names
from .tables import report
from .targets import check_targets
from .training_step import bench_case

__all__ = ["cli", "main", "variant_names"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    with warnings.catch_warnings():
        # PyTorch warns whenever a full backward hook fires on a module whose inputs
        # need no gradient (the first layer of every model here): expected, as in jhooks.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _main(argv)


def _main(argv: list[str] | None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Exit status: 0 ok; 1 an error, or a missed target with --strict; 2 bad arguments.",
    )
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
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 if any target is missed"
    )
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
            "strict": args.strict,
        },
        "steps": {},
    }
    start = time.perf_counter()
    for name in names:
        results["steps"][name] = bench_case(all_cases[name](), args)
    results["host_callback"] = host_callback_cost(args.reps, args.min_time)
    if not quick:
        print("\n== run_with_cache memory", flush=True)
        results["cache_memory"] = cache_memory.rows()
    print("\n== run_with_hooks overhead and sweeps of fresh hooks", flush=True)
    results["run_overhead"] = run_overhead.measure(quick)
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


def cli(argv: list[str] | None = None) -> int:
    """Runs `main` and returns the exit status (see the module docstring)."""
    results = main(argv)
    misses = [t for t in results["targets"] if not t["pass"]]
    if misses:
        print(f"{len(misses)} of {len(results['targets'])} targets missed (MISS above).")
        if results["settings"]["strict"]:
            print("error: a target was missed and --strict was given", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())

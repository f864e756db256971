"""What hooks on values cost: an eager run's graph break (issue 42).

```
python -m benchmarks.values          # 41 rounds
python -m benchmarks.values --quick  # 7 rounds
```

A 12-layer MLP (width 256, batch 64) with a point after each layer, run with
`run_with_hooks` outside any jit, against the plain jitted model, interleaved round by
round (`run_overhead.side_by_side`: the medians of each, and of their difference paired
round by round):

- a pure hook at one point and at every point (compiled into the program; no host
  callback): what the run itself adds, whatever its hooks do;
- a counting hook (it writes: it runs on values) at one point, and at all 12: what a
  hook on values adds per point per call over the same run with a pure hook at the same
  points (target: at most 100 µs), the larger of the one-point and the 12-point figure;
- a printing hook (to a buffer) at one of the 12 points: the run against the plain
  jitted model (target: at most 2x).

The run's own overhead (the pure rows) is `benchmarks.run_overhead`'s to meet; the
figures against the plain jitted model are reported beside it (`first_point_us`: a
counting hook at one point, the run's overhead included).

Writes `benchmarks/results/values_<backend>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jhooks

from .run_overhead import side_by_side

TARGETS = {"per_point_us": 100.0, "print_ratio": 2.0}
LAYERS, WIDTH, BATCH = 12, 256, 64
RNG = np.random.default_rng(0)
WS = jnp.asarray(RNG.normal(size=(LAYERS, WIDTH, WIDTH)).astype(np.float32) / WIDTH**0.5)
X = jnp.asarray(RNG.normal(size=(BATCH, WIDTH)).astype(np.float32))


def model(ws, x):
    for i in range(LAYERS):
        x = jhooks.hook_point(jnp.tanh(x @ ws[i]), f"layer{i}")
    return x


def measure(quick: bool) -> dict[str, Any]:
    rounds, n = (7, 10) if quick else (41, 20)
    plain = jax.jit(model)
    floor = lambda: plain(WS, X)  # noqa: E731
    count = [0]

    def counting(z, name):
        count[0] += 1

    buffer = io.StringIO()

    def printing(z, name):
        print(name, float(z.mean()), file=buffer)

    def run(hooks):
        return lambda: jhooks.run_with_hooks(model, WS, X, fwd_hooks=hooks)

    every = [(f"layer{i}", None) for i in range(LAYERS)]
    cases = {
        "pure hook at 1 point": run([("layer5", lambda z, _: z * 1.0)]),
        "pure hook at 12 points": run([(n, lambda z, _: z * 1.0) for n, _ in every]),
        "counting hook at 1 point": run([("layer5", counting)]),
        "counting hook at 12 points": run([(n, counting) for n, _ in every]),
        "printing hook at 1 of 12 points": run([("layer5", printing)]),
    }
    results: dict[str, Any] = {"us": {}, "plain_us": {}, "added_us": {}}
    with contextlib.redirect_stdout(io.StringIO()):
        for name, fn in cases.items():
            mine, base, added = side_by_side(fn, floor, rounds, n)
            results["us"][name] = mine * 1e6
            results["plain_us"][name] = base * 1e6
            results["added_us"][name] = added * 1e6
    added = results["added_us"]
    one = added["counting hook at 1 point"] - added["pure hook at 1 point"]
    twelve = added["counting hook at 12 points"] - added["pure hook at 12 points"]
    results["per_point_us"] = max(one, twelve / LAYERS)
    results["first_point_us"] = added["counting hook at 1 point"]
    results["further_point_us"] = (
        added["counting hook at 12 points"] - added["counting hook at 1 point"]
    ) / (LAYERS - 1)
    printed = "printing hook at 1 of 12 points"
    results["print_ratio"] = results["us"][printed] / results["plain_us"][printed]
    results["targets"] = [
        {
            "target": "µs per point per call, a hook on values (over a pure hook there)",
            "value": results["per_point_us"],
        },
        {"target": "printing hook at 1 of 12 points / plain jit", "value": results["print_ratio"]},
    ]
    for c, limit in zip(results["targets"], TARGETS.values()):
        c["limit"], c["pass"] = limit, c["value"] <= limit
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        f"hooks on values: {LAYERS}-layer MLP, width {WIDTH}, batch {BATCH}, eager runs "
        "against the plain jitted model, interleaved (µs per call; the machine may be shared)"
    ]
    for name, us in results["us"].items():
        lines.append(
            f"  {name:<34} {us:9.1f}   plain {results['plain_us'][name]:9.1f}"
            f"   added {results['added_us'][name]:9.1f}"
        )
    lines.append(
        f"  a hook on values at 1 point against plain jit (the run's overhead included): "
        f"{results['first_point_us']:.1f} µs; each further point: "
        f"{results['further_point_us']:.1f} µs"
    )
    for c in results["targets"]:
        lines.append(
            f"  {'PASS' if c['pass'] else 'MISS'} {c['target']}: {c['value']:.2f} <= {c['limit']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="7 rounds")
    parser.add_argument("--out", type=Path, help="JSON path")
    args = parser.parse_args(argv)
    results = measure(args.quick)
    print(report(results))
    path = args.out or Path(__file__).parent / "results" / f"values_{jax.default_backend()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

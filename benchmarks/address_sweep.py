"""A 96-head patching sweep by operation address, against the same sweep by hook point.

```
python -m benchmarks.address_sweep          # writes benchmarks/results/address_sweep_cpu.json
python -m benchmarks.address_sweep --quick  # a short smoke run (smaller model)
```

The GPT-2-shaped model of `benchmarks.interp_sweep` (12 layers, 8 heads), made
hookable, so each block's call names its operations. Each head's attention pattern is
patched in turn with its value from a corrupted prompt, and the change of a logit
difference recorded, two ways:

- `address`: the model as it is, the pattern selected by its operation address
  `blocks.{i}/softmax` (the blocks of this model hold the attention themselves; in a
  model with an attention submodule it is `blocks.{i}.attn/softmax`);
- `point`: the same model with a `hook_point` placed by hand on the pattern
  (`blocks.{i}.attn.hook_pattern`).

Both compile once per name (and once more when the head number is first seen to
change); the warm sweeps are timed interleaved and their ratio reported. The machine
is shared: the ratio is the median of interleaved repetitions.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

import jhooks

from .interp_sweep import TRACES, build, forward

RESULTS = Path(__file__).parent / "results" / "address_sweep_cpu.json"
TARGET = 1.02  # address sweep / point sweep, warm


def patch_head(pattern, hook, head, source):
    return pattern.at[head].set(source[head])


def sweep(model, clean, corrupted, names, heads):
    out = np.zeros((len(names), heads), np.float32)
    for layer, name in enumerate(names):
        for head in range(heads):
            hook = functools.partial(patch_head, head=head, source=corrupted[name])
            out[layer, head] = jhooks.run_with_hooks(
                forward, model, clean, fwd_hooks=[(name, hook)]
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, few repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    opts = parser.parse_args(argv)
    layers, heads = 12, 8
    d, vocab, seq, reps = (64, 64, 8, 3) if opts.quick else (256, 1024, 32, 7)
    rng = np.random.default_rng(1)
    clean = jnp.asarray(rng.integers(0, vocab, seq))
    corrupted = clean.at[seq // 2].set((clean[seq // 2] + 1) % vocab)
    ways = {
        "address": (jhooks.hookable(build(layers, d, heads, vocab, seq)), "blocks.{}/softmax"),
        "point": (
            jhooks.hookable(build(layers, d, heads, vocab, seq, pattern_point=True)),
            "blocks.{}.attn.hook_pattern",
        ),
    }
    res: dict[str, Any] = {"settings": {"layers": layers, "heads": heads, "d_model": d, "seq": seq}}
    model = ways["address"][0]
    listing = []
    for _ in range(3):  # jhooks.ops: trace only
        start = time.perf_counter()
        found = jhooks.ops(model, clean)
        listing.append(time.perf_counter() - start)
    res["ops"] = {"operations": len(found), "seconds": statistics.median(listing)}
    results = {}
    for way, (model, pattern) in ways.items():
        names = [pattern.format(i) for i in range(layers)]
        _, cache = jhooks.run_with_cache(model, corrupted, names_filter=names)
        TRACES.clear()
        start = time.perf_counter()
        results[way] = sweep(model, clean, cache, names, heads)
        res[way] = {"compiles": len(TRACES), "first_sweep_s": time.perf_counter() - start}
        ways[way] = (model, names, cache)  # type: ignore[assignment]
    np.testing.assert_array_equal(results["address"], results["point"])
    # Warm: each patch run by address, then the same by point, call by call, so that the
    # load of a shared machine falls on both alike; the ratio is the median of the pairs'.
    calls: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(reps):
        for layer in range(layers):
            for head in range(heads):
                for way, (model, names, cache) in ways.items():
                    hook = functools.partial(patch_head, head=head, source=cache[names[layer]])
                    start = time.perf_counter()
                    float(
                        jhooks.run_with_hooks(
                            forward, model, clean, fwd_hooks=[(names[layer], hook)]
                        )
                    )
                    calls[way].append(time.perf_counter() - start)
    for way in ways:
        res[way]["warm_sweep_s"] = statistics.median(calls[way]) * layers * heads
    ratios = [a / p for a, p in zip(calls["address"], calls["point"])]
    res["ratio_address_vs_point"] = statistics.median(ratios)
    res["ratio_of_totals"] = sum(calls["address"]) / sum(calls["point"])
    res["target"] = {
        f"address <= {TARGET}x point": res["ratio_address_vs_point"] <= TARGET,
        "ops < 1 s": res["ops"]["seconds"] < 1.0,
    }
    res["note"] = "shared CPU: the ratio is the median over interleaved pairs of calls"
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    return res


def table(res: dict[str, Any]) -> str:
    s = res["settings"]
    rows = [
        f"96-head pattern patching sweep, {s['layers']} layers x {s['heads']} heads, "
        f"d_model {s['d_model']}, seq {s['seq']} (cpu)",
        f"{'selected by':<34}{'compiles':>9}{'first (s)':>11}{'warm (s)*':>10}",
    ]
    for way, label in (
        ("address", "address blocks.*/softmax"),
        ("point", "hand-placed hook_point"),
    ):
        r = res[way]
        rows.append(
            f"{label:<34}{r['compiles']:>9}{r['first_sweep_s']:>11.2f}{r['warm_sweep_s']:>10.3f}"
        )
    rows.append(
        "address / point, median over interleaved call pairs: "
        f"{res['ratio_address_vs_point']:.3f} (ratio of totals {res['ratio_of_totals']:.3f})"
        f" (target <= {TARGET}; {res['note']})"
    )
    rows.append("* warm: 96 x the median warm call")
    o = res["ops"]
    rows.append(
        f"jhooks.ops: {o['operations']} operations listed in {o['seconds']:.2f} s (trace only)"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()

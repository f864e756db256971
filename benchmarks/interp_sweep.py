"""Activation patching sweeps: compile counts and times, jhooks against PyTorch hooks.

```
python -m benchmarks.interp_sweep          # writes benchmarks/results/interp_cpu.json
python -m benchmarks.interp_sweep --quick  # a short smoke run (smaller model)
```

A GPT-2-shaped Equinox transformer (12 layers, d_model 256, 8 heads, a hook point
`blocks.{i}.attn.hook_z` per layer) and its PyTorch twin with the same weights. Each
of the 96 heads is patched in turn with its value from a corrupted prompt and the
change of a logit difference recorded:

- `obvious`: `for layer, head: jhooks.run_with_hooks(jitted_model, clean,
  fwd_hooks=[(name, functools.partial(patch, head=head, source=...))])`, as one writes
  it in a notebook; compile count, first sweep (with compiles) and second sweep;
- `vmap`: one jitted function patching every head of every layer (`jax.vmap` over a
  traced head index): first call and warm call;
- `torch`: the TransformerLens-style loop, a forward hook per patch (no_grad), the
  better of PyTorch's default thread count and one thread.

And early stop: caching one point of layer 2 of a 24-layer model with
`return_output=False`, against running a 3-layer model.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

RESULTS = Path(__file__).parent / "results" / "interp_cpu.json"
# Compiles: one per point name (12), and one more when the head number is first seen to
# change: from then on it is traced, not baked in (the run's "automatic dynamic" numbers).
TARGETS = {"compiles": 13, "warm_vs_best": 1.5, "vs_torch": 3.0, "early_stop": 1.2}
TRACES: list[int] = []
DEFAULT_THREADS = torch.get_num_threads()


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    qkv: jax.Array
    out: jax.Array
    ln2: eqx.nn.LayerNorm
    fc_in: jax.Array
    fc_out: jax.Array
    name: str = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    pattern_point: bool = eqx.field(static=True, default=False)  # see address_sweep.py

    def __call__(self, x):
        seq, d = x.shape
        q, k, v = jnp.split(jax.vmap(self.ln1)(x) @ self.qkv, 3, axis=-1)
        q, k, v = (t.reshape(seq, self.heads, d // self.heads) for t in (q, k, v))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(d // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
        pattern = jax.nn.softmax(scores, axis=-1)
        if self.pattern_point:
            pattern = jhooks.hook_point(pattern, f"{self.name}.attn.hook_pattern")
        z = jnp.einsum("hqk,khd->qhd", pattern, v)
        z = jhooks.hook_point(z, f"{self.name}.attn.hook_z")
        x = x + z.reshape(seq, d) @ self.out
        x = x + jax.nn.gelu(jax.vmap(self.ln2)(x) @ self.fc_in, approximate=True) @ self.fc_out
        return jhooks.hook_point(x, f"{self.name}.hook_resid_post")


class GPT(eqx.Module):
    embed: jax.Array
    pos: jax.Array
    blocks: list
    unembed: jax.Array

    def __call__(self, tokens):
        x = self.embed[tokens] + self.pos[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return x @ self.unembed


def build(
    layers: int, d: int, heads: int, vocab: int, seq: int, seed: int = 0, pattern_point=False
) -> GPT:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32) / math.sqrt(shape[0]))

    blocks = [
        Block(
            eqx.nn.LayerNorm(d),
            w(d, 3 * d),
            w(d, d),
            eqx.nn.LayerNorm(d),
            w(d, 4 * d),
            w(4 * d, d),
            f"blocks.{i}",
            heads,
            pattern_point,
        )  # fmt: skip
        for i in range(layers)
    ]
    return GPT(w(vocab, d), 0.1 * w(seq, d), blocks, w(d, vocab))


class TorchBlock(torch.nn.Module):
    def __init__(self, b: Block):
        super().__init__()
        t = lambda a: torch.nn.Parameter(torch.from_numpy(np.array(a)))  # noqa: E731
        self.heads = b.heads
        self.ln1, self.ln2 = (torch.nn.LayerNorm(b.qkv.shape[0]) for _ in range(2))
        self.qkv, self.out, self.fc_in, self.fc_out = (
            t(a) for a in (b.qkv, b.out, b.fc_in, b.fc_out)
        )
        self.hook_z = torch.nn.Identity()

    def forward(self, x):
        seq, d = x.shape
        q, k, v = (self.ln1(x) @ self.qkv).split(d, dim=-1)
        q, k, v = (t.reshape(seq, self.heads, d // self.heads) for t in (q, k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d // self.heads)
        causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        z = self.hook_z(
            torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, -torch.inf).softmax(-1), v)
        )
        x = x + z.reshape(seq, d) @ self.out
        return (
            x + torch.nn.functional.gelu(self.ln2(x) @ self.fc_in, approximate="tanh") @ self.fc_out
        )


class TorchGPT(torch.nn.Module):
    def __init__(self, m: GPT):
        super().__init__()
        self.embed, self.pos, self.unembed = (
            torch.from_numpy(np.array(a)) for a in (m.embed, m.pos, m.unembed)
        )
        self.blocks = torch.nn.ModuleList(TorchBlock(b) for b in m.blocks)

    def forward(self, tokens):
        x = self.embed[tokens] + self.pos[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return x @ self.unembed


ANSWER, WRONG = 3, 6


def metric(logits):
    return logits[-1, ANSWER] - logits[-1, WRONG]


def z_name(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_z"


def patch(z, hook, head, source):
    return z.at[:, head].set(source[:, head])


@eqx.filter_jit
def forward(model, tokens):
    TRACES.append(1)  # counts the traces (compiles) of the model
    return metric(model(tokens))


def sweep_obvious(model, clean, corrupted_z, layers, heads):
    out = np.zeros((layers, heads), np.float32)
    for layer in range(layers):
        for head in range(heads):
            hook = functools.partial(patch, head=head, source=corrupted_z[z_name(layer)])
            out[layer, head] = jhooks.run_with_hooks(
                forward, model, clean, fwd_hooks=[(z_name(layer), hook)]
            )
    return out


@functools.partial(jax.jit, static_argnums=(3, 4))
def sweep_vmap(model, clean, corrupted_z, layers, heads):
    def one(layer, head):
        hook = functools.partial(patch, head=head, source=corrupted_z[z_name(layer)])
        return jhooks.run_with_hooks(forward, model, clean, fwd_hooks=[(z_name(layer), hook)])

    return jnp.stack(
        [jax.vmap(functools.partial(one, i))(jnp.arange(heads)) for i in range(layers)]
    )


def sweep_torch(tmodel, clean_t, corrupted_t, layers, heads):
    out = np.zeros((layers, heads), np.float32)
    with torch.no_grad():
        for layer in range(layers):
            for head in range(heads):

                def hook(module, args, z, head=head, source=corrupted_t[layer]):  # noqa: E306
                    z = z.clone()
                    z[:, head] = source[:, head]
                    return z

                with tmodel.blocks[layer].hook_z.register_forward_hook(hook):
                    out[layer, head] = float(metric(tmodel(clean_t)))
    return out


def timed(fn, *args, reps=1):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def early_stop(d, heads, vocab, seq, reps):
    deep, shallow = build(24, d, heads, vocab, seq), build(3, d, heads, vocab, seq)
    tokens = jnp.arange(seq) % vocab
    name = "blocks.2.hook_resid_post"
    cached = eqx.filter_jit(
        lambda m, t: jhooks.run_with_cache(m, t, names_filter=name, return_output=False)[1]
    )
    three = eqx.filter_jit(lambda m, t: m(t))
    cached(deep, tokens), three(shallow, tokens)
    times = {"cache_layer2_of_24": [], "run_3_layers": []}
    for _ in range(reps):  # interleaved, median of each
        times["cache_layer2_of_24"].append(timed(cached, deep, tokens, reps=20)[1])
        times["run_3_layers"].append(timed(three, shallow, tokens, reps=20)[1])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**med, "ratio": med["cache_layer2_of_24"] / med["run_3_layers"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, few repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    opts = parser.parse_args(argv)
    layers, heads = 12, 8
    d, vocab, seq, reps = (64, 64, 8, 3) if opts.quick else (256, 1024, 32, 7)
    torch.manual_seed(0)
    model, rng = build(layers, d, heads, vocab, seq), np.random.default_rng(1)
    clean = jnp.asarray(rng.integers(0, vocab, seq))
    corrupted = clean.at[seq // 2].set((clean[seq // 2] + 1) % vocab)
    _, corrupted_z = jhooks.run_with_cache(
        model, corrupted, names_filter=lambda n: n.endswith("hook_z")
    )
    res: dict[str, Any] = {
        "settings": {
            "layers": layers,
            "heads": heads,
            "d_model": d,
            "vocab": vocab,
            "seq": seq,
            "quick": opts.quick,
        }
    }

    TRACES.clear()
    first_start = time.perf_counter()
    obvious = sweep_obvious(model, clean, corrupted_z, layers, heads)
    first = time.perf_counter() - first_start
    compiles_first = len(TRACES)
    warm = [timed(sweep_obvious, model, clean, corrupted_z, layers, heads)[1] for _ in range(reps)]
    res["obvious"] = {
        "compiles_first_sweep": compiles_first,
        "compiles_later_sweeps": len(TRACES) - compiles_first,
        "first_sweep_s": first,
        "warm_sweep_s": statistics.median(warm),
    }

    def plain_loop():  # the same 96 forwards without hooks: the floor of any loop
        return [float(forward(model, clean)) for _ in range(layers * heads)]

    plain = [timed(plain_loop)[1] for _ in range(reps)]
    res["plain_loop"] = {"sweep_s": statistics.median(plain)}

    vm, vm_first = timed(sweep_vmap, model, clean, corrupted_z, layers, heads)
    vm_warm = timed(sweep_vmap, model, clean, corrupted_z, layers, heads, reps=reps)[1]
    res["vmap"] = {"first_call_s": vm_first, "warm_call_s": vm_warm}

    tmodel = TorchGPT(model)
    clean_t = torch.from_numpy(np.array(clean))
    with torch.no_grad():
        corrupted_t = []
        hs = [
            b.hook_z.register_forward_hook(lambda m, a, z: corrupted_t.append(z))
            for b in tmodel.blocks
        ]
        tmodel(torch.from_numpy(np.array(corrupted)))
        for h in hs:
            h.remove()
    torch_times = {}
    for threads in dict.fromkeys((DEFAULT_THREADS, 1)):  # the default can be far slower
        torch.set_num_threads(threads)
        tv, torch_times[threads] = timed(
            lambda: sweep_torch(tmodel, clean_t, corrupted_t, layers, heads), reps=(reps + 1) // 2
        )
    torch.set_num_threads(DEFAULT_THREADS)
    t_time = min(torch_times.values())
    res["torch"] = {"sweep_s": t_time, "by_threads": {str(k): v for k, v in torch_times.items()}}
    base = float(forward(model, clean))
    np.testing.assert_allclose(obvious, np.asarray(vm), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(obvious, tv, rtol=1e-3, atol=1e-3 * max(1.0, abs(base)))

    res["early_stop"] = early_stop(d, heads, vocab, seq, reps)
    best = min(res["obvious"]["warm_sweep_s"], vm_warm)
    res["ratios"] = {
        "obvious_warm_vs_plain_loop": res["obvious"]["warm_sweep_s"] / res["plain_loop"]["sweep_s"],
        "obvious_warm_vs_best": res["obvious"]["warm_sweep_s"] / best,
        "torch_vs_obvious_warm": t_time / res["obvious"]["warm_sweep_s"],
    }
    res["targets"] = {
        "compiles <= 13, then 0": compiles_first <= TARGETS["compiles"]
        and res["obvious"]["compiles_later_sweeps"] == 0,
        "obvious warm <= 1.5x best": res["ratios"]["obvious_warm_vs_best"]
        <= TARGETS["warm_vs_best"],
        "torch >= 3x obvious warm": res["ratios"]["torch_vs_obvious_warm"] >= TARGETS["vs_torch"],
        "early stop <= 1.2x 3 layers": res["early_stop"]["ratio"] <= TARGETS["early_stop"],
    }
    res["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "equinox": eqx.__version__,
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    return res


def table(res: dict[str, Any]) -> str:
    s, o, v, t, e = res["settings"], res["obvious"], res["vmap"], res["torch"], res["early_stop"]

    def row(name: str, compiles: Any = "", first: Any = "", warm: Any = "") -> str:
        first = f"{first:.2f}" if isinstance(first, float) else first
        warm = f"{warm:.3f}" if isinstance(warm, float) else warm
        return f"{name:<34}{compiles:>9}{first:>11}{warm:>10}"

    head = f"{s['layers']} layers x {s['heads']} heads, d_model {s['d_model']}, seq {s['seq']}"
    rows = [
        f"96-head patching sweep, {head} (cpu)",
        row("pattern", "compiles", "first (s)", "warm (s)"),
        row(
            "obvious loop (run_with_hooks)",
            o["compiles_first_sweep"],
            o["first_sweep_s"],
            o["warm_sweep_s"],
        ),  # fmt: skip
        row("  second sweep compiles", o["compiles_later_sweeps"]),
        row("96 jitted forwards, no hooks", "-", "-", res["plain_loop"]["sweep_s"]),
        row("vmap over the head index", 1, v["first_call_s"], v["warm_call_s"]),
        row("PyTorch forward-hook loop", "-", "-", t["sweep_s"]),
        "  PyTorch by threads: " + ", ".join(f"{k}: {v:.3f} s" for k, v in t["by_threads"].items()),
        f"early stop: cache layer 2 of 24 {e['cache_layer2_of_24'] * 1e3:.2f} ms, 3 layers "
        f"{e['run_3_layers'] * 1e3:.2f} ms, ratio {e['ratio']:.2f}",
        "obvious warm / plain loop {:.2f}, / vmap {:.2f}; PyTorch / obvious warm {:.1f}".format(
            *(res["ratios"][k] for k in res["ratios"])
        ),
        "targets: "
        + ", ".join(f"{k}: {'ok' if ok else 'MISSED'}" for k, ok in res["targets"].items()),
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main()

# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Circuit discovery by attribution: an induction circuit in one compiled program
#
# Attribution patching estimates, from one forward and one backward pass, what activation
# patching measures one node at a time: how much a metric moves when a node takes its value
# from another prompt. We train a 2-layer attention-only transformer to continue repeated
# sequences (the task that *induction heads* solve), then find its circuit with
# `jhooks.attribution`:
#
# 1. AtP over every head at every position, against the exact patching sweep;
# 2. EAP-IG over the edges between the residual stream's writers and readers: the
#    previous-token head feeding the induction head's keys;
# 3. scores per prompt, by `vmap`, in one program.
#
# The model is `benchmarks/attribution_models.py`'s: plain JAX with TransformerLens' points
# (`hook_embed`, `blocks.{l}.hook_{q,k,v}_input`, `blocks.{l}.attn.hook_result`, ...).

# %%
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# The repository root, for benchmarks/attribution_models.py.
sys.path.insert(
    0, str(next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "benchmarks").is_dir()))
)
import jhooks
from benchmarks.attribution_models import gpt, induction_batch, train_induction

# Sequences repeated with a period between 5 and 8 (so that copying from a fixed distance
# back does not work), 32 tokens; d_model 32, 4 heads, no layer norms. 200 steps of Adam
# (warmed up, then a cosine decay) on batches of 32: a few seconds on a CPU.
HALF, VOCAB = 8, 32
start = time.perf_counter()
params, losses = train_induction(
    0, steps=200, half=HALF, vocab=VOCAB, lr=5e-2, d_model=32, d_head=8
)
print(f"trained in {time.perf_counter() - start:.1f} s; loss on the repeated tokens: {losses}")
assert losses[-1] < 1.0  # log(32) = 3.47 for a guess


def model(tokens):
    return gpt(params, tokens)


# %% [markdown]
# ## The task and the metric
#
# A clean prompt is a random sequence of 8 tokens repeated; the corrupted prompt has other
# tokens in its first half, so the second half has nothing to copy from. The metric is the
# log-probability of the clean continuation over the second half.

# %%
tokens = induction_batch(jax.random.PRNGKey(1), 16, HALF, VOCAB)
other = induction_batch(jax.random.PRNGKey(2), 16, HALF, VOCAB)
corrupted = jnp.concatenate([other[:, :HALF], tokens[:, HALF:]], axis=1)
clean, corrupt = tokens[0], corrupted[0]


def induction_score(logits, target):
    logp = jax.nn.log_softmax(logits[HALF:-1])
    return jnp.take_along_axis(logp, target[HALF + 1 :, None], -1).sum()


print("clean:", induction_score(model(clean), clean))
print("corrupted:", induction_score(model(corrupt), clean))

# %% [markdown]
# ## 1. AtP over every head and position
#
# `nodes` takes what `run_with_cache`'s `names_filter` takes. `hook_z` is
# `[position, head, d_head]`; the score sums the last axis, so each head at each position
# gets a score: `(z_clean - z_corrupt) . dmetric/dz` at the corrupted run.

# %%
z = "blocks.*.attn.hook_z"
scores = jhooks.attribution(induction_score, model, clean, corrupt, nodes=z, metric_args=(clean,))
atp = np.stack([scores[f"blocks.{i}.attn.hook_z"] for i in range(2)])  # [layer, position, head]
print("AtP summed over positions (layer x head):")
print(np.round(atp.sum(1), 2))

# %% [markdown]
# The exact answer patches each of the 2 x 16 x 4 nodes alone: one jitted program,
# `lax.map` over the nodes.

# %%
heads, seq = 4, 2 * HALF


@jax.jit
def sweep():
    _, cache = jhooks.run_with_cache(model, clean, names_filter=z)
    base = induction_score(model(corrupt), clean)

    def effect(index):
        layer, pos, head = index // (seq * heads), (index // heads) % seq, index % heads

        def patch(value, name):
            here = layer == int(name.split(".")[1])
            return value.at[pos, head].set(
                jnp.where(here, cache[name][pos, head], value[pos, head])
            )

        return (
            induction_score(jhooks.run_with_hooks(model, corrupt, fwd_hooks=[(z, patch)]), clean)
            - base
        )

    return jax.lax.map(effect, jnp.arange(2 * seq * heads)).reshape(2, seq, heads)


exact = np.asarray(sweep())


def spearman(a, b):
    ranks = [np.argsort(np.argsort(np.ravel(x))) for x in (a, b)]
    return np.corrcoef(*ranks)[0, 1]


print("exact, summed over positions:")
print(np.round(exact.sum(1), 2))
print("Spearman of |AtP| and |exact| over the 128 nodes:", round(spearman(abs(atp), abs(exact)), 3))
assert spearman(abs(atp), abs(exact)) > 0.8

# %% [markdown]
# ## 2. Edges: EAP-IG
#
# The writers of the residual stream are the embedding and each head's output
# (`hook_result`, `[position, head, d_model]`); its readers are each head's query, key and
# value inputs and the unembedding's input. An edge `u -> v` scores
# `(clean_u - corrupt_u) . dmetric/d(input of v)`, summed over positions, with the gradient
# integrated over `steps` runs from the corrupted to the clean embedding (EAP-IG). Each
# pair is contracted on its own: no `[position, writers, d_model]` tensor.

# %%
edges = jhooks.attribution(
    induction_score, model, clean, corrupt, edges=True, method="ig", steps=10,
    writers=["hook_embed", "blocks.*.attn.hook_result"],
    readers=["blocks.*.hook_[qkv]_input", "hook_resid_final"], metric_args=(clean,),
)  # fmt: skip
ranked = []
for (u, v), s in edges.items():
    s = np.asarray(s)
    for index in np.ndindex(s.shape):
        ranked.append((abs(float(s[index])), float(s[index]), u, v, index))
ranked.sort(reverse=True)
print("the strongest edges (writer [head] -> reader [head]):")
for _, s, u, v, index in ranked[:8]:
    print(
        f"  {s:+8.3f}  {u} {index[:1] if 'result' in u else ''} -> {v} {index[-1:] if 'input' in v else ''}"
    )

# %% [markdown]
# How the layers compose shows in the edges between them. In the classic induction
# circuit, a layer-0 *previous-token head* writes "the token before me was X" into each
# position, and a layer-1 *induction head* reads it through its **keys** (K-composition), to
# attend to the token after the earlier occurrence of the current token. The matrices below
# are the edges from each layer-0 head into each layer-1 head's key, query and value inputs:
# which of them carries the effect is what this model learned (a small model trained for
# seconds may split the work differently from the textbook circuit).

# %%
for kind in "kqv":
    reader = f"blocks.1.hook_{kind}_input"
    s = np.asarray(edges[("blocks.0.attn.hook_result", reader)])
    print(
        f"blocks.0.attn.hook_result -> {reader} (layer-0 head x layer-1 head), total {s.sum():.2f}:"
    )
    print(np.round(s, 2))

totals = {
    kind: float(np.sum(edges[("blocks.0.attn.hook_result", f"blocks.1.hook_{kind}_input")]))
    for kind in "kqv"
}
print("layer 0 -> layer 1 through the", max(totals, key=lambda k: abs(totals[k])), "inputs most")

# %% [markdown]
# ## 3. Per prompt, in one program
#
# `per_example=True` maps the attribution over a leading axis of prompts with `jax.vmap`:
# one compiled program for the whole batch, the same numbers as a loop.

# %%
batch_scores = jhooks.attribution(
    induction_score, model, tokens, corrupted, nodes=z, metric_args=(tokens,), per_example=True
)
per_prompt = np.stack([batch_scores[f"blocks.{i}.attn.hook_z"] for i in range(2)], 1)
print("scores:", per_prompt.shape, "(prompt, layer, position, head)")
np.testing.assert_allclose(per_prompt[0], atp, rtol=1e-5, atol=1e-5)
print("heads by mean |AtP| over the prompts (layer x head):")
print(np.round(np.abs(per_prompt).sum(2).mean(0), 2))

# %% [markdown]
# ## 4. AtP*: keys and queries through a saturated softmax
#
# An induction head attends sharply: its softmax saturates, and AtP, which linearizes it,
# misses most of what a key changes. AtP* (`method="atp*"`) recomputes the softmax exactly
# for the keys and queries it is told about (`keys=`, `queries=`: each node and the
# attention scores it makes; `softmax=`: the scores and their pattern), and stays linear
# elsewhere. Against patching each key and query of layer 1 alone (one more `lax.map`
# sweep):

# %%
q, k = "blocks.1.attn.hook_q", "blocks.1.attn.hook_k"
qk_scores, qk_pattern = "blocks.1.attn.hook_attn_scores", "blocks.1.attn.hook_pattern"
common = dict(nodes=[q, k], metric_args=(clean,))
linear = jhooks.attribution(induction_score, model, clean, corrupt, **common)
star = jhooks.attribution(
    induction_score, model, clean, corrupt, method="atp*", softmax={qk_scores: qk_pattern},
    queries={q: qk_scores}, keys={k: qk_scores}, **common,
)  # fmt: skip


@jax.jit
def qk_sweep():
    _, cache = jhooks.run_with_cache(model, clean, names_filter=[q, k])
    base = induction_score(model(corrupt), clean)

    def effect(index):
        which, pos, head = index // (seq * heads), (index // heads) % seq, index % heads

        def patch(value, name):
            here = which == (0 if name == q else 1)
            return value.at[pos, head].set(
                jnp.where(here, cache[name][pos, head], value[pos, head])
            )

        out = jhooks.run_with_hooks(model, corrupt, fwd_hooks=[(q, patch), (k, patch)])
        return induction_score(out, clean) - base

    return jax.lax.map(effect, jnp.arange(2 * seq * heads)).reshape(2, seq, heads)


qk_exact = np.asarray(qk_sweep())
for i, node in enumerate((q, k)):
    truth = qk_exact[i]

    def error(estimate, truth=truth):
        return np.linalg.norm(np.asarray(estimate) - truth) / np.linalg.norm(truth)

    print(f"{node}: error of AtP {error(linear[node]):.0%}, of AtP* {error(star[node]):.0%}")
    print("  by head (summed over positions): exact", np.round(truth.sum(0), 2))
    print("                                   AtP  ", np.round(np.asarray(linear[node]).sum(0), 2))
    print("                                   AtP* ", np.round(np.asarray(star[node]).sum(0), 2))
key_error = np.linalg.norm(np.asarray(star[k]) - qk_exact[1]) / np.linalg.norm(qk_exact[1])
assert key_error < np.linalg.norm(np.asarray(linear[k]) - qk_exact[1]) / np.linalg.norm(qk_exact[1])

# %% [markdown]
# Where patching one key moves the pattern from one token to another, AtP's gradient at
# the saturated softmax is nearly zero and its ranking of the heads can be wrong; AtP*'s
# remaining error is what it keeps linear, the path from the pattern to the metric
# through the rest of the model. The recomputation costs one run of the model up to
# layer 1's scores per query or key point (the Attribution page, AtP*).

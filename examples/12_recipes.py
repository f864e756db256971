# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Recipes from the papers: AtP*, EAP-IG circuits, steering vectors, SAE features
#
# Four methods from the interpretability literature, each in a few cells, on one toy model
# trained here in seconds, and each checked against what it estimates:
#
# | recipe | paper | checked against |
# |---|---|---|
# | [AtP* on IOI-style prompts](#1-atp-on-ioi-style-prompts) | Kramár et al. 2024, *AtP\**; Wang et al. 2022, *IOI* | patching each query and key alone |
# | [An EAP-IG circuit](#2-an-eap-ig-circuit) | Hanna et al. 2024, *Have Faith in Faithfulness* | the metric with every edge outside the circuit patched |
# | [Steering by contrastive means](#3-steering-by-contrastive-means) | Rimsky et al. 2024, *Contrastive Activation Addition* | the logits of the answer the vector stands for |
# | [SAE feature attribution](#4-sae-feature-attribution) | Marks et al. 2024, *Sparse Feature Circuits*; Kissane et al. 2024 (attention-output SAEs) | patching each feature alone |
#
# The model is `benchmarks/attribution_models.py`'s (the one of the notebook *Circuit
# discovery by attribution*): plain JAX, attention only, two
# layers of four heads, with TransformerLens' points (`hook_embed`,
# `blocks.{l}.hook_{q,k,v}_input`, `blocks.{l}.attn.hook_q`, `hook_k`, `hook_attn_scores`,
# `hook_pattern`, `hook_z`, `hook_result`, `hook_resid_final`).

# %%
import functools
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

# The repository root, for benchmarks/attribution_models.py.
sys.path.insert(
    0, str(next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "benchmarks").is_dir()))
)
import jhooks
from benchmarks.attribution_models import gpt, init_gpt

start = time.perf_counter()

# %% [markdown]
# ## The task: indirect objects
#
# An IOI-style prompt ("When Mary and John went to the store, John gave a drink to" →
# "Mary") holds two names, one of them (the subject, S) a second time, and asks for the
# other (the indirect object, IO). Here: 8 names (tokens 0 to 7) placed at random among
# filler tokens, the subject last of the three, and a final "to" token. The positions
# vary from prompt to prompt, so the answer is at no fixed place: the model has to compare
# the names. The corrupted prompts are IOI's "ABC" prompts: the same positions with three
# other names, so nothing in them points at IO or S.

# %%
NAMES, FILLERS, TO, VOCAB, SEQ = 8, 6, 14, 16, 8


def ioi(rng, n):
    """`n` prompts `[n, SEQ]` with their IO, S, and ABC-corrupted prompts."""
    tokens = rng.integers(NAMES, NAMES + FILLERS, (n, SEQ))
    tokens[:, -1] = TO
    names = np.stack([rng.permutation(NAMES)[:5] for _ in range(n)])
    io, s, others = names[:, 0], names[:, 1], names[:, 2:]
    corrupt = tokens.copy()
    for i in range(n):
        where = np.sort(rng.choice(SEQ - 1, 3, replace=False))
        tokens[i, where] = [*rng.permutation([io[i], s[i]]), s[i]]
        corrupt[i, where] = others[i]
    as_int = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return as_int(tokens), as_int(io), as_int(s), as_int(corrupt)


def logit_diff(logits, io, s):
    """The metric: the IO name's logit minus the subject's, after the last token."""
    return logits[-1, io] - logits[-1, s]


print("a prompt:", ioi(np.random.default_rng(0), 1)[0][0])

# %% [markdown]
# Two hundred steps of Adam on batches of 64 prompts, with optax:

# %%
STEPS, BATCH = 200, 64
rng = np.random.default_rng(0)
params = init_gpt(rng, vocab=VOCAB, d_model=32, heads=4, d_head=8, max_len=SEQ, mlp=False, ln=False, scale=0.2)  # fmt: skip
train_tokens, train_io, _, _ = ioi(rng, STEPS * BATCH)
optimizer = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, STEPS // 10, STEPS, 1e-3))
opt_state = optimizer.init(params)


def loss_fn(params, tokens, io):
    logits = jax.vmap(lambda t: gpt(params, t)[-1])(tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), io[:, None], -1))


@jax.jit
def train_step(params, opt_state, tokens, io):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, io)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss


for i in range(STEPS):
    batch = slice(i * BATCH, (i + 1) * BATCH)
    params, opt_state, loss = train_step(params, opt_state, train_tokens[batch], train_io[batch])
print(f"trained in {time.perf_counter() - start:.1f} s, last loss {float(loss):.3f}")


def model(tokens):
    return gpt(params, tokens)


tokens, io, s, corrupt = ioi(np.random.default_rng(1), 64)
clean_metric = jax.vmap(lambda t, i, j: logit_diff(model(t), i, j))(tokens, io, s)
corrupt_metric = jax.vmap(lambda t, i, j: logit_diff(model(t), i, j))(corrupt, io, s)
accuracy = float(jnp.mean(jnp.argmax(jax.vmap(model)(tokens)[:, -1], -1) == io))
print(f"held-out accuracy {accuracy:.0%}; logit difference: clean {clean_metric.mean():.2f}, "
      f"corrupted {corrupt_metric.mean():.2f}")  # fmt: skip
assert accuracy > 0.9 and clean_metric.mean() > 3 and abs(corrupt_metric.mean()) < 2

# %% [markdown]
# ## 1. AtP* on IOI-style prompts
#
# AtP estimates the effect of patching a node (the corrupted run, that node set to its clean
# value) by `(clean - corrupt) · gradient`. Where attention is saturated, the gradient of
# the softmax is nearly zero and AtP misses what a query or a key changes; AtP* recomputes
# the softmax exactly for them (Kramár et al.'s "QK fix"). Every query and key of both
# layers, at every position and head (128 nodes), scored on one prompt:

# %%
clean, corrupted, answer = tokens[0], corrupt[0], (io[0], s[0])
qk_nodes = [f"blocks.{layer}.attn.hook_{kind}" for kind in "qk" for layer in range(2)]
scores_point = {layer: f"blocks.{layer}.attn.hook_attn_scores" for layer in range(2)}
atp_star = jhooks.attribution(
    logit_diff, model, clean, corrupted, method="atp*", nodes=qk_nodes, metric_args=answer,
    softmax={scores_point[layer]: f"blocks.{layer}.attn.hook_pattern" for layer in range(2)},
    queries={f"blocks.{layer}.attn.hook_q": scores_point[layer] for layer in range(2)},
    keys={f"blocks.{layer}.attn.hook_k": scores_point[layer] for layer in range(2)},
)  # fmt: skip
atp = jhooks.attribution(logit_diff, model, clean, corrupted, nodes=qk_nodes, metric_args=answer)

# %% [markdown]
# What they estimate, measured: each of the 128 nodes patched alone, in one jitted
# `lax.map` over the nodes (a `run_with_hooks` that sets one `[position, head]` entry).

# %%
HEADS = 4


@jax.jit
def patch_each_node():
    _, cache = jhooks.run_with_cache(model, clean, names_filter=qk_nodes)
    base = logit_diff(model(corrupted), *answer)

    def effect(index):
        node, pos, head = index // (SEQ * HEADS), (index // HEADS) % SEQ, index % HEADS

        def patch(value, name):
            here = node == qk_nodes.index(name)
            return value.at[pos, head].set(
                jnp.where(here, cache[name][pos, head], value[pos, head])
            )

        fwd_hooks = [(name, patch) for name in qk_nodes]
        return (
            logit_diff(jhooks.run_with_hooks(model, corrupted, fwd_hooks=fwd_hooks), *answer) - base
        )

    return jax.lax.map(effect, jnp.arange(len(qk_nodes) * SEQ * HEADS))


exact = np.asarray(patch_each_node())
estimates = {
    name: np.concatenate([np.ravel(scores[node]) for node in qk_nodes])
    for name, scores in (("AtP", atp), ("AtP*", atp_star))
}


def spearman(a, b):
    ranks = [np.argsort(np.argsort(x)) for x in (a, b)]
    return np.corrcoef(*ranks)[0, 1]


def top_k_overlap(a, b, k=10):
    return len(set(np.argsort(-abs(a))[:k]) & set(np.argsort(-abs(b))[:k])) / k


for name, estimate in estimates.items():
    error = np.linalg.norm(estimate - exact) / np.linalg.norm(exact)
    print(f"{name:5}: error {error:.0%}, Spearman of |scores| {spearman(abs(estimate), abs(exact)):.3f}, "
          f"top-10 nodes shared with patching {top_k_overlap(estimate, exact):.0%}")  # fmt: skip
star_error = np.linalg.norm(estimates["AtP*"] - exact) / np.linalg.norm(exact)
assert star_error < np.linalg.norm(estimates["AtP"] - exact) / np.linalg.norm(exact)
assert spearman(abs(estimates["AtP*"]), abs(exact)) > 0.8
assert top_k_overlap(estimates["AtP*"], exact) >= 0.7

# %% [markdown]
# ## 2. An EAP-IG circuit
#
# EAP-IG scores every *edge* `u -> v` between a writer of the residual stream (the
# embedding, each head's output) and a reader (each head's query, key and value input, the
# unembedding's input), with the gradient integrated along the path from the corrupted to
# the clean input. Averaged over 64 prompts (`per_example=True`: one program), the
# highest-scoring edges are the circuit:

# %%
edge_scores = jhooks.attribution(
    logit_diff, model, tokens, corrupt, edges=True, method="ig", steps=10, per_example=True,
    writers=["hook_embed", "blocks.*.attn.hook_result"],
    readers=["blocks.*.hook_[qkv]_input", "hook_resid_final"], metric_args=(io, s),
)  # fmt: skip
mean_scores = {edge: np.asarray(score).mean(0) for edge, score in edge_scores.items()}
ranked = sorted(
    ((abs(score[index]), edge, index) for edge, score in mean_scores.items() for index in np.ndindex(score.shape)),
    key=lambda item: -item[0],
)  # fmt: skip
print(f"{len(ranked)} edges; the strongest (writer [head] -> reader [head]):")
for magnitude, (writer, reader), index in ranked[:8]:
    print(f"  {magnitude:6.3f}  {writer} -> {reader} {index}")

# %% [markdown]
# **Faithfulness.** The circuit is tested by running the clean prompt with every edge
# *outside* it patched: each reader takes, from each writer outside the circuit, that
# writer's value in the corrupted run, while the circuit's edges carry the patched run's own
# values. Readers' inputs are sums of writers (no layer norm here), so a reader hook swaps
# writers' contributions: it subtracts `current - corrupted` for the edges left out. With no
# edge kept the run is the corrupted run, with every edge the clean one (both checked).

# %%
writers_of = {}
for writer, reader in edge_scores:
    writers_of.setdefault(reader, []).append(writer)


def run_with_circuit(prompt, corrupted_prompt, keep):
    """The metric's input: `prompt` run with the edges where `keep` is False patched from
    `corrupted_prompt`. `keep[(writer, reader)]` has the edge scores' shape."""
    _, corrupted_cache = jhooks.run_with_cache(model, corrupted_prompt, names_filter=list(set(u for u, _ in edge_scores)))  # fmt: skip
    current = {}

    def record(value, name):  # a writer: keep this run's value for the readers after it
        current[name] = value
        return value

    def swap(value, name):  # a reader [position, *B, d_model]: swap the edges left out
        for writer in writers_of[name]:
            diff = current[writer] - corrupted_cache[writer]  # [position, *A, d_model]
            removed = 1.0 - keep[(writer, name)].astype(value.dtype)  # [*A, *B]
            a = int(np.prod(diff.shape[1:-1]))
            moved = diff.reshape(SEQ, a, -1).transpose(0, 2, 1) @ removed.reshape(a, -1)
            value = value - moved.transpose(0, 2, 1).reshape(value.shape)
        return value

    hooks = [(u, record) for u in set(u for u, _ in edge_scores)] + [(v, swap) for v in writers_of]
    return jhooks.run_with_hooks(model, prompt, fwd_hooks=hooks)


@jax.jit
def faithfulness(keep):
    metric = jax.vmap(lambda t, c, i, j: logit_diff(run_with_circuit(t, c, keep), i, j))
    return (metric(tokens, corrupt, io, s).mean() - corrupt_metric.mean()) / (
        clean_metric.mean() - corrupt_metric.mean()
    )


def circuit(k):
    """The `k` edges of highest mean |score| (each head to head pair is an edge)."""
    keep = {edge: np.zeros(score.shape, bool) for edge, score in mean_scores.items()}
    for _, edge, index in ranked[:k]:
        keep[edge][index] = True
    return keep


np.testing.assert_allclose(faithfulness(circuit(0)), 0.0, atol=1e-5)
np.testing.assert_allclose(faithfulness(circuit(len(ranked))), 1.0, atol=1e-5)
kept = [float(faithfulness(circuit(k))) for k in range(len(ranked) + 1)]
print("share of the clean - corrupted logit difference kept, by circuit size:")
for k in (5, 10, 20, 30, 40, 60):
    print(f"  {k:3d} of {len(ranked)} edges: {kept[k]:.0%}")
CIRCUIT_SIZE = next(k for k, share in enumerate(kept) if share >= 0.8)
print(f"the smallest circuit keeping 80 %: {CIRCUIT_SIZE} edges")
assert CIRCUIT_SIZE <= len(ranked) // 2

# %% [markdown]
# A random circuit of the same size, for comparison (the mean over 20 draws):

# %%
random_keep = []
for seed in range(20):
    chosen = np.random.default_rng(seed).permutation(len(ranked))[:CIRCUIT_SIZE]
    keep = {edge: np.zeros(score.shape, bool) for edge, score in mean_scores.items()}
    for c in chosen:
        keep[ranked[c][1]][ranked[c][2]] = True
    random_keep.append(float(faithfulness(keep)))
print(f"random {CIRCUIT_SIZE}-edge circuits keep {np.mean(random_keep):.0%} on average")
assert np.mean(random_keep) < kept[CIRCUIT_SIZE] - 0.3

# %% [markdown]
# ## 3. Steering by contrastive means
#
# Contrastive activation addition: the mean activation over prompts that show a behaviour,
# minus the mean over prompts that do not, added back during generation. Here the
# behaviour is "the answer is name 0": the mean of the residual stream before layer 1, at
# the last position, over prompts whose IO is name 0, minus the mean over prompts whose IO
# is another name. The residual stream before layer 1 is read by that layer's query, key
# and value inputs and reaches the unembedding, so adding a vector to those four points is
# adding it to the stream.

# %%
pool, pool_io, _, _ = ioi(np.random.default_rng(2), 512)
_, cache = jhooks.run_with_cache(jax.vmap(model), pool, names_filter="blocks.1.hook_q_input")
resid = cache["blocks.1.hook_q_input"][:, -1, 0]  # [prompt, d_model]: each head reads the same
steering = resid[pool_io == 0].mean(0) - resid[pool_io != 0].mean(0)
STEERED_POINTS = ["blocks.1.hook_[qkv]_input", "hook_resid_final"]


def steer(value, name, c):
    # [position, head, d_model] for a reader of layer 1, [position, d_model] for the last.
    return value + c * steering


# %% [markdown]
# `jhooks.generate` decodes with the hook inside its compiled loop. Its `step` reads one
# token at a position; this toy has no KV cache, so its "cache" is the token buffer and
# each step runs the model over it (causal attention: later positions do not matter). The
# prompt is a held-out one whose answer is not name 0, ending with its "to" token: the
# first new token is the answer. The coefficient `c` is an argument of the program, so the
# sweep compiles once. With `c = 0` the loop gives the model's own logits, and with the
# vector added it gives those of one forward with the same hooks (both checked).


# %%
def step(params, buffer, token, position):
    buffer = buffer.at[position].set(token)
    return gpt(params, buffer)[position], buffer


prompt = next(t for t, answer in zip(tokens, io) if answer != 0)
print("prompt:", prompt, "answer:", int(model(prompt)[-1].argmax()))
coefficients = [0.0, 0.25, 0.5, 1.0]
steered_logits = []
for c in coefficients:
    hook = functools.partial(steer, c=jnp.float32(c))
    out = jhooks.generate(step, params, jnp.zeros(SEQ, jnp.int32), prompt, max_new_tokens=1,
                          fwd_hooks=[(p, hook) for p in STEERED_POINTS])  # fmt: skip
    steered_logits.append(out.logits[0])
    if c == 0.0:  # unsteered: the model's own logits for the last position
        np.testing.assert_allclose(out.logits[0], model(prompt)[-1], rtol=1e-5, atol=1e-5)
    if c == 1.0:  # the loop's logits are those of one forward with the same hooks
        forward = jhooks.run_with_hooks(model, prompt, fwd_hooks=[(p, hook) for p in STEERED_POINTS])  # fmt: skip
        np.testing.assert_allclose(out.logits[0], forward[-1], rtol=1e-5, atol=1e-5)
for c, logits in zip(coefficients, steered_logits):
    print(f"c = {c:4.2f}: logit of name 0 {logits[0]:6.2f}, chosen token {int(logits.argmax())}")
name_0 = np.array([float(logits[0]) for logits in steered_logits])
assert np.all(np.diff(name_0) > 0) and int(steered_logits[-1].argmax()) == 0

# %% [markdown]
# ## 4. SAE feature attribution
#
# A sparse autoencoder on the layer-0 attention output (all heads' `hook_z` together, as
# Kissane et al. train them), fitted on cached activations with an L1 penalty, is spliced
# into the model with `jhooks.splice`: its features become a point,
# `blocks.0.attn.hook_z.sae.features`, and SAELens' error term keeps the output exactly the
# model's. Attribution to the features (Marks et al.) is then AtP on that point.

# %%
FEATURES = 64


class SAE(eqx.Module):
    w_enc: jax.Array
    b_enc: jax.Array
    w_dec: jax.Array
    b_dec: jax.Array

    def encode(self, z):  # [position, head, d_head] -> [position, feature]
        return jax.nn.relu((z.reshape(z.shape[0], -1) - self.b_dec) @ self.w_enc + self.b_enc)

    def decode(self, f):
        return (f @ self.w_dec + self.b_dec).reshape(f.shape[0], HEADS, -1)


_, cache = jhooks.run_with_cache(jax.vmap(model), pool, names_filter="blocks.0.attn.hook_z")
z_data = cache["blocks.0.attn.hook_z"]  # [prompt, position, head, d_head]
key_enc, key_dec = jax.random.split(jax.random.key(0))
sae = SAE(0.2 * jax.random.normal(key_enc, (32, FEATURES)), jnp.zeros(FEATURES),
          0.2 * jax.random.normal(key_dec, (FEATURES, 32)), z_data.reshape(-1, 32).mean(0))  # fmt: skip
sae_opt = optax.adam(3e-3)
sae_state = sae_opt.init(sae)


def sae_loss(sae, z):
    features = jax.vmap(sae.encode)(z)
    recon = jax.vmap(sae.decode)(features)
    return jnp.mean(jnp.sum((recon - z) ** 2, (-2, -1))) + 5e-2 * jnp.mean(jnp.sum(features, -1))


@jax.jit
def sae_step(sae, state, z):
    loss, grads = jax.value_and_grad(sae_loss)(sae, z)
    updates, state = sae_opt.update(grads, state)
    return optax.apply_updates(sae, updates), state, loss


for _ in range(300):
    sae, sae_state, _ = sae_step(sae, sae_state, z_data)
features = jax.vmap(sae.encode)(z_data)
unexplained = jnp.sum((jax.vmap(sae.decode)(features) - z_data) ** 2) / jnp.sum((z_data - z_data.mean((0, 1))) ** 2)  # fmt: skip
print(f"variance explained {1 - float(unexplained):.0%}, active features per position "
      f"{float(jnp.mean(jnp.sum(features > 0, -1))):.1f} of {FEATURES}")  # fmt: skip

# %%
spliced = jhooks.splice(model, "blocks.0.attn.hook_z", sae)
# With the error term the output is the model's (up to rounding: compiled against eager).
np.testing.assert_allclose(spliced(clean), model(clean), rtol=1e-5, atol=1e-5)
feature_point = "blocks.0.attn.hook_z.sae.features"
feature_scores = jhooks.attribution(logit_diff, spliced, clean, corrupted, nodes=feature_point, sum_axes=(), metric_args=answer)  # fmt: skip
feature_atp = np.asarray(feature_scores[feature_point])  # [position, feature]


@jax.jit
def patch_each_feature():
    _, cache = jhooks.run_with_cache(spliced, clean, names_filter=feature_point)
    base = logit_diff(spliced(corrupted), *answer)

    def effect(index):
        pos, feature = index // FEATURES, index % FEATURES

        def patch(value, name):
            return value.at[pos, feature].set(cache[name][pos, feature])

        out = jhooks.run_with_hooks(spliced, corrupted, fwd_hooks=[(feature_point, patch)])
        return logit_diff(out, *answer) - base

    return jax.lax.map(effect, jnp.arange(SEQ * FEATURES)).reshape(SEQ, FEATURES)


feature_exact = np.asarray(patch_each_feature())
# The entries whose patch moves the metric (a feature zero in both runs moves nothing,
# and AtP gives it 0 too: left out, so as not to inflate the correlation).
moved = feature_exact != 0
correlation = np.corrcoef(feature_atp[moved], feature_exact[moved])[0, 1]
print(f"{moved.sum()} of {moved.size} (position, feature) entries move the metric; "
      f"correlation of AtP with patching each alone: {correlation:.3f}")  # fmt: skip
print(f"top-10 shared: {top_k_overlap(feature_atp.ravel(), feature_exact.ravel()):.0%}")
for pos, feature in zip(
    *np.unravel_index(np.argsort(-abs(feature_exact).ravel())[:5], feature_exact.shape)
):
    print(f"  position {pos} feature {feature:2d}: patching {feature_exact[pos, feature]:+.3f}, "
          f"AtP {feature_atp[pos, feature]:+.3f}")  # fmt: skip
assert correlation > 0.85

# %% [markdown]
# Where AtP and patching disagree most, the feature is at the last position: layer 1's
# heads read it there through their query, so patching it moves where they attend, through
# the softmax that AtP linearizes.

# %%
worst = np.unravel_index(np.argmax(abs(feature_atp - feature_exact)), feature_exact.shape)
print(f"the largest disagreement: position {worst[0]}, feature {worst[1]}")
assert worst[0] == SEQ - 1
print(f"the whole notebook: {time.perf_counter() - start:.0f} s")

# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Interpretability: hook points, activation caches, patching and attribution
#
# Researchers who read and edit activations use TransformerLens-style *hook points* in PyTorch:
# identity modules at every interesting activation, with forward hooks to read or patch them and
# backward hooks for their gradients. jhooks gives the same workflow in JAX, as values, so it runs
# under `jax.jit` and `jax.vmap`:
#
# | TransformerLens / PyTorch | jhooks |
# |---|---|
# | `self.hook_z = HookPoint()`, `z = self.hook_z(z)` | `z = jhooks.hook_point(z, "…hook_z")` |
# | `model.run_with_hooks(x, fwd_hooks=hooks)` | `jhooks.run_with_hooks(model, x, fwd_hooks=hooks)` |
# | `logits, cache = model.run_with_cache(x)` | `logits, cache = jhooks.run_with_cache(model, x)` |
# | `output.retain_grad()` on each cached activation | `jhooks.run_with_cache(fn, x, incl_bwd=True)` |
#
# We build a small transformer in Equinox (attention from `eqx.nn.MultiheadAttention`'s
# projections, an MLP, layer norms) and its PyTorch twin with the same weights, then
#
# 1. cache every activation,
# 2. patch one attention head's output from a corrupted run into a clean run (activation patching),
# 3. compute gradient × activation attributions (and attribution patching).
#
# The PyTorch side uses nothing but `register_forward_hook`, `Tensor.retain_grad` and
# `Tensor.register_hook`, and every result is checked with `np.testing.assert_allclose`, both
# under `jax.jit` and without it.

# %%
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

VOCAB, D, HEADS, D_MLP, LAYERS = 12, 16, 4, 32, 2
D_HEAD = D // HEADS


def check(jax_value, torch_value, rtol=1e-5, atol=1e-6):
    if isinstance(torch_value, torch.Tensor):
        torch_value = torch_value.detach().numpy()
    np.testing.assert_allclose(np.asarray(jax_value), torch_value, rtol=rtol, atol=atol)


# %% [markdown]
# ## The Equinox model
#
# A hook point is the identity until a `run_with_hooks` or `run_with_cache` call is active, so
# marking points costs nothing in ordinary use. Each module is given its path as a name, so the
# point names match PyTorch's `named_modules()` below. Attention uses the four projections of an
# `eqx.nn.MultiheadAttention` but computes the heads itself, so that each head's output `z` is a
# point.


# %%
class Attention(eqx.Module):
    mha: eqx.nn.MultiheadAttention
    name: str = eqx.field(static=True)

    def __init__(self, name, key):
        self.name = name
        self.mha = eqx.nn.MultiheadAttention(
            HEADS,
            D,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=key,
        )

    def __call__(self, x):
        seq = x.shape[0]

        def heads(proj, kind):
            h = jax.vmap(proj)(x).reshape(seq, HEADS, D_HEAD)
            return jhooks.hook_point(h, f"{self.name}.hook_{kind}")

        q = heads(self.mha.query_proj, "q")
        k = heads(self.mha.key_proj, "k")
        v = heads(self.mha.value_proj, "v")
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(D_HEAD)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores, -jnp.inf)
        pattern = jhooks.hook_point(jax.nn.softmax(scores, axis=-1), f"{self.name}.hook_pattern")
        z = jhooks.hook_point(jnp.einsum("hqk,khd->qhd", pattern, v), f"{self.name}.hook_z")
        return jax.vmap(self.mha.output_proj)(z.reshape(seq, D))


class MLP(eqx.Module):
    fc_in: eqx.nn.Linear
    fc_out: eqx.nn.Linear
    name: str = eqx.field(static=True)

    def __init__(self, name, key):
        k1, k2 = jax.random.split(key)
        self.name = name
        self.fc_in = eqx.nn.Linear(D, D_MLP, key=k1)
        self.fc_out = eqx.nn.Linear(D_MLP, D, key=k2)

    def __call__(self, x):
        post = jax.nn.gelu(jax.vmap(self.fc_in)(x), approximate=False)
        post = jhooks.hook_point(post, f"{self.name}.hook_post")
        return jax.vmap(self.fc_out)(post)


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: Attention
    ln2: eqx.nn.LayerNorm
    mlp: MLP
    name: str = eqx.field(static=True)

    def __init__(self, name, key):
        k1, k2 = jax.random.split(key)
        self.name = name
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = Attention(f"{name}.attn", k1)
        self.mlp = MLP(f"{name}.mlp", k2)

    def __call__(self, x):
        attn_out = self.attn(jax.vmap(self.ln1)(x))
        x = x + jhooks.hook_point(attn_out, f"{self.name}.hook_attn_out")
        mlp_out = self.mlp(jax.vmap(self.ln2)(x))
        x = x + jhooks.hook_point(mlp_out, f"{self.name}.hook_mlp_out")
        return jhooks.hook_point(x, f"{self.name}.hook_resid_post")


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list[Block]
    ln_final: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, key, max_len=8):
        keys = jax.random.split(key, LAYERS + 3)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
        self.pos = 0.1 * jax.random.normal(keys[1], (max_len, D))
        self.blocks = [Block(f"blocks.{i}", keys[3 + i]) for i in range(LAYERS)]
        self.ln_final = eqx.nn.LayerNorm(D)
        self.unembed = eqx.nn.Linear(D, VOCAB, use_bias=False, key=keys[2])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
        x = jhooks.hook_point(x, "hook_embed")
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembed)(jax.vmap(self.ln_final)(x))


model = Transformer(jax.random.PRNGKey(0))

# The attention computed head by head is eqx.nn.MultiheadAttention's own.
x = jax.random.normal(jax.random.PRNGKey(1), (5, D))
attn = model.blocks[0].attn
causal = jnp.tril(jnp.ones((5, 5), bool))
np.testing.assert_allclose(attn(x), attn.mha(x, x, x, mask=causal), rtol=1e-5, atol=1e-6)


# %% [markdown]
# ## Its PyTorch twin
#
# TransformerLens's `HookPoint` is an identity module that hooks attach to; `torch.nn.Identity`
# does the same job. The weights are copied from the Equinox model.


# %%
class TorchAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))
        for kind in ("q", "k", "v", "pattern", "z"):
            setattr(self, f"hook_{kind}", torch.nn.Identity())

    def forward(self, x):
        seq = x.shape[0]
        q = self.hook_q(self.q(x).view(seq, HEADS, D_HEAD))
        k = self.hook_k(self.k(x).view(seq, HEADS, D_HEAD))
        v = self.hook_v(self.v(x).view(seq, HEADS, D_HEAD))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D_HEAD)
        causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        pattern = self.hook_pattern(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        z = self.hook_z(torch.einsum("hqk,khd->qhd", pattern, v))
        return self.o(z.reshape(seq, D))


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in, self.fc_out = torch.nn.Linear(D, D_MLP), torch.nn.Linear(D_MLP, D)
        self.hook_post = torch.nn.Identity()

    def forward(self, x):
        return self.fc_out(self.hook_post(torch.nn.functional.gelu(self.fc_in(x))))


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.attn, self.mlp = TorchAttention(), TorchMLP()
        self.hook_attn_out, self.hook_mlp_out = torch.nn.Identity(), torch.nn.Identity()
        self.hook_resid_post = torch.nn.Identity()

    def forward(self, x):
        x = x + self.hook_attn_out(self.attn(self.ln1(x)))
        x = x + self.hook_mlp_out(self.mlp(self.ln2(x)))
        return self.hook_resid_post(x)


class TorchTransformer(torch.nn.Module):
    def __init__(self, max_len=8):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Parameter(torch.zeros(max_len, D))
        self.hook_embed = torch.nn.Identity()
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(LAYERS))
        self.ln_final = torch.nn.LayerNorm(D)
        self.unembed = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.hook_embed(self.embed(tokens) + self.pos[: tokens.shape[0]])
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_final(x))


def copy_weights(model):
    tmodel = TorchTransformer()
    pairs = [(tmodel.embed.weight, model.embed.weight), (tmodel.pos, model.pos)]
    pairs += [(tmodel.ln_final.weight, model.ln_final.weight)]
    pairs += [(tmodel.ln_final.bias, model.ln_final.bias)]
    pairs += [(tmodel.unembed.weight, model.unembed.weight)]
    for tb, b in zip(tmodel.blocks, model.blocks):
        linears = [
            (tb.attn.q, b.attn.mha.query_proj),
            (tb.attn.k, b.attn.mha.key_proj),
            (tb.attn.v, b.attn.mha.value_proj),
            (tb.attn.o, b.attn.mha.output_proj),
            (tb.mlp.fc_in, b.mlp.fc_in),
            (tb.mlp.fc_out, b.mlp.fc_out),
            (tb.ln1, b.ln1),
            (tb.ln2, b.ln2),
        ]
        for t, e in linears:
            pairs += [(t.weight, e.weight), (t.bias, e.bias)]
    with torch.no_grad():
        for t, e in pairs:
            assert t.shape == e.shape
            t.copy_(torch.from_numpy(np.array(e)))
    return tmodel


tmodel = copy_weights(model)
hook_modules = {n: m for n, m in tmodel.named_modules() if n.split(".")[-1].startswith("hook_")}

clean = jnp.array([1, 5, 2, 9, 4, 7])
corrupted = jnp.array([1, 8, 2, 9, 4, 7])  # the second token changed
clean_t, corrupted_t = (torch.from_numpy(np.asarray(t)) for t in (clean, corrupted))

check(model(clean), tmodel(clean_t))
print(len(hook_modules), "hook points:", list(hook_modules)[:8], "...")

# %% [markdown]
# ## 1. Cache every activation
#
# `run_with_cache` returns the activations as values. Under `jax.jit` only the points selected by
# `names_filter` are outputs of the compiled program, so only they are kept in memory (see
# `benchmarks/cache_memory.py`). In PyTorch, the same cache is a forward hook on every hook
# module that stores its output.

# %%
logits, cache = jhooks.run_with_cache(model, clean)

torch_cache = {}
handles = [
    module.register_forward_hook(lambda m, args, out, name=name: torch_cache.__setitem__(name, out))
    for name, module in hook_modules.items()
]
with torch.no_grad():
    torch_logits = tmodel(clean_t)
for h in handles:
    h.remove()

assert set(cache) == set(torch_cache) == set(hook_modules)
check(logits, torch_logits)
for name in cache:
    check(cache[name], torch_cache[name])

# The same under jax.jit, with a filter: only the attention patterns come back.
jit_logits, patterns = jax.jit(
    lambda tokens: jhooks.run_with_cache(model, tokens, names_filter=lambda n: "pattern" in n)
)(clean)
assert sorted(patterns) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
check(jit_logits, torch_logits)
for name, pattern in patterns.items():
    check(pattern, torch_cache[name])
print({name: value.shape for name, value in cache.items() if name.startswith("blocks.0")})

# %% [markdown]
# A name that is not a point raises an error listing the close matches, once the function
# has been traced (so inside `jax.jit` too):

# %%
try:
    jhooks.run_with_cache(model, clean, names_filter=["blocks.0.attn.hook_zz"])
except ValueError as error:
    print(error)
    assert "Did you mean 'blocks.0.attn.hook_z'" in str(error)

# %% [markdown]
# Batches are a `jax.vmap` away: the hooks run per example, and the cache comes back
# stacked.

# %%
batch = jnp.stack([clean, corrupted])
batch_logits, batch_cache = jax.vmap(
    lambda tokens: jhooks.run_with_cache(model, tokens, names_filter="blocks.1.hook_resid_post")
)(batch)
with torch.no_grad():
    for i, tokens in enumerate((clean_t, corrupted_t)):
        check(batch_logits[i], tmodel(tokens))
check(batch_cache["blocks.1.hook_resid_post"][0], torch_cache["blocks.1.hook_resid_post"])

# %% [markdown]
# ## 2. Activation patching: one head from a corrupted run
#
# The metric is the logit difference between two answer tokens at the last position. We cache
# every head's output `z` on the corrupted prompt, then rerun the clean prompt with one head of one
# layer replaced by its corrupted value, and see how much of the metric moves. The whole scan is
# one jitted function; the head index is a traced value, so `jax.vmap` runs all heads of a layer in
# one go. One head is also patched without `jax.jit`, for comparison.

# %%
ANSWER, WRONG = 3, 6


def metric(logits):
    return logits[-1, ANSWER] - logits[-1, WRONG]


def z_name(layer):
    return f"blocks.{layer}.attn.hook_z"


def is_z(name):
    return name.endswith("hook_z")


def patch_effect(model, clean, corrupted_z, layer, head):
    # How much the metric moves when head `head` of `layer` takes its corrupted value.

    def patch(z, name):
        return z.at[:, head].set(corrupted_z[:, head])

    logits = jhooks.run_with_hooks(model, clean, fwd_hooks=[(z_name(layer), patch)])
    return metric(logits) - metric(model(clean))


@jax.jit
def patching_effects(model, clean, corrupted):
    _, corrupted_cache = jhooks.run_with_cache(model, corrupted, names_filter=is_z)
    heads = jnp.arange(HEADS)

    def layer_effects(layer):  # the effect of patching each head of one layer
        z = corrupted_cache[z_name(layer)]
        return jax.vmap(lambda head: patch_effect(model, clean, z, layer, head))(heads)

    return jnp.stack([layer_effects(layer) for layer in range(LAYERS)])


effects = patching_effects(model, clean, corrupted)

# Without jax.jit, one head at a time.
_, corrupted_cache = jhooks.run_with_cache(model, corrupted, names_filter=is_z)
eager_effect = patch_effect(model, clean, corrupted_cache[z_name(1)], 1, 2)
check(eager_effect, effects[1, 2], atol=1e-6)

# PyTorch: a forward hook on the hook_z module that overwrites one head.
torch_corrupted = {}
handles = [
    hook_modules[z_name(layer)].register_forward_hook(
        lambda m, args, out, layer=layer: torch_corrupted.__setitem__(layer, out)
    )
    for layer in range(LAYERS)
]
with torch.no_grad():
    tmodel(corrupted_t)
for h in handles:
    h.remove()
with torch.no_grad():
    torch_clean_metric = metric(tmodel(clean_t))


def torch_patch(layer, head):
    def hook(module, args, output):
        output = output.clone()
        output[:, head] = torch_corrupted[layer][:, head]
        return output

    with hook_modules[z_name(layer)].register_forward_hook(hook), torch.no_grad():
        return (metric(tmodel(clean_t)) - torch_clean_metric).item()


torch_effects = torch.tensor(
    [[torch_patch(layer, h) for h in range(HEADS)] for layer in range(LAYERS)]
)
check(effects, torch_effects, atol=1e-5)
print("clean metric:", float(metric(model(clean))))
print("change in the metric when one head is patched (layer x head):")
print(np.round(np.asarray(effects), 4))


# %% [markdown]
# ## 3. Gradient × activation attributions
#
# With `incl_bwd=True` (for a scalar-valued function), `run_with_cache` also returns the gradient
# of the output with respect to each selected activation, under `name + "_grad"`: PyTorch's
# `retain_grad` on every cached activation. The gradients come from `jhooks.retain_grad` probes,
# so they too are values.
#
# Gradient × activation, summed over a head's positions and features, scores each head;
# *attribution patching* multiplies the gradient by `z_corrupted - z_clean` instead, a first-order
# estimate of the patching effects above from one forward and one backward pass.


# %%
@jax.jit
def attributions(model, clean, corrupted):
    value, cache = jhooks.run_with_cache(
        lambda tokens: metric(model(tokens)), clean, names_filter=is_z, incl_bwd=True
    )
    _, corrupted_cache = jhooks.run_with_cache(model, corrupted, names_filter=is_z)
    grad_x_act, estimate = [], []
    for layer in range(LAYERS):
        z, grad = cache[z_name(layer)], cache[z_name(layer) + "_grad"]
        grad_x_act.append(jnp.sum(z * grad, axis=(0, 2)))
        estimate.append(jnp.sum((corrupted_cache[z_name(layer)] - z) * grad, axis=(0, 2)))
    return value, cache, jnp.stack(grad_x_act), jnp.stack(estimate)


value, grad_cache, grad_x_act, estimate = attributions(model, clean, corrupted)
assert sorted(grad_cache) == sorted(
    [z_name(layer) for layer in range(LAYERS)]
    + [z_name(layer) + "_grad" for layer in range(LAYERS)]
)
# Without jax.jit: the same value, activation and gradient.
eager_value, eager_cache = jhooks.run_with_cache(
    lambda tokens: metric(model(tokens)), clean, names_filter=z_name(1), incl_bwd=True
)
check(eager_value, value)
for name in (z_name(1), z_name(1) + "_grad"):
    check(eager_cache[name], grad_cache[name])

# PyTorch: retain_grad on each hook_z output, then backward.
outputs = {}


def keep(layer):
    def hook(module, args, output):
        output.retain_grad()
        outputs[layer] = output

    return hook


handles = [
    hook_modules[z_name(layer)].register_forward_hook(keep(layer)) for layer in range(LAYERS)
]
torch_value = metric(tmodel(clean_t))
torch_value.backward()
for h in handles:
    h.remove()
torch_grad_x_act = torch.stack(
    [(outputs[layer] * outputs[layer].grad).sum((0, 2)) for layer in range(LAYERS)]
)
torch_estimate = torch.stack(
    [
        ((torch_corrupted[layer] - outputs[layer]) * outputs[layer].grad).sum((0, 2))
        for layer in range(LAYERS)
    ]
)

check(value, torch_value)
for layer in range(LAYERS):
    check(grad_cache[z_name(layer) + "_grad"], outputs[layer].grad)
check(grad_x_act, torch_grad_x_act, atol=1e-5)
check(estimate, torch_estimate, atol=1e-5)
print("gradient x activation (layer x head):")
print(np.round(np.asarray(grad_x_act), 4))
print("attribution patching estimate vs actual patching effect:")
print(np.round(np.stack([np.asarray(estimate), np.asarray(effects)], axis=-1), 4))


# %% [markdown]
# ## Backward hooks on a point
#
# `bwd_hooks` edit the gradient flowing through a point, as `Tensor.register_hook` does. Here we
# block the gradient through head 0 of layer 1 and take the gradient of the metric with respect to
# the embeddings.


# %%
def block_head0(grad, name):
    return grad.at[:, 0].set(0.0)


def embed_grad(model, tokens):
    def f(embed_weight):
        m = eqx.tree_at(lambda m: m.embed.weight, model, embed_weight)
        logits = jhooks.run_with_hooks(m, tokens, bwd_hooks=[(z_name(1), block_head0)])
        return metric(logits)

    return jax.grad(f)(model.embed.weight)


g = jax.jit(embed_grad)(model, clean)


def torch_block_head0(module, args, output):
    output.register_hook(lambda grad: torch.cat([torch.zeros_like(grad[:, :1]), grad[:, 1:]], 1))


tmodel.zero_grad()
with hook_modules[z_name(1)].register_forward_hook(torch_block_head0):
    metric(tmodel(clean_t)).backward()
check(g, tmodel.embed.weight.grad)
print("embedding gradient norm with head 1.0 blocked:", float(jnp.linalg.norm(g)))

# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Steering a model during generation: PyTorch and jhooks side by side
#
# Steering adds a vector to the residual stream while a model writes. In PyTorch it is a
# forward hook and a Python loop over tokens (TransformerLens' `generate` with hooks). In
# JAX the decode loop is one compiled `lax.while_loop` over a KV cache; jhooks runs the
# same hooks inside it:
#
# | PyTorch | jhooks |
# |---|---|
# | `block.register_forward_hook(lambda m, a, out: out + c * v)`, then a Python decode loop | `jhooks.generate(step, model, cache, prompt, fwd_hooks=[("blocks.*.hook_resid_post", steer)])` |
# | a hook that checks which step (or position) it runs at | `jhooks.loop_index()`: the step, a traced value |
# | a hook that appends to a list every step | `names_filter=`: a `(steps, ...)` buffer written in the loop |
# | one decode per coefficient | `jax.vmap` over coefficients and prompts, one program |
#
# We build a tiny GPT with a KV cache in Equinox and its PyTorch twin with the same
# weights, and check every result against PyTorch.

# %%
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

VOCAB, D, HEADS, LAYERS, MAX_LEN = 32, 16, 2, 2, 40
NEG = np.float32(-1e9)

# %% [markdown]
# ## The model, in Equinox
#
# Each block's attention writes its keys and values into the cache at `pos`; with no
# cache (`kv=None`) it attends over the whole sequence. Each block's output is the
# hook point `hook_resid_post`, named under the block's path once the model is hookable:
# `blocks.0.hook_resid_post`, `blocks.1.hook_resid_post`.


# %%
class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.qkv, self.out = eqx.nn.Linear(D, 3 * D, key=k1), eqx.nn.Linear(D, D, key=k2)
        self.fc1, self.fc2 = eqx.nn.Linear(D, 4 * D, key=k3), eqx.nn.Linear(4 * D, D, key=k4)

    def __call__(self, x, kv=None, pos=0):
        t = x.shape[0]
        qkv = jax.vmap(self.qkv)(jax.vmap(self.ln1)(x))
        q, k, v = (a.reshape(t, HEADS, -1) for a in jnp.split(qkv, 3, -1))
        if kv is None:
            keys, values, q_pos = k, v, jnp.arange(t)
        else:
            keys = jax.lax.dynamic_update_slice_in_dim(kv[0], k, pos, 0)
            values = jax.lax.dynamic_update_slice_in_dim(kv[1], v, pos, 0)
            q_pos, kv = pos + jnp.arange(t), (keys, values)
        scores = jnp.einsum("thd,shd->hts", q, keys) / np.float32(np.sqrt(D // HEADS))
        k_pos = jnp.arange(keys.shape[0])
        scores = jnp.where(k_pos[None, None] <= q_pos[None, :, None], scores, NEG)
        z = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, -1), values).reshape(t, D)
        x = x + jax.vmap(self.out)(z)
        h = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.ln2)(x)), approximate=True)
        x = x + jax.vmap(self.fc2)(h)
        return jhooks.hook_point(x, "hook_resid_post"), kv


class GPT(eqx.Module):
    embed: jax.Array
    pos_embed: jax.Array
    blocks: list
    unembed: jax.Array

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 3)
        self.embed = jax.random.normal(keys[0], (VOCAB, D))
        self.pos_embed = 0.5 * jax.random.normal(keys[1], (MAX_LEN, D))
        self.unembed = jax.random.normal(keys[2], (D, VOCAB)) / np.float32(np.sqrt(D))
        self.blocks = [Block(k) for k in keys[3:]]

    def __call__(self, tokens):  # the whole sequence, no cache
        x = self.embed[tokens] + self.pos_embed[: len(tokens)]
        for block in self.blocks:
            x, _ = block(x)
        return x @ self.unembed


def step(model, cache, token, pos):
    """One decoding step: the next logits after `token` at `pos`, and the new cache."""
    x = (model.embed[token] + model.pos_embed[pos])[None]
    new = []
    for block, kv in zip(model.blocks, cache):
        x, kv = block(x, kv, pos)
        new.append(kv)
    return (x @ model.unembed)[0], new


model = jhooks.hookable(GPT(jax.random.key(0)))
empty_cache = [(jnp.zeros((MAX_LEN, HEADS, D // HEADS)),) * 2 for _ in range(LAYERS)]
prompt = jnp.asarray([3, 1, 4, 1], jnp.int32)
direction = jax.random.normal(jax.random.key(1), (D,))

# %% [markdown]
# ## Its PyTorch twin, with the same weights


# %%
class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.out = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x):
        t = x.shape[0]
        q, k, v = (a.reshape(t, HEADS, -1) for a in self.qkv(self.ln1(x)).chunk(3, -1))
        scores = torch.einsum("thd,shd->hts", q, k) / np.sqrt(D // HEADS)
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -1e9)
        x = x + self.out(torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, D))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
    def __init__(self, jax_model):
        super().__init__()
        t = lambda a: torch.nn.Parameter(torch.tensor(np.asarray(a)))  # noqa: E731
        self.embed, self.pos_embed, self.unembed = (
            t(jax_model.embed),
            t(jax_model.pos_embed),
            t(jax_model.unembed),
        )
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(LAYERS))
        for ours, theirs in zip(self.blocks, jax_model.blocks):
            for name in ("ln1", "ln2", "qkv", "out", "fc1", "fc2"):
                getattr(ours, name).weight.data = torch.tensor(
                    np.asarray(getattr(theirs, name).weight)
                )
                getattr(ours, name).bias.data = torch.tensor(np.asarray(getattr(theirs, name).bias))

    def forward(self, tokens):
        x = self.embed[tokens] + self.pos_embed[: len(tokens)]
        for block in self.blocks:
            x = block(x)
        return x @ self.unembed


twin = TorchGPT(model)


def torch_generate(prompt, new):
    """Greedy decoding in PyTorch, recomputing the sequence at each step."""
    tokens = torch.tensor(np.asarray(prompt), dtype=torch.long)
    with torch.no_grad():
        for _ in range(new):
            tokens = torch.cat([tokens, twin(tokens)[-1].argmax()[None]])
    return tokens.numpy()


# %% [markdown]
# ## Steering every layer
#
# PyTorch: a forward hook on each block adds `c * direction` to its output, then a
# Python loop decodes. jhooks: the same hook on `blocks.*.hook_resid_post`, and
# `jhooks.generate` runs the whole decode as one compiled `while_loop` (the prompt is read
# one token per step, so the hook acts on it too, as in PyTorch).

# %%
C = 3.0
handles = [
    b.register_forward_hook(lambda m, args, out: out + C * torch.tensor(np.asarray(direction)))
    for b in twin.blocks
]
torch_steered = torch_generate(prompt, 24)
for h in handles:
    h.remove()


def steer(resid, name, c):
    return resid + c * direction


steered = jhooks.generate(
    step,
    model,
    empty_cache,
    prompt,
    max_new_tokens=24,
    fwd_hooks=[("blocks.*.hook_resid_post", functools.partial(steer, c=C))],
)
plain = jhooks.generate(step, model, empty_cache, prompt, max_new_tokens=24)
print("plain:  ", plain.tokens)
print("steered:", steered.tokens)
np.testing.assert_array_equal(steered.tokens, torch_steered)
np.testing.assert_array_equal(plain.tokens, torch_generate(prompt, 24))

# %% [markdown]
# ## Acting at chosen steps only
#
# In PyTorch the hook picks the positions of those steps. In the compiled loop, `jhooks.loop_index()` is the step (the position of the token the model reads), a
# traced value: `jnp.where` picks the steps. Generation step `k` (choosing new token `k`)
# reads position `len(prompt) - 1 + k`; here we steer steps 1 and 2 only.

# %%
N = len(prompt)


def steer_positions(m, args, out):
    # Without a KV cache PyTorch recomputes every position at every step: the positions
    # read at steps 1 and 2 (N and N + 1) must be steered in every pass, as their keys
    # and values stay steered in a KV cache (otherwise the two decodes differ, the
    # problem of neuronpedia #163).
    out = out.clone()
    out[N : N + 2] += C * torch.tensor(np.asarray(direction))
    return out


handles = [b.register_forward_hook(steer_positions) for b in twin.blocks]
torch_patched = torch_generate(prompt, 24)
for h in handles:
    h.remove()


def steer_steps_1_and_2(resid, name):
    (position,) = jhooks.loop_index()
    k = position - (N - 1)
    return jnp.where((k == 1) | (k == 2), resid + C * direction, resid)


patched = jhooks.generate(
    step,
    model,
    empty_cache,
    prompt,
    max_new_tokens=24,
    fwd_hooks=[("blocks.*.hook_resid_post", steer_steps_1_and_2)],
)
print("steps 1 and 2:", patched.tokens)
np.testing.assert_array_equal(patched.tokens, torch_patched)

# %% [markdown]
# ## Caching the residual stream at every step
#
# `names_filter=` caches the selected points at every step, in buffers preallocated in
# the loop's carry: `(len(prompt) + max_new_tokens - 1, ...)`, row `t` the value when
# the token at position `t` was read, with `_valid` rows and `_steps` run. We compare
# with PyTorch's residuals of the final text, computed in one pass.

# %%
out = jhooks.generate(
    step,
    model,
    empty_cache,
    prompt,
    max_new_tokens=24,
    names_filter="blocks.1.hook_resid_post",
)
rows = out.cache["blocks.1.hook_resid_post"][:, 0]  # (27, D)
seen = []
handle = twin.blocks[1].register_forward_hook(lambda m, args, o: seen.append(o.detach()))
with torch.no_grad():
    twin(torch.tensor(np.asarray(out.tokens[:-1]), dtype=torch.long))
handle.remove()
print(rows.shape, out.cache["blocks.1.hook_resid_post_steps"])
np.testing.assert_allclose(rows, seen[0].numpy(), rtol=1e-4, atol=1e-5)

# %% [markdown]
# ## A sweep of coefficients, with `jax.vmap`
#
# The coefficient a hook closes over is an argument of the compiled program, so
# `jax.vmap` runs a sweep of coefficients over several prompts at once; PyTorch decodes
# them one by one.

# %%
coefficients = jnp.asarray([0.0, 1.0, 3.0], jnp.float32)
prompts = jnp.asarray([[3, 1, 4, 1], [2, 7, 1, 8]], jnp.int32)


def decode(c, p):
    hooks = [("blocks.*.hook_resid_post", functools.partial(steer, c=c))]
    return jhooks.generate(step, model, empty_cache, p, max_new_tokens=24, fwd_hooks=hooks).tokens


grid = jax.jit(jax.vmap(jax.vmap(decode, (None, 0)), (0, None)))(coefficients, prompts)
print(grid.shape)
for i, c in enumerate(coefficients):
    hooks = [
        b.register_forward_hook(
            lambda m, args, out, c=float(c): out + c * torch.tensor(np.asarray(direction))
        )
        for b in twin.blocks
    ]
    for j, p in enumerate(prompts):
        np.testing.assert_array_equal(grid[i, j], torch_generate(p, 24))
    for h in hooks:
        h.remove()
print("every coefficient and prompt matches PyTorch")

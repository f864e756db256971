# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A model nobody hooked: PyTorch forward hooks and jhooks operation addresses
#
# Interpretability starts from a model someone else wrote: no `HookPoint`, no `hook_point`,
# an attention pattern computed by a `softmax` inside `forward`, a residual stream that is a
# plain `+`. Here the same small transformer is written twice, in plain PyTorch and in plain
# Equinox (the weights copied), with nothing added for hooks. On each we read the attention
# pattern, the per-head outputs and the residual stream between attention and MLP, patch
# one head, and take a gradient:
#
# | what | PyTorch | jhooks |
# |---|---|---|
# | a module's output | `register_forward_hook` | the module's path: `blocks.0.attn` |
# | a module's input (per-head `z`) | `register_forward_pre_hook` on `o_proj` | `blocks.0.attn.o_proj:in` |
# | a value computed inside `forward` (the pattern) | nnsight's `.source`, or edit the code | `blocks.0.attn/softmax` |
# | a plain `+` (the residual stream) | a pre-hook on the next module that reads it | `blocks.0/add` |
# | list what can be hooked | `print(model)`, nnsight's `print(module.source)` | `jhooks.ops(model, tokens)` |
#
# Every number is checked against PyTorch with `np.testing.assert_allclose`, with and without
# `jax.jit`.

# %%
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

VOCAB, D, HEADS, LAYERS, T = 11, 16, 4, 2, 6
D_HEAD = D // HEADS
tokens_np = np.array([3, 1, 4, 1, 5, 9])


def check(jax_value, torch_value, rtol=1e-5, atol=1e-6):
    if isinstance(torch_value, torch.Tensor):
        torch_value = torch_value.detach().numpy()
    np.testing.assert_allclose(np.asarray(jax_value), torch_value, rtol=rtol, atol=atol)


# %% [markdown]
# ## The PyTorch model, as its author wrote it
#
# A causal two-layer transformer: the attention's softmax and the residual `+` are plain
# code in `forward`, not modules.


# %%
class TorchAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(D, D) for _ in range(4)
        )

    def forward(self, x):
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(x).view(T, HEADS, D_HEAD).transpose(0, 1) for p in projections)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D_HEAD)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        pattern = torch.softmax(scores.masked_fill(~causal, -torch.inf), dim=-1)
        z = (pattern @ v).transpose(0, 1).reshape(T, D)
        return self.o_proj(z)


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.attn = TorchAttention()
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TorchModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList([TorchBlock() for _ in range(LAYERS)])
        self.unembed = torch.nn.Linear(D, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


torch.manual_seed(0)
torch_model = TorchModel()
tokens_t = torch.from_numpy(tokens_np)

# %% [markdown]
# ## The same model in plain Equinox, the weights copied


# %%
class Attention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __call__(self, x):
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (jax.vmap(p)(x).reshape(T, HEADS, D_HEAD).transpose(1, 0, 2) for p in projections)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(D_HEAD)
        causal = jnp.tril(jnp.ones((T, T), bool))
        pattern = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        z = (pattern @ v).transpose(1, 0, 2).reshape(T, D)
        return jax.vmap(self.o_proj)(z)


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    attn: Attention
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __call__(self, x):
        x = x + self.attn(jax.vmap(self.ln1)(x))
        hidden = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.ln2)(x)), approximate=False)
        return x + jax.vmap(self.fc2)(hidden)


class Model(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    unembed: eqx.nn.Linear

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembed)(x)


def from_torch(module):
    """The Equinox layer with the PyTorch layer's weights."""
    array = lambda p: jnp.asarray(p.detach().numpy())  # noqa: E731
    if isinstance(module, torch.nn.Embedding):
        return eqx.nn.Embedding(weight=array(module.weight))
    if isinstance(module, torch.nn.LayerNorm):
        layer = eqx.nn.LayerNorm(D, eps=module.eps)
    else:
        out, inp = module.weight.shape
        layer = eqx.nn.Linear(inp, out, key=jax.random.key(0))
    weights = (array(module.weight), array(module.bias))
    return eqx.tree_at(lambda m: (m.weight, m.bias), layer, weights)


def block_from_torch(b):
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    attn = Attention(*(from_torch(getattr(b.attn, name)) for name in projections))
    return Block(from_torch(b.ln1), from_torch(b.ln2), attn, from_torch(b.fc1), from_torch(b.fc2))


blocks = [block_from_torch(b) for b in torch_model.blocks]
model = jhooks.hookable(
    Model(from_torch(torch_model.embed), blocks, from_torch(torch_model.unembed))
)
tokens = jnp.asarray(tokens_np)
check(model(tokens), torch_model(tokens_t), atol=1e-5)

# %% [markdown]
# ## TransformerLens' names for this model
#
# Coming from TransformerLens, the names you know can stand for these addresses: a
# `jhooks.NameMap` maps each template (`{i}` for the layer) to the address it stands for,
# and a `jhooks.Name` can carry functions to and from TransformerLens' layout. Here
# `hook_z` is `o_proj`'s input, `(pos, d_model)`, read as `(pos, head, d_head)`.
# (`jhooks.transformer_lens_names("llama3")`, `"qwen3"` and `"gemma3"` are the maps of
# tunix's published models, installed with `pip install "jhooks[tunix]"`.)

# %%
tl = jhooks.NameMap(
    {
        "blocks.{i}.hook_resid_pre": "blocks.{i}:in",
        "blocks.{i}.attn.hook_pattern": "blocks.{i}.attn/softmax",
        "blocks.{i}.attn.hook_z": jhooks.Name(
            "blocks.{i}.attn.o_proj:in",
            read=lambda z: z.reshape(T, HEADS, D_HEAD),
            write=lambda z, new: new.reshape(z.shape),
        ),
        "blocks.{i}.hook_resid_mid": "blocks.{i}/add",
        "blocks.{i}.hook_resid_post": "blocks.{i}",
    },
    "this model",
)
logits, cache = tl.run_with_cache(
    model, tokens, names_filter=["blocks.*.attn.hook_z", "blocks.1.hook_resid_mid"]
)
{name: value.shape for name, value in cache.items()}

# %% [markdown]
# The same values from PyTorch's hooks (the input of `o_proj`, of `ln2`), and a head
# ablated by name, in TransformerLens' form `hook(value, hook)`:

# %%
seen_t = {}
handles = [
    torch_model.blocks[1].attn.o_proj.register_forward_pre_hook(
        lambda m, args: seen_t.update(z=args[0])
    ),
    torch_model.blocks[1].ln2.register_forward_pre_hook(
        lambda m, args: seen_t.update(resid_mid=args[0])
    ),
]
with torch.no_grad():
    torch_model(tokens_t)
for handle in handles:
    handle.remove()
check(cache["blocks.1.attn.hook_z"], seen_t["z"].view(T, HEADS, D_HEAD))
check(cache["blocks.1.hook_resid_mid"], seen_t["resid_mid"])


def ablate_head_1(z, hook):
    print(hook.name, hook.layer(), z.shape)  # blocks.0.attn.hook_z 0 (6, 4, 4)
    return z.at[:, 1].set(0.0)


def zero_head_1_t(module, args):
    return (args[0].view(T, HEADS, D_HEAD).index_fill(1, torch.tensor([1]), 0.0).view(T, D),)


handle = torch_model.blocks[0].attn.o_proj.register_forward_pre_hook(zero_head_1_t)
with torch.no_grad():
    ablated_t = torch_model(tokens_t)
handle.remove()
ablated = jax.jit(
    lambda t: tl.run_with_hooks(model, t, fwd_hooks=[("blocks.0.attn.hook_z", ablate_head_1)])
)(tokens)
check(ablated, ablated_t, atol=1e-5)

# %% [markdown]
# ## What can be hooked
#
# In PyTorch, `print(model)` lists the modules: the places a forward hook can go. The
# softmax and the `+` are not there. nnsight's `print(model.blocks[0].attn.source)` shows
# the operations inside `forward`, by rewriting its source.
#
# In jhooks, `jhooks.ops(model, tokens)` traces the model (nothing compiled, nothing changed)
# and lists every operation by its address, `<module path>/<operation>`, with its shape and
# source line, as nnsight's `.source` does. A module's input is a point too, `<path>:in`.

# %%
for op in jhooks.ops(model, tokens):  # the first block's own operations and its attention's
    if op.address.split("/")[0] in ("blocks.0", "blocks.0.attn"):
        print(f"{op.address:28} {str(op.shape):14} {op.source.rsplit('/', 1)[-1]}")

# %% [markdown]
# The three values we want:

# %%
PATTERN, Z, RESID_MID = "blocks.0.attn/softmax", "blocks.0.attn.o_proj:in", "blocks.0/add"
addresses = {op.address: op for op in jhooks.ops(model, tokens)}
[(name, addresses[name].shape) for name in (PATTERN, RESID_MID)]

# %% [markdown]
# ## Reading the values
#
# **PyTorch.** The per-head outputs are the input of `o_proj` (a forward pre-hook), and the
# residual stream between attention and MLP is the input of `ln2`. The pattern has no
# module: nnsight's `.source` names each call inside `forward` (not run here):
#
# ```python
# traced = nnsight.NNsight(torch_model)
# with traced.trace(tokens_t):
#     pattern = traced.blocks[0].attn.source.torch_softmax_0.output.save()
# ```
#
# With forward hooks alone we read q and k from their projections and compute the softmax
# again by hand.

# %%
seen = {}


def keep(name):
    def hook(module, args, output=None):
        seen[name] = args[0] if output is None else output

    return hook


attn_t = torch_model.blocks[0].attn
handles = [
    attn_t.q_proj.register_forward_hook(keep("q")),
    attn_t.k_proj.register_forward_hook(keep("k")),
    attn_t.o_proj.register_forward_pre_hook(keep("z")),
    torch_model.blocks[0].ln2.register_forward_pre_hook(keep("resid_mid")),
]
with torch.no_grad():
    torch_logits = torch_model(tokens_t)
for handle in handles:
    handle.remove()
q, k = (seen[n].view(T, HEADS, D_HEAD).transpose(0, 1) for n in ("q", "k"))
scores = q @ k.transpose(-1, -2) / math.sqrt(D_HEAD)
causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
torch_pattern = torch.softmax(scores.masked_fill(~causal, -torch.inf), dim=-1)

# %% [markdown]
# **jhooks.** One `run_with_cache` with the three names; the pattern comes with all heads,
# `(heads, q, k)`.

# %%
for jit in (False, True):
    run = lambda t: jhooks.run_with_cache(model, t, names_filter=[PATTERN, Z, RESID_MID])  # noqa: E731
    logits, cache = (jax.jit(run) if jit else run)(tokens)
    check(logits, torch_logits, atol=1e-5)
    check(cache[PATTERN], torch_pattern)
    check(cache[Z], seen["z"])
    check(cache[RESID_MID], seen["resid_mid"])
{name: value.shape for name, value in cache.items()}

# %% [markdown]
# ## Patching one head
#
# **PyTorch:** a forward pre-hook on `o_proj` returns its input with head 2's columns zeroed.
# **jhooks:** the same on `blocks.0.attn.o_proj:in`, and, since `z = pattern @ v`, zeroing
# head 2's pattern at `blocks.0.attn/softmax` gives the same logits.

# %%
HEAD = 2


def zero_head_torch(module, args):
    z = args[0].clone()
    z[:, HEAD * D_HEAD : (HEAD + 1) * D_HEAD] = 0.0
    return (z,)


handle = attn_t.o_proj.register_forward_pre_hook(zero_head_torch)
with torch.no_grad():
    torch_patched = torch_model(tokens_t)
handle.remove()


def zero_head_z(z, name):
    return z.at[:, HEAD * D_HEAD : (HEAD + 1) * D_HEAD].set(0.0)


def zero_head_pattern(pattern, name):
    return pattern.at[HEAD].set(0.0)  # the hook sees every head: (heads, q, k)


for jit in (False, True):
    wrap = jax.jit if jit else (lambda f: f)
    by_z = wrap(lambda t: jhooks.run_with_hooks(model, t, fwd_hooks=[(Z, zero_head_z)]))(tokens)
    by_pattern = wrap(
        lambda t: jhooks.run_with_hooks(model, t, fwd_hooks=[(PATTERN, zero_head_pattern)])
    )(tokens)
    check(by_z, torch_patched, atol=1e-5)
    check(by_pattern, torch_patched, atol=1e-5)
float(np.abs(np.asarray(by_z) - torch_logits.numpy()).max())  # the patch changed the logits

# %% [markdown]
# ## Gradients
#
# The gradient of a loss with respect to each value. **PyTorch:** `retain_grad()` on the
# tensors the hooks see; the pattern's gradient, again out of reach of hooks, follows from
# `z = pattern @ v`: `dL/dpattern = dL/dz @ vᵀ` per head. **jhooks:** `incl_bwd=True`
# caches `<name>_grad` for each name, the pattern's included.

# %%
seen.clear()


def keep_grad(name):
    def hook(module, args):
        args[0].retain_grad()
        seen[name] = args[0]

    return hook


handles = [
    attn_t.v_proj.register_forward_hook(keep("v")),
    attn_t.o_proj.register_forward_pre_hook(keep_grad("z")),
    torch_model.blocks[0].ln2.register_forward_pre_hook(keep_grad("resid_mid")),
]
torch_loss = torch_model(tokens_t).pow(2).sum()
torch_loss.backward()
for handle in handles:
    handle.remove()
dz = seen["z"].grad.view(T, HEADS, D_HEAD).transpose(0, 1)
v = seen["v"].detach().view(T, HEADS, D_HEAD).transpose(0, 1)
torch_pattern_grad = dz @ v.transpose(-1, -2)


def loss(tokens):
    return jnp.sum(model(tokens) ** 2)


names = [PATTERN, Z, RESID_MID]
for jit in (False, True):
    run = lambda t: jhooks.run_with_cache(loss, t, names_filter=names, incl_bwd=True)  # noqa: E731
    value, cache = (jax.jit(run) if jit else run)(tokens)
    check(value, torch_loss, rtol=1e-5)
    check(cache[PATTERN + "_grad"], torch_pattern_grad, rtol=1e-4, atol=1e-5)
    check(cache[Z + "_grad"], seen["z"].grad, rtol=1e-4, atol=1e-5)
    check(cache[RESID_MID + "_grad"], seen["resid_mid"].grad, rtol=1e-4, atol=1e-5)
sorted(cache)

# %% [markdown]
# ## What to take away
#
# - A value with a module around it (a projection's input or output) is a forward hook in
#   PyTorch and a point in jhooks (`blocks.0.attn.o_proj:in`).
# - A value computed inside `forward` (the softmax, the residual `+`) needs nnsight's
#   `.source` or an edit in PyTorch; in jhooks it has an address (`blocks.0.attn/softmax`,
#   `blocks.0/add`), listed by `jhooks.ops`, and works wherever a point name does: caches,
#   patches, backward values, under `jax.jit`.
# - A run that selects no address compiles to the model's own program.
#
# The documentation's pages "Hooking a model you did not write" and "Operations" say more:
# repeated module calls, shared modules, models published by others, and the rules of
# addresses.

# %% [markdown]
# ## The same model in Flax Linen
#
# A Linen module holds no arrays (`model.apply(variables, tokens)` takes them), so there is
# nothing to make hookable, and `jhooks.hookable` says so. A run names each module call by
# its Linen path instead (`module.path` joined with dots: `blocks_0.attn.o_proj`), and the
# operations inside have addresses, as above. The same transformer, written as Linen users
# write it, with the PyTorch weights:

# %%
import flax.linen as nn  # noqa: E402


class LinenAttention(nn.Module):
    def setup(self):
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Dense(D) for _ in range(4))

    def __call__(self, x):
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(x).reshape(T, HEADS, D_HEAD).transpose(1, 0, 2) for p in projections)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(D_HEAD)
        causal = jnp.tril(jnp.ones((T, T), bool))
        pattern = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return self.o_proj((pattern @ v).transpose(1, 0, 2).reshape(T, D))


class LinenBlock(nn.Module):
    def setup(self):
        self.ln1, self.ln2 = nn.LayerNorm(epsilon=1e-5), nn.LayerNorm(epsilon=1e-5)
        self.attn = LinenAttention()
        self.fc1, self.fc2 = nn.Dense(4 * D), nn.Dense(D)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)), approximate=False))


class LinenModel(nn.Module):
    def setup(self):
        self.embed = nn.Embed(VOCAB, D)
        self.blocks = [LinenBlock() for _ in range(LAYERS)]  # Linen names them blocks_0, ...
        self.unembed = nn.Dense(VOCAB)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


def linen_params(module):
    """Linen's parameter dict with the PyTorch module's weights (a kernel is `weight.T`)."""
    array = lambda p: jnp.asarray(p.detach().numpy())  # noqa: E731
    if isinstance(module, torch.nn.Embedding):
        return {"embedding": array(module.weight)}
    if isinstance(module, torch.nn.LayerNorm):
        return {"scale": array(module.weight), "bias": array(module.bias)}
    if isinstance(module, torch.nn.Linear):
        return {"kernel": array(module.weight).T, "bias": array(module.bias)}
    params = {}
    for name, child in module.named_children():
        if isinstance(child, torch.nn.ModuleList):
            params.update({f"{name}_{i}": linen_params(c) for i, c in enumerate(child)})
        else:
            params[name] = linen_params(child)
    return params


linen_model = LinenModel()
variables = {"params": linen_params(torch_model)}
check(linen_model.apply(variables, tokens), torch_logits, atol=1e-5)
try:
    jhooks.hookable(linen_model)
except TypeError as error:
    print(str(error)[:120], "...")

# %% [markdown]
# The pattern and the per-head outputs by name, and head 2 zeroed at its pattern, against
# PyTorch's numbers from above:

# %%
LINEN_PATTERN, LINEN_Z = "blocks_0.attn/softmax", "blocks_0.attn.o_proj:in"
for jit in (False, True):
    wrap = jax.jit if jit else (lambda f: f)
    logits, cache = wrap(
        lambda v, t: jhooks.run_with_cache(
            linen_model.apply, v, t, names_filter=[LINEN_PATTERN, LINEN_Z]
        )
    )(variables, tokens)
    check(logits, torch_logits, atol=1e-5)
    check(cache[LINEN_PATTERN], torch_pattern)
    check(cache[LINEN_Z], seen["z"])
    patched = wrap(
        lambda v, t: jhooks.run_with_hooks(
            linen_model.apply, v, t, fwd_hooks=[(LINEN_PATTERN, zero_head_pattern)]
        )
    )(variables, tokens)
    check(patched, torch_patched, atol=1e-5)
[
    op.address
    for op in jhooks.ops(linen_model.apply, variables, tokens)
    if "blocks_0.attn/" in op.address
]

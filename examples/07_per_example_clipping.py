# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Per-example clipping and DP-SGD: Opacus' ghost clipping in JAX
#
# DP-SGD clips every example's gradient to a norm `C`, sums them, adds Gaussian noise and
# steps. The textbook implementation holds one gradient per example (`jax.vmap(jax.grad)`,
# Opacus' `grad_sample_mode="hooks"`): batch size x parameters of memory. *Ghost clipping*
# (Opacus' `grad_sample_mode="ghost"`) never does: it computes each example's gradient norm
# from the layers' inputs and output gradients, then takes the gradient of the loss
# reweighted by `min(1, C / norm_i)`.
#
# | PyTorch (Opacus) | jhooks |
# |---|---|
# | `GradSampleModuleFastGradientClipping(model, max_grad_norm=C, use_ghost_clipping=True)` with `DPLossFastGradientClipping`, `loss.backward()` | `grads, norms = jhooks.clipped_grad(per_example_loss, C)(model, xs, ys)` |
# | `GradSampleModule(model)` + `DPOptimizer` (per-example gradients) | `jax.vmap(eqx.filter_grad(per_example_loss))` then clip |
# | `gsm.per_sample_gradient_norms` | `norms` |
# | `DPOptimizer(noise_multiplier=σ)` | `grads + σ·C·N(0, I)`, then any optax optimizer |
#
# Below: the same weights and batches in Equinox and PyTorch, noise 0, the same clipped
# gradients (asserted); then short DP-SGD training runs with noise. A small CNN first, then a
# small transformer (`eqx.nn.MultiheadAttention`, `LayerNorm`, `Embedding`).

# %%
import math
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

import jhooks

warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Optimal order is the")
torch.manual_seed(0)
torch.set_num_threads(1)  # steadier than PyTorch's default on a small shared CPU
C = 1.0  # the clipping norm
B = 32  # the batch size

# %% [markdown]
# ## A small CNN
#
# Synthetic data: ten class prototypes, each example one of them plus noise.

# %%
rng = np.random.default_rng(0)
prototypes = rng.standard_normal((10, 1, 16, 16)).astype(np.float32)


def image_batch(n):
    y = rng.integers(0, 10, n)
    x = prototypes[y] + 1.5 * rng.standard_normal((n, 1, 16, 16)).astype(np.float32)
    return x, y.astype(np.int32)


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 8, 3, stride=2, key=k1)
        self.conv2 = eqx.nn.Conv2d(8, 16, 3, stride=2, key=k2)
        self.fc = eqx.nn.Linear(16 * 3 * 3, 10, key=k3)

    def __call__(self, x):  # ONE image (1, 16, 16)
        h = jax.nn.relu(self.conv1(x))
        h = jax.nn.relu(self.conv2(h))
        return self.fc(h.reshape(-1))


class TorchCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, stride=2)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16 * 3 * 3, 10)

    def forward(self, x):  # a batch
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.fc(h.flatten(1))


def to_torch(eqx_model, torch_model):
    """Copies an Equinox model's weights into its PyTorch twin, by parameter name."""
    state = {}
    for name, _ in torch_model.named_parameters():
        leaf = eqx_model
        for part in name.split("."):
            leaf = leaf[int(part)] if part.isdigit() else getattr(leaf, part)
        target = dict(torch_model.named_parameters())[name]
        state[name] = torch.tensor(np.asarray(leaf)).reshape(target.shape)
    torch_model.load_state_dict(state)
    return torch_model


def xent(model, x, y):  # the loss of ONE example
    return -jax.nn.log_softmax(model(x))[y]


cnn = CNN(jax.random.key(0))
xs, ys = image_batch(B)

# %% [markdown]
# jhooks: one call, jitted. `norms[i]` is example i's gradient norm over every parameter;
# `grads` is the sum of the clipped per-example gradients, shaped like `eqx.filter_grad`'s.

# %%
clipped = eqx.filter_jit(jhooks.clipped_grad(xent, C))
grads, norms = clipped(cnn, xs, ys)
print("per-example norms:", np.round(np.asarray(norms[:6]), 3))

# %% [markdown]
# Opacus, ghost clipping: `loss.backward()` runs two backward passes; `p.grad` is the clipped
# sum (`loss_reduction="sum"`, no noise yet).


# %%
def opacus_ghost(torch_model, x, y):
    gsm = GradSampleModuleFastGradientClipping(
        torch_model, max_grad_norm=C, use_ghost_clipping=True, loss_reduction="sum"
    )
    sgd = torch.optim.SGD(gsm.parameters(), lr=0.0)
    optimizer = DPOptimizerFastGradientClipping(
        sgd, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=len(x), loss_reduction="sum"
    )
    criterion = DPLossFastGradientClipping(
        gsm, optimizer, nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum"
    )
    optimizer.zero_grad()
    loss = criterion(gsm(torch.as_tensor(x)), torch.as_tensor(y).long())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in torch_model.named_parameters()}
    norms = gsm.per_sample_gradient_norms.clone()
    gsm._close()
    return grads, norms


def opacus_hooks(torch_model, x, y):
    gsm = GradSampleModule(torch_model, loss_reduction="sum")
    sgd = torch.optim.SGD(gsm.parameters(), lr=0.0)
    optimizer = DPOptimizer(
        sgd, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=len(x), loss_reduction="sum"
    )
    optimizer.zero_grad()
    F.cross_entropy(gsm(torch.as_tensor(x)), torch.as_tensor(y).long(), reduction="sum").backward()
    optimizer.pre_step()  # clip each example's gradient (p.grad_sample), sum, add noise 0
    grads = {n: p.grad.clone() for n, p in torch_model.named_parameters()}
    gsm._close()
    return grads


def check(eqx_grads, torch_grads):
    for name, g in torch_grads.items():
        leaf = eqx_grads
        for part in name.split("."):
            leaf = leaf[int(part)] if part.isdigit() else getattr(leaf, part)
        np.testing.assert_allclose(
            np.asarray(leaf).reshape(g.shape), g.numpy(), rtol=1e-4, atol=1e-6, err_msg=name
        )
    print(f"same clipped gradients for {len(torch_grads)} parameters")


ghost_grads, ghost_norms = opacus_ghost(to_torch(cnn, TorchCNN()), xs, ys)
np.testing.assert_allclose(np.asarray(norms), ghost_norms.numpy(), rtol=1e-4)
check(grads, ghost_grads)
check(grads, opacus_hooks(to_torch(cnn, TorchCNN()), xs, ys))

# %% [markdown]
# ## A small transformer
#
# Token and position embeddings, one pre-norm block (`eqx.nn.MultiheadAttention` and a GELU
# MLP), mean pooling, a linear classifier. The PyTorch twin writes the attention out with four
# `nn.Linear` projections, as `eqx.nn.MultiheadAttention` has, so Opacus sees layers it knows
# (`Embedding`, `LayerNorm`, `Linear`). The task: which of three token groups a sequence
# draws most of its tokens from.

# %%
V, D, T, H = 24, 32, 12, 4


def token_batch(n):
    y = rng.integers(0, 3, n)
    favoured = rng.integers(0, 8, (n, T)) + 8 * y[:, None]
    uniform = rng.integers(0, V, (n, T))
    ids = np.where(rng.random((n, T)) < 0.5, favoured, uniform)
    return ids.astype(np.int32), y.astype(np.int32)


class Transformer(eqx.Module):
    tok: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 6)
        self.tok, self.pos = eqx.nn.Embedding(V, D, key=ks[0]), eqx.nn.Embedding(T, D, key=ks[1])
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(H, D, key=ks[2])
        self.fc1, self.fc2 = eqx.nn.Linear(D, 2 * D, key=ks[3]), eqx.nn.Linear(2 * D, D, key=ks[4])
        self.head = eqx.nn.Linear(D, 3, key=ks[5])

    def __call__(self, ids):  # ONE sequence (T,)
        h = jax.vmap(self.tok)(ids) + jax.vmap(self.pos)(jnp.arange(T))
        x = jax.vmap(self.ln1)(h)
        h = h + self.attn(x, x, x)
        x = jax.vmap(self.ln2)(h)
        h = h + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))
        return self.head(jnp.mean(h, axis=0))


class Projections(nn.Module):  # the names of eqx.nn.MultiheadAttention's projections
    def __init__(self):
        super().__init__()
        for name in ("query_proj", "key_proj", "value_proj", "output_proj"):
            setattr(self, name, nn.Linear(D, D, bias=False))


class TorchTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Projections()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, ids):  # a batch (B, T)
        b = ids.shape[0]
        h = self.tok(ids) + self.pos(torch.arange(T).repeat(b, 1))
        x = self.ln1(h)

        def heads(z):
            return z.view(b, T, H, D // H).transpose(1, 2)

        a = self.attn
        q, k, v = heads(a.query_proj(x)), heads(a.key_proj(x)), heads(a.value_proj(x))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // H), dim=-1)
        h = h + a.output_proj((weights @ v).transpose(1, 2).reshape(b, T, D))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))
        return self.head(h.mean(dim=1))


transformer = Transformer(jax.random.key(1))
ids, labels = token_batch(B)
grads, norms = eqx.filter_jit(jhooks.clipped_grad(xent, C))(transformer, ids, labels)
print("per-example norms:", np.round(np.asarray(norms[:6]), 3))

ghost_grads, ghost_norms = opacus_ghost(to_torch(transformer, TorchTransformer()), ids, labels)
np.testing.assert_allclose(np.asarray(norms), ghost_norms.numpy(), rtol=1e-4)
check(grads, ghost_grads)
check(grads, opacus_hooks(to_torch(transformer, TorchTransformer()), ids, labels))

# %% [markdown]
# ## DP-SGD with noise
#
# The DP-SGD update is the clipped sum plus `N(0, σ²C²)` noise on every coordinate, divided
# by the batch size, fed to any optax optimizer. The same step with Opacus' ghost clipping
# (`DPOptimizerFastGradientClipping(noise_multiplier=σ)`) runs beside it from the same
# weights on the same batches; the noise draws differ, so the curves agree in trend, not
# step by step. `σ = 0` is clipping alone (jhooks only).

# %%
SIGMA, STEPS, LR = 0.8, 30, 0.08


def dp_sgd_jax(model, batches, sigmas, key):
    """Training losses of DP-SGD from `model`, one run per noise multiplier in `sigmas`."""
    optim = optax.adam(LR)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    clipped = jhooks.clipped_grad(xent, C)

    @eqx.filter_jit
    def step(params, opt_state, x, y, sigma, key):
        model = eqx.combine(params, static)
        grads, _ = clipped(model, x, y)
        leaves, treedef = jax.tree.flatten(grads)
        keys = jax.random.split(key, len(leaves))
        noisy = [
            (g + sigma * C * jax.random.normal(k, g.shape, g.dtype)) / x.shape[0]
            for g, k in zip(leaves, keys)
        ]
        updates, opt_state = optim.update(jax.tree.unflatten(treedef, noisy), opt_state)
        loss = jnp.mean(jax.vmap(xent, (None, 0, 0))(model, x, y))
        return eqx.apply_updates(params, updates), opt_state, loss

    runs, seconds = {}, []  # each step's wall time: the first one traces and compiles
    for sigma in sigmas:
        p, opt_state, losses = params, optim.init(params), []
        for x, y in batches:
            start = time.perf_counter()
            key, sub = jax.random.split(key)
            p, opt_state, loss = step(p, opt_state, x, y, jnp.float32(sigma), sub)
            losses.append(float(loss))  # waits for the step
            seconds.append(time.perf_counter() - start)
        runs[f"jhooks σ={sigma}"] = losses
    return runs, seconds


def dp_sgd_opacus(torch_model, batches, sigma):
    gsm = GradSampleModuleFastGradientClipping(
        torch_model, max_grad_norm=C, use_ghost_clipping=True, loss_reduction="mean"
    )
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.Adam(gsm.parameters(), lr=LR),
        noise_multiplier=sigma,
        max_grad_norm=C,
        expected_batch_size=B,
        loss_reduction="mean",
    )
    criterion = DPLossFastGradientClipping(
        gsm, optimizer, nn.CrossEntropyLoss(reduction="mean"), loss_reduction="mean"
    )
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = criterion(gsm(torch.as_tensor(x)), torch.as_tensor(y).long())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    gsm._close()
    return losses


def curves(model, torch_twin, make_batch):
    batches = [make_batch(B) for _ in range(STEPS)]
    runs, seconds = dp_sgd_jax(model, batches, (0.0, SIGMA), jax.random.key(2))
    start = time.perf_counter()
    runs[f"Opacus ghost σ={SIGMA}"] = dp_sgd_opacus(to_torch(model, torch_twin()), batches, SIGMA)
    opacus = (time.perf_counter() - start) / STEPS
    # Compile time and warm time apart: the first jhooks step traces and compiles the step
    # (once for both runs: σ is an argument); the others run the compiled program.
    print(
        f"jhooks: first step {seconds[0]:.1f} s (tracing and compiling), then "
        f"{1e3 * np.median(seconds[1:]):.1f} ms a step (median of {len(seconds) - 1}); "
        f"Opacus: {1e3 * opacus:.1f} ms a step (eager, no compilation)"
    )
    return runs


fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for ax, (title, runs) in zip(
    axes,
    [
        ("small CNN", curves(cnn, TorchCNN, image_batch)),
        ("small transformer", curves(transformer, TorchTransformer, token_batch)),
    ],
):
    for label, losses in runs.items():
        ax.plot(losses, label=label, linestyle="-" if "jhooks" in label else "--")
    ax.set(title=title, xlabel="step", ylabel="training loss")
    ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# For a privacy guarantee, sample the batches by Poisson sampling and account for the
# privacy spent (Opacus' `RDPAccountant` needs nothing but `σ`, the sampling rate and the
# number of steps). The cost of `jhooks.clipped_grad` against a plain gradient and against
# Opacus is measured by `python -m benchmarks.clipping` (see *Per-example clipping* in the docs).

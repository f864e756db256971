# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Hooks that see values and pass them on: Opacus, K-FAC, Grad-CAM, path patching
#
# A PyTorch hook is Python that runs on tensors: it prints, calls `float()`, branches on a
# value, keeps an activation in a dict for a later hook to read. Called outside your own
# `jax.jit` (an *eager* run), `jhooks.run_with_hooks` calls such a hook the same way: on
# concrete arrays, when the program reaches its point (torch.compile's *graph break*; the
# program before and after it stays compiled), forward hooks in the forward pass and
# backward hooks in the backward pass, where they read what the forward hooks kept. The
# documentation's *Semantics* page ("The rule of runs") says the rest.
#
# | section | hooks | PyTorch | jhooks |
# |---|---|---|---|
# | [1. Hooks see values](#1-hooks-see-values) | a forward hook prints and branches on `float(z.mean())` | `register_forward_hook` | `fwd_hooks` |
# | [2. Per-example gradient norms](#2-per-example-gradient-norms-as-opacus-computes-them) | forward keeps a layer's input, backward computes the norms | `register_forward_hook` + `register_full_backward_hook` | `fwd_hooks` + `bwd_hooks` |
# | [3. K-FAC factors](#3-k-fac-factors) | the same pair, on every layer | the same | the same |
# | [4. Grad-CAM](#4-grad-cam) | forward keeps the feature maps, backward weighs them | the same | the same |
# | [5. Path patching in one forward](#5-path-patching-in-one-forward) | one hook stores, a later one adds | two forward hooks | two `fwd_hooks` |
# | [Under your own `jax.jit`](#under-your-own-jaxjit) | a backward hook reads what a forward hook kept, traced | `register_full_backward_pre_hook` | `bwd_hooks` in `eqx.filter_jit` |
#
# Each section runs the PyTorch hooks and their jhooks twins on the same weights and ends
# with `np.testing.assert_allclose`.

# %%
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

# %% [markdown]
# ## The models
#
# PyTorch's layers take a batch, and the hooks below read the whole batch (a per-example
# norm is one row of it), so the Equinox layers here take a batch too: a `Linear` is
# `x @ weight.T + bias`, as `torch.nn.Linear`. (Under a `jax.vmap` hooks are traced, one
# example at a time: see *Semantics*, "The batch dimension under `jax.vmap`".) `jhooks.hookable` makes
# every module's output a named point (`fc1`, `act1`...) and its input one too (`fc3:in`).
# Each PyTorch twin has the same module names and a copy of the weights.


# %%
class Linear(eqx.Module):
    weight: jax.Array  # (out, in), as torch.nn.Linear's
    bias: jax.Array

    def __init__(self, n_in, n_out, rng):
        self.weight = jnp.asarray(rng.normal(size=(n_out, n_in)) / np.sqrt(n_in), jnp.float32)
        self.bias = jnp.asarray(0.1 * rng.normal(size=n_out), jnp.float32)

    def __call__(self, x):
        return x @ self.weight.T + self.bias


class Tanh(eqx.Module):
    def __call__(self, x):
        return jnp.tanh(x)


class MLP(eqx.Module):
    fc1: Linear
    act1: Tanh
    fc2: Linear
    act2: Tanh
    fc3: Linear

    def __init__(self, rng):
        self.fc1, self.act1 = Linear(4, 6, rng), Tanh()
        self.fc2, self.act2 = Linear(6, 6, rng), Tanh()
        self.fc3 = Linear(6, 3, rng)

    def __call__(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


def copy_weights(torch_net, net, names):
    with torch.no_grad():
        for name in names:
            getattr(torch_net, name).weight.copy_(torch.tensor(np.asarray(getattr(net, name).weight)))  # fmt: skip
            getattr(torch_net, name).bias.copy_(torch.tensor(np.asarray(getattr(net, name).bias)))
    return torch_net


class TorchMLP(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.fc1, self.act1 = torch.nn.Linear(4, 6), torch.nn.Tanh()
        self.fc2, self.act2 = torch.nn.Linear(6, 6), torch.nn.Tanh()
        self.fc3 = torch.nn.Linear(6, 3)
        copy_weights(self, net, ["fc1", "fc2", "fc3"])

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


rng = np.random.default_rng(0)
x_np = rng.normal(size=(8, 4)).astype(np.float32)
y_np = rng.normal(size=(8, 3)).astype(np.float32)
net = jhooks.hookable(MLP(rng))
torch_net = TorchMLP(net)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


close(net(x_np), torch_net(torch.from_numpy(x_np)).detach())

# %% [markdown]
# ## 1. Hooks see values
#
# A forward hook on `act1` prints the layer's mean, and when the mean is positive, zeroes
# the layer. `float(z.mean())` and the `if` need the value: PyTorch has it, and so does an
# eager run. Two inputs, `x` and `-x`, take the two branches.
#
# ### PyTorch: a hook that branches

# %%
torch_means = []


def torch_gate(module, args, output):
    mean = float(output.mean())
    torch_means.append(mean)
    print(f"act1 mean {mean:+.4f}", "-> zeroed" if mean > 0 else "-> kept")
    if mean > 0:
        return output * 0.0
    return None


handle = torch_net.act1.register_forward_hook(torch_gate)
with torch.no_grad():
    torch_outs = [torch_net(torch.from_numpy(x)).numpy() for x in (x_np, -x_np)]
handle.remove()

# %% [markdown]
# ### jhooks: a hook that branches
#
# The same hook, with jhooks' signature `hook(value, name)`. It runs on every call, on that
# call's values, and what it returns replaces the layer's output.

# %%
means = []


def gate(z, name):
    mean = float(z.mean())
    means.append(mean)
    print(f"{name} mean {mean:+.4f}", "-> zeroed" if mean > 0 else "-> kept")
    if mean > 0:
        return z * 0.0
    return None


outs = [jhooks.run_with_hooks(net, x, fwd_hooks=[("act1", gate)]) for x in (x_np, -x_np)]

assert all(type(m) is float for m in means)  # Python floats, as float() gives in PyTorch
close(means, torch_means)
assert (means[0] > 0) != (means[1] > 0)  # the two inputs took the two branches
for out, torch_out in zip(outs, torch_outs):
    close(out, torch_out)

# %% [markdown]
# ## 2. Per-example gradient norms, as Opacus computes them
#
# DP-SGD needs the norm of each example's gradient. Opacus gets it without computing the
# per-example gradients themselves: for a linear layer, example *i*'s gradient of the
# weight and bias is the outer product of the gradient of the output `g_i` and the input
# with a 1 appended `[a_i, 1]`, so its norm is `||g_i|| · ||[a_i, 1]||`. A forward hook
# keeps the input of `fc3`, a backward hook on `fc3` computes the norms. The loss is a sum
# over examples, so that `g_i` is example *i*'s own gradient.
#
# ### PyTorch: per-example norms

# %%
torch_kept, torch_norms = {}, []


def torch_keep_input(module, args, output):
    torch_kept["a"] = args[0].detach()


def torch_per_example_norms(module, grad_input, grad_output):
    g, a = grad_output[0], torch_kept["a"]
    a1 = torch.cat([a, torch.ones(len(a), 1)], dim=1)
    torch_norms.append((g.norm(dim=1) * a1.norm(dim=1)).numpy())


handles = [
    torch_net.fc3.register_forward_hook(torch_keep_input),
    torch_net.fc3.register_full_backward_hook(torch_per_example_norms),
]
torch_net.zero_grad()
torch_loss = ((torch_net(torch.from_numpy(x_np)) - torch.from_numpy(y_np)) ** 2).sum()
torch_loss.backward()
for handle in handles:
    handle.remove()
print("PyTorch:", np.round(torch_norms[0], 4))

# %% [markdown]
# ### jhooks: per-example norms
#
# The forward hook is on the point `fc3:in` (the layer's input), the backward hook on
# `fc3` (its output). `eqx.filter_grad` differentiates the run: the forward hook keeps a
# concrete array, and the backward hook runs in the backward pass, with the concrete
# gradient, reading it. Both are plain NumPy.

# %%
kept, norms = {}, []


def keep_input(a, name):
    kept["a"] = np.asarray(a)


def per_example_norms(g, name):
    g, a = np.asarray(g), kept["a"]
    a1 = np.concatenate([a, np.ones((len(a), 1), a.dtype)], axis=1)
    norms.append(np.linalg.norm(g, axis=1) * np.linalg.norm(a1, axis=1))


@eqx.filter_grad
def grads_with_norms(net, x, y):
    out = jhooks.run_with_hooks(
        net, x, fwd_hooks=[("fc3:in", keep_input)], bwd_hooks=[("fc3", per_example_norms)]
    )
    return jnp.sum((out - y) ** 2)


grads = grads_with_norms(net, x_np, y_np)
print("jhooks: ", np.round(norms[0], 4))

# %% [markdown]
# The reference: each example's gradient, computed with `jax.vmap(jax.grad(...))`, and its
# norm over `fc3`'s weight and bias.

# %%
per_example = jax.vmap(
    eqx.filter_grad(lambda net, x, y: jnp.sum((net(x[None]) - y) ** 2)), in_axes=(None, 0, 0)
)(net, x_np, y_np)
reference = np.sqrt(
    np.sum(np.asarray(per_example.fc3.weight) ** 2, axis=(1, 2))
    + np.sum(np.asarray(per_example.fc3.bias) ** 2, axis=1)
)

assert len(norms) == 1  # once per backward pass
close(norms[0], reference)
close(norms[0], torch_norms[0])
close(grads.fc3.weight, torch_net.fc3.weight.grad)  # and the run's gradients are PyTorch's

# %% [markdown]
# ## 3. K-FAC factors
#
# K-FAC approximates each linear layer's block of the Fisher by `A ⊗ G`, with
# `A = aᵀa / n` from the layer's input and `G = gᵀg / n` from the gradient of its output.
# One hook pair per layer; the name a hook is given says which layer it is on.
#
# ### PyTorch: K-FAC factors

# %%
torch_A, torch_G = {}, {}


def torch_factor_A(name):
    def hook(module, args, output):
        a = args[0].detach()
        torch_A[name] = (a.T @ a / len(a)).numpy()

    return hook


def torch_factor_G(name):
    def hook(module, grad_input, grad_output):
        g = grad_output[0]
        torch_G[name] = (g.T @ g / len(g)).numpy()

    return hook


layers = ["fc1", "fc2", "fc3"]
handles = [getattr(torch_net, n).register_forward_hook(torch_factor_A(n)) for n in layers]
handles += [getattr(torch_net, n).register_full_backward_hook(torch_factor_G(n)) for n in layers]
torch_net.zero_grad()
x = torch.from_numpy(x_np).requires_grad_()  # so that fc1's backward hook has an input gradient
((torch_net(x) - torch.from_numpy(y_np)) ** 2).sum().backward()
for handle in handles:
    handle.remove()

# %% [markdown]
# ### jhooks: K-FAC factors

# %%
A, G = {}, {}


def factor_A(a, name):
    a = np.asarray(a)
    A[str(name).removesuffix(":in")] = a.T @ a / len(a)


def factor_G(g, name):
    g = np.asarray(g)
    G[str(name)] = g.T @ g / len(g)


@eqx.filter_grad
def grads_with_factors(net, x, y):
    out = jhooks.run_with_hooks(
        net,
        x,
        fwd_hooks=[(f"{n}:in", factor_A) for n in layers],
        bwd_hooks=[(n, factor_G) for n in layers],
    )
    return jnp.sum((out - y) ** 2)


grads_with_factors(net, x_np, y_np)
print({n: (A[n].shape, G[n].shape) for n in layers})

for n in layers:
    close(A[n], torch_A[n])
    close(G[n], torch_G[n])

# %% [markdown]
# ## 4. Grad-CAM
#
# Grad-CAM weighs a convolution's feature maps by the mean gradient of the class score over
# each map, `w_c = mean_xy ∂score/∂A_c`, and keeps the positive part of their weighted sum,
# `cam = relu(Σ_c w_c A_c)`. A forward hook keeps the feature maps (the output of `act`),
# a backward hook on the same module computes the map. The net: a 3×3 convolution with
# three channels, a ReLU and a linear layer, on 6×6 images; the convolution takes a batch
# (NCHW), as `torch.nn.Conv2d`.


# %%
class Conv2d(eqx.Module):
    weight: jax.Array  # (out, in, 3, 3), as torch.nn.Conv2d's
    bias: jax.Array

    def __init__(self, n_in, n_out, rng):
        self.weight = jnp.asarray(rng.normal(size=(n_out, n_in, 3, 3)) / 3.0, jnp.float32)
        self.bias = jnp.asarray(0.1 * rng.normal(size=n_out), jnp.float32)

    def __call__(self, x):  # (batch, in, h, w), NCHW and OIHW as in PyTorch
        return jax.lax.conv_general_dilated(x, self.weight, (1, 1), "VALID") + self.bias[:, None, None]  # fmt: skip


class ReLU(eqx.Module):
    def __call__(self, x):
        return jax.nn.relu(x)


class CNN(eqx.Module):
    conv: Conv2d
    act: ReLU
    fc: Linear

    def __init__(self, rng):
        self.conv, self.act, self.fc = Conv2d(1, 3, rng), ReLU(), Linear(3 * 4 * 4, 5, rng)

    def __call__(self, images):
        return self.fc(self.act(self.conv(images)).reshape(len(images), -1))


class TorchCNN(torch.nn.Module):
    def __init__(self, cnn):
        super().__init__()
        self.conv, self.act, self.fc = torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Linear(48, 5)  # fmt: skip
        copy_weights(self, cnn, ["conv", "fc"])

    def forward(self, images):
        return self.fc(self.act(self.conv(images)).flatten(1))


cnn = jhooks.hookable(CNN(rng))
torch_cnn = TorchCNN(cnn)
images_np = rng.normal(size=(4, 1, 6, 6)).astype(np.float32)
classes = np.array([0, 1, 2, 3])  # the class whose map each image gets


def score(logits):  # the score of each image's class, summed over the batch
    return logits[np.arange(len(classes)), classes].sum()


close(cnn(images_np), torch_cnn(torch.from_numpy(images_np)).detach())

# %% [markdown]
# ### PyTorch: Grad-CAM

# %%
torch_maps = {}


def torch_keep_maps(module, args, output):
    torch_maps["A"] = output.detach()


def torch_grad_cam(module, grad_input, grad_output):
    w = grad_output[0].mean(dim=(2, 3))  # (batch, channels)
    torch_maps["cam"] = torch.relu((w[:, :, None, None] * torch_maps["A"]).sum(1)).numpy()


handles = [
    torch_cnn.act.register_forward_hook(torch_keep_maps),
    torch_cnn.act.register_full_backward_hook(torch_grad_cam),
]
score(torch_cnn(torch.from_numpy(images_np))).backward()
for handle in handles:
    handle.remove()

# %% [markdown]
# ### jhooks: Grad-CAM

# %%
maps = {}


def keep_maps(a, name):
    maps["A"] = a


def grad_cam(g, name):
    w = g.mean(axis=(2, 3))  # (batch, channels)
    maps["cam"] = np.asarray(jax.nn.relu((w[:, :, None, None] * maps["A"]).sum(1)))


eqx.filter_grad(
    lambda cnn, images: score(
        jhooks.run_with_hooks(
            cnn, images, fwd_hooks=[("act", keep_maps)], bwd_hooks=[("act", grad_cam)]
        )
    )
)(cnn, images_np)
print("Grad-CAM of the first image:\n", np.round(maps["cam"][0], 3))

assert maps["cam"].shape == (4, 4, 4) and maps["cam"].max() > 0
close(maps["cam"], torch_maps["cam"])

# %% [markdown]
# ## 5. Path patching in one forward
#
# Two forward hooks of one call talk to each other: the hook on `act1` stores the layer's
# output in a dict, and the hook on `act2`, later in the same forward, adds it to its own
# (a residual connection from layer 0 to layer 1 that the model does not have). The run is
# not differentiated, so the stored value is the concrete array of this call.
#
# ### PyTorch: path patching

# %%
torch_store = {}


def torch_save(module, args, output):
    torch_store["act1"] = output


def torch_add(module, args, output):
    return output + torch_store["act1"]


handles = [
    torch_net.act1.register_forward_hook(torch_save),
    torch_net.act2.register_forward_hook(torch_add),
]
with torch.no_grad():
    torch_patched = [torch_net(torch.from_numpy(x)).numpy() for x in (x_np, 2 * x_np)]
for handle in handles:
    handle.remove()

# %% [markdown]
# ### jhooks: path patching

# %%
store = {}


def save(z, name):
    store["act1"] = z


def add(z, name):
    return z + store["act1"]


patched = [
    jhooks.run_with_hooks(net, x, fwd_hooks=[("act1", save), ("act2", add)])
    for x in (x_np, 2 * x_np)
]

# By hand: act2's output plus act1's, into fc3.
for x, out, torch_out in zip((x_np, 2 * x_np), patched, torch_patched):
    h1 = np.tanh(x @ np.asarray(net.fc1.weight).T + np.asarray(net.fc1.bias))
    h2 = np.tanh(h1 @ np.asarray(net.fc2.weight).T + np.asarray(net.fc2.bias))
    close(out, (h2 + h1) @ np.asarray(net.fc3.weight).T + np.asarray(net.fc3.bias))
    close(out, torch_out)
close(store["act1"], np.tanh(2 * x_np @ np.asarray(net.fc1.weight).T + np.asarray(net.fc1.bias)))

# %% [markdown]
# ## Under your own `jax.jit`
#
# Inside a function you compile yourself (`jax.jit`, `eqx.filter_jit`), hooks are traced
# with it, once per compilation, as any Python there: a hook that prints or calls `float`
# runs once, on tracers, and jhooks warns once with the ways out (call the run outside your
# jit, or wrap the side effect in `jhooks.host`). A backward hook that
# reads what a forward hook kept works there too, written with `jax.numpy`: here it scales
# `fc3`'s gradient by its input's mean, kept by the forward hook, and PyTorch agrees.

# %%
jit_kept = {}


def keep_mean(a, name):
    jit_kept["mean"] = a.mean()


def scale_grad(g, name):
    return g * jit_kept["mean"]


@eqx.filter_jit
@eqx.filter_grad
def scaled_grads(net, x, y):
    out = jhooks.run_with_hooks(
        net, x, fwd_hooks=[("fc3:in", keep_mean)], bwd_hooks=[("fc3", scale_grad)]
    )
    return jnp.sum((out - y) ** 2)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jit_grads = scaled_grads(net, x_np, y_np)
    scaled_grads(net, 2 * x_np, y_np)  # compiled: the hooks are not called again
told = [str(w.message) for w in caught if "once per compilation" in str(w.message)]
print("jhooks warns:", told[0])
assert len(told) == 1

# %% [markdown]
# PyTorch: a full backward pre-hook replaces the gradient of the module's output.

# %%
torch_jit_kept = {}


def torch_keep_mean(module, args, output):
    torch_jit_kept["mean"] = args[0].detach().mean()


def torch_scale_grad(module, grad_output):
    return (grad_output[0] * torch_jit_kept["mean"],)


handles = [
    torch_net.fc3.register_forward_hook(torch_keep_mean),
    torch_net.fc3.register_full_backward_pre_hook(torch_scale_grad),
]
torch_net.zero_grad()
((torch_net(torch.from_numpy(x_np)) - torch.from_numpy(y_np)) ** 2).sum().backward()
for handle in handles:
    handle.remove()

for name in ("fc1", "fc2", "fc3"):
    close(getattr(jit_grads, name).weight, getattr(torch_net, name).weight.grad)
    close(getattr(jit_grads, name).bias, getattr(torch_net, name).bias.grad)

# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Module backward hooks: `register_full_backward_hook`
#
# | PyTorch | jhooks |
# |---|---|
# | `layer.register_full_backward_hook(hook)` | `layer.register_full_backward_hook(hook)` |
# | `layer.register_full_backward_pre_hook(hook)` | `layer.register_full_backward_pre_hook(hook)` |
# | `layer.register_backward_hook(hook)` (deprecated) | the same name: warns, acts as the full hook |
#
# `hook(module, grad_input, grad_output)` runs in the backward pass: `grad_output` holds the
# gradients of the module's outputs, `grad_input` those of its positional inputs (`None` for an
# input no gradient is computed for), and a returned tuple replaces `grad_input`. Each comparison
# below puts a PyTorch cell next to its jhooks twin, from the same weights, and ends with
# `np.testing.assert_allclose`.

# %%
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks
from small_cnn import SmallCNN  # conv -> act (ReLU) -> fc, shared by the examples
from small_cnn_torch import TorchSmallCNN  # its PyTorch twin, with the same weights

rng = np.random.default_rng(0)
images_np = rng.normal(size=(4, 1, 6, 6)).astype(np.float32)
targets_np = rng.normal(size=(4, 5)).astype(np.float32)


def loss_fn(net, images, targets):
    return jnp.mean((jax.vmap(net)(images) - targets) ** 2)


def torch_grads(torch_net):
    torch_net.zero_grad()
    out = torch_net(torch.from_numpy(images_np))
    torch.mean((out - torch.from_numpy(targets_np)) ** 2).backward()
    return {name: p.grad.numpy().copy() for name, p in torch_net.named_parameters()}


def assert_same_grads(grads, expected):
    for name, g in jhooks.named_parameters(grads):  # the same names as PyTorch's
        np.testing.assert_allclose(
            np.reshape(g, expected[name].shape), expected[name], rtol=1e-5, atol=1e-6
        )


# %% [markdown]
# ## Shapes of `grad_input` and `grad_output`
#
# A hook on each layer prints what it receives.
#
# ### PyTorch

# %%
net = jhooks.hookable(SmallCNN(jax.random.key(0), image_size=6, channels=3, classes=5))
torch_net = TorchSmallCNN(net)
torch_shapes, torch_grad_output = {}, {}


def torch_show(name):
    def hook(module, grad_input, grad_output):
        shapes = (
            [None if g is None else tuple(g.shape) for g in grad_input],
            [tuple(g.shape) for g in grad_output],
        )
        print(f"{name}: grad_input {shapes[0]}, grad_output {shapes[1]}")
        torch_shapes[name] = shapes
        torch_grad_output[name] = grad_output[0].numpy().copy()

    return hook


handles = [
    getattr(torch_net, name).register_full_backward_hook(torch_show(name))
    for name in ("conv", "fc")
]
expected = torch_grads(torch_net)
for h in handles:
    h.remove()

# %% [markdown]
# ### jhooks
#
# Shapes are known when JAX traces the backward pass, so a plain Python hook can print them: it
# runs once, when the jitted gradient is traced. Values need a `jhooks.host` hook, which runs each
# time the compiled gradient runs.

# %%
jax_shapes, jax_grad_output = {}, {"conv": [], "fc": []}


def show(name):
    def hook(module, grad_input, grad_output):
        shapes = (
            [None if g is None else g.shape for g in grad_input],
            [g.shape for g in grad_output],
        )
        print(f"{name}: grad_input {shapes[0]}, grad_output {shapes[1]}")
        jax_shapes[name] = shapes

    return hook


def keep(name):
    return jhooks.host(
        lambda module, grad_input, grad_output: jax_grad_output[name].append(grad_output[0])
    )


handles = [getattr(net, name).register_full_backward_hook(show(name)) for name in ("conv", "fc")]
handles += [getattr(net, name).register_full_backward_hook(keep(name)) for name in ("conv", "fc")]
grads = jax.jit(jax.grad(loss_fn))(net, images_np, targets_np)
jax.effects_barrier()
for h in handles:
    h.remove()

assert_same_grads(grads, expected)
for name in ("conv", "fc"):
    (torch_in, torch_out), (jax_in, jax_out) = torch_shapes[name], jax_shapes[name]
    assert jax_in == [None if s is None else s[1:] for s in torch_in]  # no batch dimension
    assert jax_out == [s[1:] for s in torch_out]
    assert len(jax_grad_output[name]) == 4  # one call per example
    np.testing.assert_allclose(
        np.stack(jax_grad_output[name]), torch_grad_output[name], rtol=1e-5, atol=1e-7
    )

# %% [markdown]
# Two things to read in these shapes:
#
# - **The batch dimension is missing in jhooks.** An Equinox model is written for one example and
#   batched with `jax.vmap`, so hooks, like the model, see one example: `(48,)` where PyTorch has
#   `(4, 48)`. A host hook is called once per example (4 times here), and stacking what it
#   receives gives PyTorch's array. The same holds for forward hooks. (Parameter hooks are the
#   exception: the parameters are shared by the examples, so a parameter hook sees the total
#   gradient, as in PyTorch.)
# - **`grad_input` of `conv` is `(None,)` in both.** The images are data, not differentiated, so
#   no gradient is computed for the first layer's input, and PyTorch and jhooks both pass `None`
#   (PyTorch also warns, above, that the hook fires from the module's outputs then).
#
# ## A hook that adds noise to a gradient
#
# A full backward hook on `fc` adds a fixed noise array to the gradient of its input; that gradient
# flows on to `conv`, whose parameter gradients change, while `fc`'s own do not. Both frameworks get
# the same noise; it has the shape of one example's `grad_input`, so PyTorch broadcasts it over the
# batch and jhooks adds it to every example.
#
# ### PyTorch: adding noise

# %%
noise = (0.01 * rng.normal(size=48)).astype(np.float32)

h = torch_net.fc.register_full_backward_hook(lambda m, gi, go: (gi[0] + torch.from_numpy(noise),))
torch_noisy = torch_grads(torch_net)
h.remove()
print({name: float(np.abs(torch_noisy[name] - expected[name]).max()) for name in expected})

# %% [markdown]
# ### jhooks: adding noise

# %%
h = net.fc.register_full_backward_hook(lambda m, gi, go: (gi[0] + noise,))
noisy = jax.jit(jax.grad(loss_fn))(net, images_np, targets_np)
h.remove()

assert_same_grads(noisy, torch_noisy)
# The noise reached conv, and only conv.
assert np.abs(noisy.conv.weight - grads.conv.weight).max() > 1e-4
np.testing.assert_allclose(noisy.fc.weight, grads.fc.weight)

# %% [markdown]
# ## The deprecated `register_backward_hook`
#
# PyTorch's older `register_backward_hook` does not hook the module: it hooks the *last autograd
# node* of the module's forward, and passes that node's gradients as `grad_input`. For
# `nn.Linear` on a 2-D batch the last node is the fused `addmm(bias, x, weight.T)`, so
# `grad_input` holds three gradients, with respect to the bias, to the input and to the
# *transposed* weight, where the full hook gives just the input's.

# %%
rng = np.random.default_rng(1)
x_np = rng.normal(size=(5, 4)).astype(np.float32)
lin = jhooks.hookable(eqx.nn.Linear(4, 3, key=jax.random.key(2)))


def torch_linear_hook(register):
    torch_lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        torch_lin.weight.copy_(torch.tensor(np.asarray(lin.weight)))
        torch_lin.bias.copy_(torch.tensor(np.asarray(lin.bias)))
    x = torch.tensor(x_np, requires_grad=True)
    seen = []
    getattr(torch_lin, register)(lambda m, gi, go: seen.append((gi, go)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (torch_lin(x) ** 2).sum().backward()
    grad_input, grad_output = seen[0]
    print(f"{register}: grad_input shapes {[tuple(g.shape) for g in grad_input]}")
    for w in caught:
        print("   PyTorch warns:", str(w.message)[:120], "...")
    return torch_lin, x, grad_input


torch_lin, x, old_grad_input = torch_linear_hook("register_backward_hook")
_, _, full_grad_input = torch_linear_hook("register_full_backward_hook")

# The deprecated hook's three gradients: the bias's, the input's, and the weight's, transposed.
np.testing.assert_allclose(old_grad_input[0], torch_lin.bias.grad)
np.testing.assert_allclose(old_grad_input[1], x.grad)
np.testing.assert_allclose(old_grad_input[2], torch_lin.weight.grad.T)
# The full hook: the gradient with respect to the module's input only.
np.testing.assert_allclose(full_grad_input[0], x.grad)

# %% [markdown]
# What the deprecated hook receives depends on how the forward happens to be implemented.
# With a 3-D input, `nn.Linear` runs a reshape and a matrix product, the last node is a reshape,
# and `grad_input` becomes a single gradient of a shape that belongs to neither the input nor the
# output. (PyTorch warns in both cases that this hook "will be missing some grad_input".)

# %%
torch_lin_3d = torch.nn.Linear(4, 3)
seen_3d = []
torch_lin_3d.register_backward_hook(lambda m, gi, go: seen_3d.append([tuple(g.shape) for g in gi]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch_lin_3d(torch.randn(2, 5, 4, requires_grad=True)).sum().backward()
print("grad_input shapes for a (2, 5, 4) input:", seen_3d[0])
assert seen_3d[0] == [(10, 3)]

# %% [markdown]
# ### jhooks: `register_backward_hook`
#
# jhooks has no autograd nodes inside a module to pick from, and the deprecated behaviour is not
# worth copying: `register_backward_hook` warns (a `FutureWarning`, PyTorch's deprecation
# category) and registers the hook as a full backward hook. Code ported from PyTorch keeps
# running, and gets the documented `grad_input`: one gradient per positional input, per example
# under `jax.vmap`.

# %%
jax_grad_input = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    h = lin.register_backward_hook(jhooks.host(lambda m, gi, go: jax_grad_input.append(gi)))
print("jhooks warns:", caught[0].category.__name__, str(caught[0].message))
assert issubclass(caught[0].category, FutureWarning)


def square_loss(x):
    return jnp.sum(jax.vmap(lin)(x) ** 2)


grad_x = jax.jit(jax.grad(square_loss))(x_np)
jax.effects_barrier()
h.remove()
print(
    "grad_input per example:", [g.shape for g in jax_grad_input[0]], "calls:", len(jax_grad_input)
)

assert all(len(gi) == 1 for gi in jax_grad_input)  # the input's gradient only, as the full hook
# float32 in two libraries: XLA's CPU code rounds 1.2e-6 apart from PyTorch's here on
# some machines (with the test suite's XLA settings)
np.testing.assert_allclose(
    np.stack([gi[0] for gi in jax_grad_input]), full_grad_input[0], rtol=1e-5
)
np.testing.assert_allclose(grad_x, x.grad, rtol=1e-5)

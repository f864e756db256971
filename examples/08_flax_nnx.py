# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Flax NNX and PyTorch: the same hooks on the same models
#
# | PyTorch | Flax NNX with jhooks |
# |---|---|
# | `net` (an `nn.Module`) | `net = jhooks.hookable(nnx_model)`: the same object, made hookable in place |
# | `net.fc1.register_forward_hook(hook)` | `jhooks.register_forward_hook(net.fc1, hook)` or `net.fc1.register_forward_hook(hook)` |
# | `register_forward_pre_hook`, `register_full_backward_pre_hook`, `register_full_backward_hook` | the same names, the same signatures |
# | `net.fc1.bias.register_hook(fn)` | `jhooks.register_parameter_hook(net, "fc1.bias", fn)` (a weight is `"fc1.kernel"`) |
# | `torch.compile(step)` | `nnx.jit(step)`: the hooks are compiled into the step |
#
# Flax NNX modules are mutable Python objects that take batches, as PyTorch modules are, so the
# hook code below is the same in both, line for line. Each section runs it on a PyTorch model
# and on the NNX model with the same weights, and ends with `np.testing.assert_allclose`
# (outputs and gradients to 1e-5). NNX's layouts are its own: a `Linear` kernel is `(in, out)`
# (PyTorch's weight is `(out, in)`), a `Conv` kernel `(kh, kw, in, out)`, and images are
# `(N, H, W, C)`.

# %%
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import jhooks


def close(ours, theirs):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else theirs
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-5)


class ReLU(nnx.Module):
    """`jax.nn.relu` as a module (PyTorch: `torch.nn.ReLU`), so that it can hold hooks."""

    def __call__(self, x):
        return jax.nn.relu(x)


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(4, 8, rngs=rngs)
        self.act = ReLU()
        self.fc2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TorchMLP(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        with torch.no_grad():  # the same weights: PyTorch's weight is NNX's kernel transposed
            for name in ("fc1", "fc2"):
                mine, theirs = getattr(self, name), getattr(mlp, name)
                mine.weight.copy_(torch.tensor(np.asarray(theirs.kernel[...]).T))
                mine.bias.copy_(torch.tensor(np.asarray(theirs.bias[...])))

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


rng = np.random.default_rng(0)
x_np = rng.normal(size=(6, 4)).astype(np.float32)
t_np = rng.normal(size=(6, 3)).astype(np.float32)
x, t = torch.tensor(x_np), torch.tensor(t_np)

net = jhooks.hookable(MLP(nnx.Rngs(0)))  # in place: `net` is the model NNX made
torch_net = TorchMLP(net)
close(net(x_np), torch_net(x))
print([name for name, _ in jhooks.named_modules(net)])

# %% [markdown]
# ## Forward hooks
#
# A forward pre-hook doubles `fc1`'s input, a forward hook clips the activation. The same two
# functions are registered on both models.


# %%
def double_input(module, args):
    return (args[0] * 2.0,)


def clip_output(module, args, output):
    return output.clamp(max=1.0) if isinstance(output, torch.Tensor) else jnp.minimum(output, 1.0)


# %% [markdown]
# ### PyTorch

# %%
torch_handles = [
    torch_net.fc1.register_forward_pre_hook(double_input),
    torch_net.act.register_forward_hook(clip_output),
]
torch_out = torch_net(x)

# %% [markdown]
# ### Flax NNX

# %%
handles = [
    net.fc1.register_forward_pre_hook(double_input),
    net.act.register_forward_hook(clip_output),
]
out = nnx.jit(lambda model, x: model(x))(net, x_np)
close(out, torch_out)
close(net(x_np), torch_out)  # eagerly too

# %% [markdown]
# ## Backward hooks and parameter hooks
#
# `full_backward_pre` scales the gradient of `fc2`'s output, `full_backward` replaces the
# gradient of `act`'s input and records what it saw, and a parameter hook freezes `fc1.bias`.
# The NNX gradients come from `nnx.value_and_grad` inside `nnx.jit`; `jhooks.host` hands the
# hook concrete NumPy values each time the compiled step runs.


# %%
def scale_grad_output(module, grad_output):
    return (grad_output[0] * 3.0,)


def halve_grad_input(module, grad_input, grad_output):
    return (grad_input[0] * 0.5,)


# %% [markdown]
# ### PyTorch: backward and parameter hooks

# %%
torch_seen = []
torch_handles += [
    torch_net.fc2.register_full_backward_pre_hook(scale_grad_output),
    torch_net.act.register_full_backward_hook(halve_grad_input),
    torch_net.act.register_full_backward_hook(lambda m, gi, go: torch_seen.append(gi[0].clone())),
    torch_net.fc1.bias.register_hook(torch.zeros_like),
]
torch_loss = ((torch_net(x) - t) ** 2).mean()
torch_loss.backward()

# %% [markdown]
# ### Flax NNX: backward and parameter hooks

# %%
seen = []
handles += [
    net.fc2.register_full_backward_pre_hook(scale_grad_output),
    net.act.register_full_backward_hook(halve_grad_input),
    net.act.register_full_backward_hook(jhooks.host(lambda m, gi, go: seen.append(gi[0]))),
    jhooks.register_parameter_hook(net, "fc1.bias", jnp.zeros_like),
]


def mse(model, x, t):
    return jnp.mean((model(x) - t) ** 2)


loss, grads = nnx.jit(nnx.value_and_grad(mse))(net, x_np, t_np)
jax.effects_barrier()  # wait for the host hook
close(loss, torch_loss)
close(seen[0], torch_seen[0])
for name in ("fc1", "fc2"):
    theirs = getattr(torch_net, name)
    close(grads[name]["kernel"][...].T, theirs.weight.grad)
    close(grads[name]["bias"][...], theirs.bias.grad)
print("fc1.bias gradient:", grads["fc1"]["bias"][...])

# %% [markdown]
# ## Removing hooks, and the compiled step
#
# Handles remove hooks as in PyTorch. A jitted step runs exactly the hooks registered when it is
# called: registering or removing one retraces it once, and the cached program comes back when
# the hooks are what they were.

# %%
for h in handles + torch_handles:
    h.remove()
traces = []


@nnx.jit
def step(model, x):
    traces.append(None)
    return model(x)


plain = step(net, x_np)
with net.act.register_forward_hook(lambda m, args, out: out * 0.0):
    hooked = step(net, x_np)
again = step(net, x_np)
print("traces:", len(traces))
close(plain, torch_net(x))
close(again, plain)
assert len(traces) == 2 and not np.allclose(hooked, plain)

# %% [markdown]
# ## A small CNN
#
# A convolution, a ReLU module and a linear layer. PyTorch's images are `(N, C, H, W)`, NNX's
# `(N, H, W, C)`: the NNX model flattens its features in PyTorch's order, so that the linear
# layers hold the same weights. The same hooks: a backward hook on the ReLU (a "guided" ReLU,
# which lets only positive gradients through) and a forward hook scaling the convolution's
# output.


# %%
class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), padding="VALID", rngs=rngs)
        self.act = ReLU()
        self.fc = nnx.Linear(4 * 6 * 6, 5, rngs=rngs)

    def __call__(self, images):  # (N, 8, 8, 1)
        h = self.act(self.conv(images))
        return self.fc(h.transpose(0, 3, 1, 2).reshape(len(images), -1))


class TorchCNN(torch.nn.Module):
    def __init__(self, cnn):
        super().__init__()
        self.conv, self.act = torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU()
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)
        with torch.no_grad():  # (kh, kw, in, out) -> (out, in, kh, kw)
            self.conv.weight.copy_(
                torch.tensor(np.asarray(cnn.conv.kernel[...]).transpose(3, 2, 0, 1))
            )
            self.conv.bias.copy_(torch.tensor(np.asarray(cnn.conv.bias[...])))
            self.fc.weight.copy_(torch.tensor(np.asarray(cnn.fc.kernel[...]).T))
            self.fc.bias.copy_(torch.tensor(np.asarray(cnn.fc.bias[...])))

    def forward(self, images):  # (N, 1, 8, 8)
        return self.fc(self.act(self.conv(images)).flatten(1))


def guided(module, grad_input, grad_output):
    g = grad_input[0]
    return (g.clamp(min=0.0) if isinstance(g, torch.Tensor) else jnp.maximum(g, 0.0),)


def scale(module, args, output):
    return output * 0.5


images = rng.normal(size=(3, 1, 8, 8)).astype(np.float32)
labels = np.array([0, 3, 1])
cnn = jhooks.hookable(CNN(nnx.Rngs(1)))
torch_cnn = TorchCNN(cnn)
for model in (cnn, torch_cnn):
    model.act.register_full_backward_hook(guided)
    model.conv.register_forward_hook(scale)

torch_images = torch.tensor(images).requires_grad_(True)
torch_loss = torch.nn.functional.cross_entropy(torch_cnn(torch_images), torch.tensor(labels))
torch_loss.backward()


def cross_entropy(model, images):
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


nhwc = images.transpose(0, 2, 3, 1)
loss, (grads, image_grads) = nnx.jit(nnx.value_and_grad(cross_entropy, argnums=(0, 1)))(cnn, nhwc)
close(loss, torch_loss)
close(image_grads.transpose(0, 3, 1, 2), torch_images.grad)
close(grads["conv"]["kernel"][...].transpose(3, 2, 0, 1), torch_cnn.conv.weight.grad)
close(grads["fc"]["kernel"][...].T, torch_cnn.fc.weight.grad)
close(grads["conv"]["bias"][...], torch_cnn.conv.bias.grad)

# %% [markdown]
# ## Training with hooks
#
# `nnx.Optimizer` and `nnx.jit` as usual; the hooks are part of the compiled step. Here the
# guided ReLU and the scaled convolution stay on, and a parameter hook clips the gradient of the
# convolution kernel, every step.


# %%
def clip_norm(g):
    return g / jnp.maximum(1.0, jnp.linalg.norm(g))


jhooks.register_parameter_hook(cnn, "conv.kernel", clip_norm)
optimizer = nnx.Optimizer(cnn, optax.sgd(0.1), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, images):
    loss, grads = nnx.value_and_grad(cross_entropy)(model, images)
    optimizer.update(model, grads)
    return loss


losses = [float(train_step(cnn, optimizer, nhwc)) for _ in range(20)]
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
assert losses[-1] < losses[0]

# %% [markdown]
# ## Activations by name
#
# Every hookable module's output is a named point, named by its NNX path, so
# `jhooks.run_with_cache` returns them (and their gradients, with `incl_bwd=True`), as forward
# hooks saving outputs to a list would in PyTorch.

# %%
saved = {}
for name in ("fc1", "act", "fc2"):
    torch_net.get_submodule(name).register_forward_hook(
        lambda m, args, out, name=name: saved.__setitem__(name, out)
    )
torch_net(x)
out, cache = jhooks.run_with_cache(net, x_np)
print({name: value.shape for name, value in cache.items()})
for name in ("fc1", "act", "fc2"):
    close(cache[name], saved[name])

# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Module forward hooks: `register_forward_pre_hook` and `register_forward_hook`
#
# | PyTorch | jhooks |
# |---|---|
# | `layer.register_forward_pre_hook(hook)` | `layer.register_forward_pre_hook(hook)` |
# | `layer.register_forward_hook(hook)` | `layer.register_forward_hook(hook)` |
# | `with_kwargs=True` | `with_kwargs=True` |
# | a hook saving outputs to a list | `jhooks.run_with_cache(model, x)`, or a `jhooks.host` hook |
#
# Call `jhooks.hookable(model)` once (or subclass `jhooks.Module`) and every Equinox module in the
# model, stock `eqx.nn` layers included, gets PyTorch's `register_*` methods. Hook signatures and
# return rules are PyTorch's. Each comparison below puts a PyTorch cell next to its jhooks twin,
# copies the weights so both start equal, and ends with `np.testing.assert_allclose`.

# %%
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

rng = np.random.default_rng(0)
x_np = rng.normal(size=(5, 4)).astype(np.float32)  # a batch of 5 examples, 4 features

lin = jhooks.hookable(eqx.nn.Linear(4, 3, key=jax.random.key(0)))
torch_lin = torch.nn.Linear(4, 3)
with torch.no_grad():  # the same weights in both
    torch_lin.weight.copy_(torch.tensor(np.asarray(lin.weight)))
    torch_lin.bias.copy_(torch.tensor(np.asarray(lin.bias)))

x = torch.from_numpy(x_np)
np.testing.assert_allclose(jax.vmap(lin)(x_np), torch_lin(x).detach(), rtol=1e-6)

# %% [markdown]
# ## Reading inputs and outputs
#
# An Equinox layer is written for one example and batched with `jax.vmap`, so a hook sees one
# example at a time: PyTorch's shapes without the batch dimension. Hooks run while JAX traces the
# call, on tracers; to look at concrete values, wrap the hook in `jhooks.host`, which calls it with
# NumPy arrays each time the (jitted) computation runs: once per example under `jax.vmap`.
#
# ### PyTorch

# %%
torch_inputs, torch_outputs = [], []
h_pre = torch_lin.register_forward_pre_hook(lambda m, args: torch_inputs.append(args[0].clone()))
h_out = torch_lin.register_forward_hook(lambda m, args, out: torch_outputs.append(out.detach()))
torch_lin(x)
h_pre.remove()
h_out.remove()
print("PyTorch: input", tuple(torch_inputs[0].shape), "output", tuple(torch_outputs[0].shape))

# %% [markdown]
# ### jhooks

# %%
jax_inputs, jax_outputs = [], []
handles = [
    lin.register_forward_pre_hook(jhooks.host(lambda m, args: jax_inputs.append(args[0]))),
    lin.register_forward_hook(jhooks.host(lambda m, args, out: jax_outputs.append(out))),
]
jax.jit(jax.vmap(lin))(x_np)
jax.effects_barrier()  # wait for the host hooks
for h in handles:
    h.remove()
print(
    "jhooks: calls", len(jax_inputs), "input", jax_inputs[0].shape, "output", jax_outputs[0].shape
)

assert len(jax_inputs) == len(jax_outputs) == 5  # once per example
np.testing.assert_allclose(np.stack(jax_inputs), torch_inputs[0])
np.testing.assert_allclose(np.stack(jax_outputs), torch_outputs[0], rtol=1e-6)

# %% [markdown]
# ## Replacing inputs and outputs
#
# A pre-hook that returns something replaces the positional arguments (a non-tuple is wrapped as
# `(value,)`), a forward hook that returns something replaces the output. These hooks compute with
# `jax.numpy`, so they are traced into the jitted program: no host hook is needed.
#
# ### PyTorch: replacing

# %%
handles = [
    torch_lin.register_forward_pre_hook(lambda m, args: args[0] * 2),  # double the input
    torch_lin.register_forward_hook(lambda m, args, out: torch.tanh(out)),  # squash the output
]
torch_replaced = torch_lin(x).detach()
for h in handles:
    h.remove()
print(torch_replaced)

# %% [markdown]
# ### jhooks: replacing

# %%
handles = [
    lin.register_forward_pre_hook(lambda m, args: args[0] * 2),  # double the input
    lin.register_forward_hook(lambda m, args, out: jnp.tanh(out)),  # squash the output
]
replaced = jax.jit(jax.vmap(lin))(x_np)
for h in handles:
    h.remove()
plain = jax.jit(jax.vmap(lin))(x_np)  # the hooks are gone: the plain layer again
print(replaced)

np.testing.assert_allclose(replaced, torch_replaced, rtol=1e-6)
np.testing.assert_allclose(replaced, jnp.tanh(jax.vmap(lin)(2 * x_np)), rtol=1e-6)
np.testing.assert_allclose(plain, torch_lin(x).detach(), rtol=1e-6)


# %% [markdown]
# ## Keyword arguments: `with_kwargs=True`
#
# With `with_kwargs=True` a pre-hook is called as `hook(module, args, kwargs)` and may return a new
# pair `(args, kwargs)`; a forward hook is called as `hook(module, args, kwargs, output)`. Here a
# layer takes a keyword argument `scale`; the pre-hook overrides it, and the forward hook reads the
# value the call actually used.
#
# ### PyTorch: keyword arguments


# %%
class TorchScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


torch_scaled = TorchScaled()
torch_scaled.lin.load_state_dict(torch_lin.state_dict())
torch_seen_scale = []


def torch_set_scale(module, args, kwargs):
    return args, {**kwargs, "scale": 3.0}


def torch_read_scale(module, args, kwargs, out):
    torch_seen_scale.append(kwargs["scale"])
    return out - kwargs["scale"]


torch_scaled.register_forward_pre_hook(torch_set_scale, with_kwargs=True)
torch_scaled.register_forward_hook(torch_read_scale, with_kwargs=True)
torch_kw = torch_scaled(x, scale=2.0).detach()
print(torch_seen_scale, torch_kw)


# %% [markdown]
# ### jhooks: keyword arguments


# %%
class Scaled(jhooks.Module):  # hookable from construction
    lin: eqx.nn.Linear

    def __call__(self, x, *, scale=1.0):
        return self.lin(x) * scale


scaled = Scaled(lin)
jax_seen_scale = []


def set_scale(module, args, kwargs):
    return args, {**kwargs, "scale": 3.0}


def read_scale(module, args, kwargs, out):
    jax_seen_scale.append(kwargs["scale"])  # a Python float: fine to keep at trace time
    return out - kwargs["scale"]


scaled.register_forward_pre_hook(set_scale, with_kwargs=True)
scaled.register_forward_hook(read_scale, with_kwargs=True)
jax_kw = jax.jit(jax.vmap(lambda x: scaled(x, scale=2.0)))(x_np)
print(jax_seen_scale, jax_kw)

assert jax_seen_scale == torch_seen_scale == [3.0]  # jhooks: one call, at trace time
np.testing.assert_allclose(jax_kw, torch_kw, rtol=1e-6)


# %% [markdown]
# ## Extracting intermediate feature maps
#
# The usual PyTorch recipe: a forward hook on each layer of interest saves its output in a dict or
# list, then the model runs. A small CNN with two convolutions:


# %%
class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1)
        self.conv2 = eqx.nn.Conv2d(4, 8, kernel_size=3, key=k2)
        self.fc = eqx.nn.Linear(8 * 4 * 4, 10, key=k3)

    def __call__(self, x):  # one image, (1, 8, 8)
        h = jax.nn.relu(self.conv1(x))
        h = jax.nn.relu(self.conv2(h))
        return self.fc(h.reshape(-1))


class TorchCNN(torch.nn.Module):
    def __init__(self, cnn):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3)
        self.conv2 = torch.nn.Conv2d(4, 8, 3)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)
        with torch.no_grad():  # copy the weights; an Equinox Conv2d bias is (out, 1, 1)
            for name in ("conv1", "conv2", "fc"):
                mine, theirs = getattr(self, name), getattr(cnn, name)
                mine.weight.copy_(torch.tensor(np.asarray(theirs.weight)))
                mine.bias.copy_(torch.tensor(np.asarray(theirs.bias).reshape(-1)))

    def forward(self, x):  # a batch, (B, 1, 8, 8)
        h = torch.relu(self.conv1(x))
        h = torch.relu(self.conv2(h))
        return self.fc(h.flatten(1))


cnn = jhooks.hookable(CNN(jax.random.key(1)))
torch_cnn = TorchCNN(cnn)
images_np = rng.normal(size=(6, 1, 8, 8)).astype(np.float32)
images = torch.from_numpy(images_np)

# %% [markdown]
# ### PyTorch: save to a dict

# %%
torch_features = {}


def save(name):
    def hook(module, args, output):
        torch_features[name] = output.detach()

    return hook


handles = [
    getattr(torch_cnn, name).register_forward_hook(save(name)) for name in ("conv1", "conv2")
]
torch_logits = torch_cnn(images).detach()
for h in handles:
    h.remove()
print({name: tuple(f.shape) for name, f in torch_features.items()})

# %% [markdown]
# ### jhooks, the wrong way: a Python variable inside `jax.jit`
#
# The same hook in JAX runs while `jax.jit` traces the function, so what it saves is a *tracer*, a
# placeholder of the trace, not an array. Once the trace is over the tracer is useless: using it
# raises `UnexpectedTracerError`, converting it to NumPy raises `TracerArrayConversionError`. (On a
# second call the jitted function does not even trace, and the dict is not touched at all.)

# %%
leaked = {}
handle = cnn.conv1.register_forward_hook(lambda m, args, out: leaked.update(conv1=out))
jax.jit(jax.vmap(cnn))(images_np)
handle.remove()
print(type(leaked["conv1"]).__name__)

try:
    leaked["conv1"] + 1.0
    raise AssertionError("expected an error")
except jax.errors.UnexpectedTracerError as error:
    print("UnexpectedTracerError:", str(error).splitlines()[0][:100], "...")


# %% [markdown]
# ### jhooks, the right way: `jhooks.run_with_cache`
#
# In JAX a value leaves a jitted function by being *returned*. `jhooks.run_with_cache(fn, *args)`
# calls `fn` and returns `(out, cache)`, where `cache` maps names to the activations at named points;
# the output of every hookable module is such a point, named by its path (`"conv1"`, `"conv2"`).
# `names_filter` picks which ones to keep, so under `jax.jit` only those stay in memory.
#
# Here the run is inside the `vmap` over the batch, so the cache gets the batch dimension back,
# exactly PyTorch's shapes. A run outside it gives the same: points reached under a `jax.vmap`,
# `lax.scan`, `lax.cond` or nested `jax.jit` within `fn` come back stacked along the batch (or loop)
# axis.


# %%
@jax.jit
def features(images):
    return jax.vmap(lambda x: jhooks.run_with_cache(cnn, x, names_filter=["conv1", "conv2"]))(
        images
    )


logits, cache = features(images_np)
print({name: f.shape for name, f in cache.items()})

np.testing.assert_allclose(logits, torch_logits, rtol=1e-5, atol=1e-6)
for name in ("conv1", "conv2"):
    np.testing.assert_allclose(cache[name], torch_features[name], rtol=1e-5, atol=1e-6)

# %% [markdown]
# Named points are not limited to module outputs: `jhooks.hook_point(x, "name")` marks any
# intermediate value in your own code (it is the identity outside a run), and
# `jhooks.run_with_hooks(fn, x, fwd_hooks=[(name, hook)])` edits them. See the API reference.
#
# ### jhooks, the PyTorch way: a host hook that saves to a list
#
# When the feature maps are for logging rather than for further computation, a `jhooks.host` hook
# does what the PyTorch hook does: it receives NumPy arrays on the host each time the compiled
# function runs (one example at a time under `jax.vmap`), and may append them to any Python
# list.

# %%
host_features = {"conv1": [], "conv2": []}
handles = [
    getattr(cnn, name).register_forward_hook(
        jhooks.host(lambda m, args, out, name=name: host_features[name].append(out))
    )
    for name in ("conv1", "conv2")
]
jax.jit(jax.vmap(cnn))(images_np)
jax.effects_barrier()
for h in handles:
    h.remove()

for name in ("conv1", "conv2"):
    assert len(host_features[name]) == 6  # one call per image
    np.testing.assert_allclose(
        np.stack(host_features[name]), torch_features[name], rtol=1e-5, atol=1e-6
    )

"""Flax NNX twins of the test models, and PyTorch's names and layouts for either framework.

The parity tests of `test_modules.py` run on an Equinox model and on its NNX twin (the
same attribute names, so the same paths), each against PyTorch with copied weights.
The NNX twins are called per example, as Equinox modules are (`jax.vmap(model)`), so
the same hooks see the same shapes in both; NNX's layouts differ from PyTorch's only
in the kernels (`torch_named`). `assert_close` and `batch` are the NNX tests' shared
set-up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import jhooks


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    if isinstance(b, torch.Tensor):
        b = b.detach().numpy()
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def batch(shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


class Act(nnx.Module):
    """An activation as a module, as `torch.nn.ReLU` is (the function is static)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)


class MLP(nnx.Module):
    def __init__(self, seed=0, sizes=(3, 5, 2)):
        rngs = nnx.Rngs(seed)
        self.fc1 = nnx.Linear(sizes[0], sizes[1], rngs=rngs)
        self.act = Act(jnp.tanh)
        self.fc2 = nnx.Linear(sizes[1], sizes[2], rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CNN(nnx.Module):
    """PyTorch's `(C, H, W)` example in and out of NNX's `(H, W, C)` convolution."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.conv = nnx.Conv(1, 4, (3, 3), padding="VALID", rngs=rngs)
        self.act = Act(jax.nn.relu)
        self.fc = nnx.Linear(4 * 6 * 6, 10, rngs=rngs)

    def __call__(self, x):
        h = self.act(self.conv(x.transpose(1, 2, 0)))
        return self.fc(h.transpose(2, 0, 1).reshape(-1))


def is_nnx(model):
    return isinstance(model, nnx.Module)


def param_name(model, torch_name):
    """The name of PyTorch's parameter `torch_name` in `model` (NNX calls weights kernels)."""
    if is_nnx(model) and torch_name.endswith(".weight"):
        return torch_name[: -len("weight")] + "kernel"
    return torch_name


def torch_layout(name, array, batch_dims=0):
    """`(torch_name, array)` of an NNX or Equinox parameter, in PyTorch's layout."""
    array = np.asarray(array)
    if name.endswith(".scale"):  # LayerNorm, BatchNorm
        return name[: -len("scale")] + "weight", array
    if not name.endswith(".kernel"):
        return name, array
    name = name[: -len("kernel")] + "weight"
    if array.ndim - batch_dims == 2:  # Linear: (in, out) -> (out, in)
        return name, np.swapaxes(array, -1, -2)
    # Conv: (kh, kw, in, out) -> (out, in, kh, kw)
    return name, np.moveaxis(array, [-1, -2, -4, -3], [-4, -3, -2, -1])


def torch_named(tree, batch_dims=0):
    """Every parameter (or gradient) of a model as `{torch name: array in torch layout}`."""
    return dict(torch_layout(n, a, batch_dims) for n, a in jhooks.named_parameters(tree))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(6, 6, rngs=rngs)
        self.norm = nnx.LayerNorm(6, epsilon=1e-5, rngs=rngs)  # PyTorch's epsilon

    def __call__(self, x):
        return x + jax.nn.relu(self.fc(self.norm(x)))


class Net(nnx.Module):
    """`nnx.List` holds the blocks, as `torch.nn.ModuleList` does (a module without call)."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.proj = nnx.Linear(4, 6, rngs=rngs)
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

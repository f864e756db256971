"""The benchmark models, built twice: in Equinox and in PyTorch, with the same math.

Every root module takes a whole batch (as a PyTorch module does) and maps its stock
Equinox layers over it with `jax.vmap`, so hooks on the root see the batch and hooks
on the layers see single examples. The activation functions are plain functions in
both frameworks, so both have the same modules: the root and its layers.

`tap` is the value-hook flavour: a function applied to the output of every layer
(`jhooks.register_hook` in JAX, `Tensor.register_hook` in PyTorch), `None` for none.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

Tap = Callable[[Any], Any] | None


def _tap(tap: Tap, h: Any) -> Any:
    return h if tap is None else tap(h)


# --------------------------------------------------------------------------- Equinox


class MLP(eqx.Module):
    layers: list[eqx.nn.Linear]

    def __init__(self, width: int, depth: int, *, key: jax.Array):
        keys = jax.random.split(key, depth)
        self.layers = [eqx.nn.Linear(width, width, key=k) for k in keys]

    def __call__(self, x: jax.Array, tap: Tap = None) -> jax.Array:
        h = x
        for i, layer in enumerate(self.layers):
            if i:
                h = jax.nn.relu(h)
            h = _tap(tap, jax.vmap(layer)(h))
        return h


class CNN(eqx.Module):
    """The Conv2d-ReLU-Linear network of `examples/demo.py`."""

    conv: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1)
        self.fc = eqx.nn.Linear(4 * 6 * 6, 10, key=k2)

    def __call__(self, x: jax.Array, tap: Tap = None) -> jax.Array:
        h = _tap(tap, jax.vmap(self.conv)(x))
        h = jax.nn.relu(h).reshape(x.shape[0], -1)
        return _tap(tap, jax.vmap(self.fc)(h))


def _per_token(layer: Callable, h: jax.Array) -> jax.Array:
    return jax.vmap(jax.vmap(layer))(h)


class Block(eqx.Module):
    """A pre-norm transformer block: self-attention and a GELU MLP, both residual."""

    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, *, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.ln1 = eqx.nn.LayerNorm(dim)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, key=k1)
        self.proj = eqx.nn.Linear(dim, dim, key=k2)
        self.ln2 = eqx.nn.LayerNorm(dim)
        self.fc1 = eqx.nn.Linear(dim, 4 * dim, key=k3)
        self.fc2 = eqx.nn.Linear(4 * dim, dim, key=k4)
        self.heads = heads

    def __call__(self, x: jax.Array, tap: Tap = None) -> jax.Array:
        b, t, d = x.shape
        hd = d // self.heads
        h = _tap(tap, _per_token(self.ln1, x))
        qkv = _tap(tap, _per_token(self.qkv, h))
        q, k, v = jnp.split(qkv.reshape(b, t, 3, self.heads, hd), 3, axis=2)
        q, k, v = (a.squeeze(2).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), axis=-1)
        a = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + _tap(tap, _per_token(self.proj, a))
        h = _tap(tap, _per_token(self.ln2, x))
        h = jax.nn.gelu(_tap(tap, _per_token(self.fc1, h)))
        return x + _tap(tap, _per_token(self.fc2, h))


# --------------------------------------------------------------------------- PyTorch


class TorchMLP(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, tap: Tap = None) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            if i:
                h = F.relu(h)
            h = _tap(tap, layer(h))
        return h


class TorchCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor, tap: Tap = None) -> torch.Tensor:
        h = _tap(tap, self.conv(x))
        h = F.relu(h).flatten(1)
        return _tap(tap, self.fc(h))


class TorchBlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor, tap: Tap = None) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        h = _tap(tap, self.ln1(x))
        qkv = _tap(tap, self.qkv(h))
        q, k, v = qkv.reshape(b, t, 3, self.heads, hd).unbind(2)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)
        a = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + _tap(tap, self.proj(a))
        h = _tap(tap, self.ln2(x))
        h = F.gelu(_tap(tap, self.fc1(h)), approximate="tanh")
        return x + _tap(tap, self.fc2(h))


# --------------------------------------------------------------------------- cases


def _ce_jax(logits: jax.Array, y: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


def _mse_jax(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out - y) ** 2)


def _mse_torch(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.mean((out - y) ** 2)


@dataclass
class Case:
    """One model: how to build it in both frameworks, its batch and its loss."""

    name: str
    eqx_model: Callable[[], eqx.Module]
    torch_model: Callable[[], torch.nn.Module]
    batch: Callable[[], tuple[np.ndarray, np.ndarray]]
    jax_loss: Callable[[jax.Array, jax.Array], jax.Array]
    torch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    description: str


def _classification(shape: tuple[int, ...], classes: int) -> Callable:
    def batch() -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(shape).astype(np.float32)
        y = rng.integers(0, classes, shape[0]).astype(np.int32)
        return x, y

    return batch


def _regression(shape: tuple[int, ...]) -> Callable:
    def batch() -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(shape).astype(np.float32)
        return x, rng.standard_normal(shape).astype(np.float32)

    return batch


BATCH = 64


def mlp_case(width: int, depth: int = 8, batch: int = BATCH) -> Case:
    return Case(
        name=f"mlp{depth}x{width}",
        eqx_model=lambda: MLP(width, depth, key=jax.random.PRNGKey(0)),
        torch_model=lambda: TorchMLP(width, depth),
        batch=_classification((batch, width), width),
        jax_loss=_ce_jax,
        torch_loss=lambda out, y: F.cross_entropy(out, y.long()),
        description=f"MLP, {depth} Linear({width}, {width}) layers with ReLU, batch {batch}",
    )


def cnn_case(batch: int = BATCH) -> Case:
    return Case(
        name="cnn",
        eqx_model=lambda: CNN(key=jax.random.PRNGKey(0)),
        torch_model=TorchCNN,
        batch=_classification((batch, 1, 8, 8), 10),
        jax_loss=_ce_jax,
        torch_loss=lambda out, y: F.cross_entropy(out, y.long()),
        description=f"Conv2d(1, 4, 3)-ReLU-Linear(144, 10) on 8x8 images, batch {batch}",
    )


def block_case(dim: int = 64, heads: int = 4, seq: int = 32, batch: int = 16) -> Case:
    return Case(
        name="transformer",
        eqx_model=lambda: Block(dim, heads, key=jax.random.PRNGKey(0)),
        torch_model=lambda: TorchBlock(dim, heads),
        batch=_regression((batch, seq, dim)),
        jax_loss=_mse_jax,
        torch_loss=_mse_torch,
        description=(
            f"pre-norm transformer block, width {dim}, {heads} heads, MLP x4, "
            f"{batch} sequences of {seq} tokens"
        ),
    )


def copy_weights(src: eqx.Module, dst: torch.nn.Module) -> None:
    """Copies every weight of the Equinox model into the PyTorch one (same layouts)."""
    params = [x for x in jax.tree.leaves(src) if eqx.is_array(x)]
    targets = list(dst.parameters())
    if len(params) != len(targets):
        raise ValueError(f"{len(params)} Equinox arrays but {len(targets)} PyTorch parameters")
    with torch.no_grad():
        for p, t in zip(params, targets):
            t.copy_(torch.from_numpy(np.array(p).reshape(t.shape)))

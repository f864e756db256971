"""A GPT-2-shaped causal transformer for the clipping benchmark, in Equinox and PyTorch.

Equinox: scan-over-layers (the blocks' parameters stacked, one `lax.scan`), every block
under `jax.checkpoint` (or not: `remat=False`), the token embedding tied to the output
layer; the layout of large JAX models. PyTorch: the same blocks as a `ModuleList`, with
the output layer untied, since Opacus refuses a parameter shared by two modules, every
block under `torch.utils.checkpoint` when the JAX side checkpoints (its plain step; Opacus'
hooks record activations in the forward pass, which a checkpoint reruns, so Opacus runs the
twin without). Both sides take the same loss: `head="gather"` picks each target's
log-probability (`take_along_axis`; PyTorch's `cross_entropy`), `head="onehot"` sums the
log-probabilities times a one-hot row (in both), equal gradients by a different backward.

The full size: 12 layers, d_model 256, 8 heads, vocabulary 8192, sequence 64
(`--quick`: 2 layers, d_model 32, 4 heads, vocabulary 256, sequence 16).
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

FULL = {"depth": 12, "d": 256, "heads": 8, "vocab": 8192, "length": 64}
QUICK = {"depth": 2, "d": 32, "heads": 4, "vocab": 256, "length": 16}


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, d: int, heads: int, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.fc1 = eqx.nn.Linear(d, 4 * d, key=k2)
        self.fc2 = eqx.nn.Linear(4 * d, d, key=k3)

    def __call__(self, h):
        x = jax.vmap(self.ln1)(h)
        causal = jnp.tril(jnp.ones((h.shape[0], h.shape[0]), bool))
        h = h + self.attn(x, x, x, mask=causal)
        x = jax.vmap(self.ln2)(h)
        return h + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))


class GPT(eqx.Module):
    tok: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: Block  # stacked: a leading layer axis on every array
    ln: eqx.nn.LayerNorm
    remat: bool = eqx.field(static=True)

    def __init__(self, depth, d, heads, vocab, length, *, key, remat: bool = True):
        k1, k2, k3 = jax.random.split(key, 3)
        self.tok = eqx.nn.Embedding(vocab, d, key=k1)
        self.pos = eqx.nn.Embedding(length, d, key=k2)
        self.blocks = eqx.filter_vmap(lambda k: Block(d, heads, k))(jax.random.split(k3, depth))
        self.ln = eqx.nn.LayerNorm(d)
        self.remat = remat

    def __call__(self, ids):
        h = jax.vmap(self.tok)(ids) + jax.vmap(self.pos)(jnp.arange(ids.shape[0]))
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(h, p):
            return eqx.combine(p, static)(h), None

        h, _ = jax.lax.scan(jax.checkpoint(layer) if self.remat else layer, h, params)
        return jax.vmap(self.ln)(h) @ self.tok.weight.T  # tied output layer


def loss(model: GPT, ids, targets):
    """One sequence's mean next-token cross-entropy."""
    logp = jax.nn.log_softmax(model(ids))
    return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], 1))


def loss_onehot(model: GPT, ids, targets):
    """The same, as a product with one-hot rows."""
    logp = jax.nn.log_softmax(model(ids))
    return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, logp.shape[-1], dtype=logp.dtype) * logp, -1))


class TorchBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h):
        b, t, d = h.shape
        x = self.ln1(h)

        def split(z):
            return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        h = h + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))


class TorchGPT(nn.Module):
    """The twin, with its output layer untied (Opacus refuses a shared parameter)."""

    def __init__(self, depth, d, heads, vocab, length, remat: bool = False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(TorchBlock(d, heads) for _ in range(depth))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.remat = remat

    def forward(self, ids):
        b, t = ids.shape
        h = self.tok(ids) + self.pos(torch.arange(t).repeat(b, 1))
        for block in self.blocks:
            if self.remat and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(self.ln(h))


def torch_losses(model: nn.Module, x, y):
    """Per-example losses: each sequence's mean next-token cross-entropy."""
    logits = model(x)
    per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return per_token.view(y.shape).mean(dim=1)


def torch_losses_onehot(model: nn.Module, x, y):
    """The same, as a product with one-hot rows."""
    logp = torch.log_softmax(model(x), dim=-1)
    onehot = F.one_hot(y, logp.shape[-1]).to(logp.dtype)
    return -(onehot * logp).sum(-1).mean(dim=1)


def make_gpt_case(
    batch: int, quick: bool, remat: bool = True, head: str = "gather"
) -> dict[str, Any]:
    """The GPT-shaped case; `remat`: every block under `jax.checkpoint` (and, in PyTorch's
    plain step, `torch.utils.checkpoint`); `head`: the loss, `"gather"` or `"onehot"`."""
    size = QUICK if quick else FULL
    rng = np.random.default_rng(0)
    x = rng.integers(0, size["vocab"], (batch, size["length"]), dtype=np.int32)
    y = np.roll(x, -1, axis=1)
    label = f"gpt{size['depth']}x{size['d']} v{size['vocab']} t{size['length']}"
    label += ("" if remat else " no-checkpoint") + ("" if head == "gather" else " onehot")
    onehot = head == "onehot"
    return {
        "label": f"{label} b{batch}",
        "eqx": GPT(**size, key=jax.random.key(0), remat=remat),
        "torch": TorchGPT(**size, remat=remat),
        "x": x,
        "y": y,
        "loss": loss_onehot if onehot else loss,
        "torch_losses": torch_losses_onehot if onehot else torch_losses,
    }

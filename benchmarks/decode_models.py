"""A tiny GPT with a KV cache, in Equinox and in PyTorch, with the same math.

The Equinox model decodes one token at a time with a KV cache (`step`, for
`jhooks.generate`) and also runs a whole sequence without one (`__call__`); each block's
residual stream is the point `blocks.<i>.hook_resid_post`. The PyTorch twin has only
the full forward (`torch_gpt` copies the weights); PyTorch users steer it with forward
hooks on its blocks. Used by `benchmarks/decode.py`, `tests/test_generation.py` and
the generation notebook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

NEG = np.float32(-1e9)


@dataclass(frozen=True)
class Config:
    vocab: int = 48
    d: int = 32
    heads: int = 4
    layers: int = 2
    max_len: int = 72

    @property
    def head_dim(self) -> int:
        return self.d // self.heads


def _causal(scores: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    return jnp.where(k_pos[None, None, :] <= q_pos[None, :, None], scores, NEG)


class Attention(eqx.Module):
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, cfg: Config, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(cfg.d, 3 * cfg.d, key=k1)
        self.out = eqx.nn.Linear(cfg.d, cfg.d, key=k2)
        self.heads = cfg.heads

    def __call__(self, x: jax.Array, kv: Any, pos: Any) -> tuple[jax.Array, Any]:
        t, d = x.shape
        q, k, v = (a.reshape(t, self.heads, -1) for a in jnp.split(jax.vmap(self.qkv)(x), 3, -1))
        if kv is None:  # the whole sequence, no cache
            keys, values, q_pos = k, v, jnp.arange(t)
        else:
            keys = jax.lax.dynamic_update_slice_in_dim(kv[0], k, pos, 0)
            values = jax.lax.dynamic_update_slice_in_dim(kv[1], v, pos, 0)
            q_pos, kv = pos + jnp.arange(t), (keys, values)
        scale = np.float32(1.0 / np.sqrt(d // self.heads))
        scores = _causal(jnp.einsum("thd,shd->hts", q, keys) * scale, q_pos, jnp.arange(len(keys)))
        z = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, axis=-1), values)
        return jax.vmap(self.out)(z.reshape(t, d)), kv


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: Attention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, cfg: Config, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(cfg.d), eqx.nn.LayerNorm(cfg.d)
        self.attn = Attention(cfg, k1)
        self.fc1 = eqx.nn.Linear(cfg.d, 4 * cfg.d, key=k2)
        self.fc2 = eqx.nn.Linear(4 * cfg.d, cfg.d, key=k3)

    def __call__(self, x: jax.Array, kv: Any = None, pos: Any = 0) -> tuple[jax.Array, Any]:
        a, kv = self.attn(jax.vmap(self.ln1)(x), kv, pos)
        x = x + a
        h = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.ln2)(x)), approximate=True)
        x = x + jax.vmap(self.fc2)(h)
        return jhooks.hook_point(x, "hook_resid_post"), kv


class GPT(eqx.Module):
    embed: jax.Array
    pos_embed: jax.Array
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    unembed: jax.Array
    cfg: Config = eqx.field(static=True)

    def __init__(self, cfg: Config, key: jax.Array):
        keys = jax.random.split(key, cfg.layers + 3)
        self.embed = jax.random.normal(keys[0], (cfg.vocab, cfg.d))
        self.pos_embed = 0.5 * jax.random.normal(keys[1], (cfg.max_len, cfg.d))
        self.blocks = [Block(cfg, k) for k in keys[3:]]
        self.ln_f = eqx.nn.LayerNorm(cfg.d)
        self.unembed = jax.random.normal(keys[2], (cfg.d, cfg.vocab)) / np.float32(np.sqrt(cfg.d))
        self.cfg = cfg

    def _logits(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.ln_f)(x) @ self.unembed

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """The logits `(T, vocab)` of a whole sequence, with no KV cache."""
        x = self.embed[tokens] + self.pos_embed[: tokens.shape[0]]
        for block in self.blocks:
            x, _ = block(x)
        return self._logits(x)

    def init_cache(self) -> list[tuple[jax.Array, jax.Array]]:
        cfg = self.cfg
        shape = (cfg.max_len, cfg.heads, cfg.head_dim)
        return [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.layers)]


def step(model: GPT, cache: list, token: jax.Array, pos: jax.Array) -> tuple[jax.Array, list]:
    """One decoding step: the logits after `token` at `pos`, and the new KV cache."""
    x = (model.embed[token] + model.pos_embed[pos])[None]
    new = []
    for block, kv in zip(model.blocks, cache):
        x, kv = block(x, kv, pos)
        new.append(kv)
    return model._logits(x)[0], new


def make_gpt(cfg: Config = Config(), seed: int = 0) -> GPT:
    return jhooks.hookable(GPT(cfg, jax.random.key(seed)))


# -- the PyTorch twin ------------------------------------------------------------------


class TorchBlock(torch.nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(cfg.d), torch.nn.LayerNorm(cfg.d)
        self.qkv = torch.nn.Linear(cfg.d, 3 * cfg.d)
        self.out = torch.nn.Linear(cfg.d, cfg.d)
        self.fc1 = torch.nn.Linear(cfg.d, 4 * cfg.d)
        self.fc2 = torch.nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        q, k, v = (a.reshape(t, self.heads, -1) for a in self.qkv(self.ln1(x)).chunk(3, -1))
        scores = torch.einsum("thd,shd->hts", q, k) / np.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        pattern = scores.masked_fill(~mask, -1e9).softmax(-1)
        x = x + self.out(torch.einsum("hts,shd->thd", pattern, v).reshape(t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(cfg.vocab, cfg.d))
        self.pos_embed = torch.nn.Parameter(torch.zeros(cfg.max_len, cfg.d))
        self.blocks = torch.nn.ModuleList(TorchBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = torch.nn.LayerNorm(cfg.d)
        self.unembed = torch.nn.Parameter(torch.zeros(cfg.d, cfg.vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens] + self.pos_embed[: len(tokens)]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.unembed


def _t(x: Any) -> torch.Tensor:
    return torch.tensor(np.asarray(x))


def torch_gpt(model: GPT) -> TorchGPT:
    """The PyTorch twin of `model`, with its weights."""
    twin = TorchGPT(model.cfg)
    with torch.no_grad():
        twin.embed.copy_(_t(model.embed))
        twin.pos_embed.copy_(_t(model.pos_embed))
        twin.unembed.copy_(_t(model.unembed))
        twin.ln_f.weight.copy_(_t(model.ln_f.weight))
        twin.ln_f.bias.copy_(_t(model.ln_f.bias))
        for ours, theirs in zip(model.blocks, twin.blocks):
            pairs = [
                (ours.attn.qkv, theirs.qkv),
                (ours.attn.out, theirs.out),
                (ours.fc1, theirs.fc1),
                (ours.fc2, theirs.fc2),
                (ours.ln1, theirs.ln1),
                (ours.ln2, theirs.ln2),
            ]
            for a, b in pairs:
                b.weight.copy_(_t(a.weight))
                b.bias.copy_(_t(a.bias))
    return twin


def torch_greedy(twin: TorchGPT, prompt: Any, new: int, steer: Any = None) -> np.ndarray:
    """Greedy decoding with no KV cache; `steer` (a `(d,)` tensor) is added to every
    block's output by forward hooks."""
    handles = []
    if steer is not None:
        for block in twin.blocks:
            handles.append(block.register_forward_hook(lambda m, args, out: out + steer))
    tokens = torch.tensor(np.asarray(prompt), dtype=torch.long)
    try:
        with torch.no_grad():
            for _ in range(new):
                nxt = twin(tokens)[-1].argmax()
                tokens = torch.cat([tokens, nxt[None]])
    finally:
        for h in handles:
            h.remove()
    return tokens.numpy()

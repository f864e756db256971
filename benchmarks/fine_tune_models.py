"""Models of the layouts people fine-tune, for `jhooks.clipped_grad` (issue 35).

- `GemmaLM`: a decoder whose norms are Gemma's RMSNorm, `x * (1 + scale)` (every norm of
  Gemma 3), whose attention reads a fused QKV weight sliced into its three parts (as
  GPT-2's `c_attn`; `qkv="slice"`: `W[:, :d]`, `W[:, d:2d]`, `W[:, 2d:]`, or
  `qkv="split"`: `jnp.split(W, 3, axis=-1)`), and whose MLP is gated (GeGLU).
- `MoELM`: a decoder whose MLP is a mixture of experts with top-k routing, the experts'
  weights stacked `(experts, d, f)`: `routing="gather"` picks each token's experts by
  index (`W[ids]`), `"take"` with `jnp.take`, `"vmap"` with `W[i]` under `jax.vmap` over
  tokens and choices, `"loop"` runs every expert on every token in a Python loop over
  experts (`W[i]`, a static `i`) and weighs the outputs by the router (zero off the top k).

Each is a function of one example's token ids, `(length,)`; `next_token_loss` is its loss.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp


def _normal(key, shape, scale):
    return scale * jax.random.normal(key, shape)


class RMSNorm(eqx.Module):
    """Gemma's RMSNorm: `x / rms(x) * (1 + scale)`, `scale` initialised at zero in Gemma
    (random here, so that a test sees it)."""

    scale: jax.Array

    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
        return x * (1 + self.scale)


def _attention(x, wqkv, wo, heads: int, qkv: str):
    length, d = x.shape
    if qkv == "split":
        wq, wk, wv = jnp.split(wqkv, 3, axis=-1)
    else:
        wq, wk, wv = wqkv[:, :d], wqkv[:, d : 2 * d], wqkv[:, 2 * d :]
    q, k, v = ((x @ w).reshape(length, heads, -1) for w in (wq, wk, wv))
    logits = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
    mask = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), -1)
    return jnp.einsum("hts,shd->thd", weights, v).reshape(length, d) @ wo


class GemmaBlock(eqx.Module):
    norm1: RMSNorm
    wqkv: jax.Array
    wo: jax.Array
    norm2: RMSNorm
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    heads: int = eqx.field(static=True)
    qkv: str = eqx.field(static=True)

    def __init__(self, d, heads, hidden, qkv, *, key):
        k = jax.random.split(key, 5)
        s = d**-0.5
        self.norm1 = RMSNorm(_normal(k[0], (d,), 0.1))
        self.norm2 = RMSNorm(_normal(k[0], (d,), 0.1) + 0.05)
        self.wqkv, self.wo = _normal(k[1], (d, 3 * d), s), _normal(k[2], (d, d), s)
        self.gate, self.up = _normal(k[3], (d, hidden), s), _normal(k[4], (d, hidden), s)
        self.down = _normal(k[4], (hidden, d), hidden**-0.5)
        self.heads, self.qkv = heads, qkv

    def __call__(self, x):
        x = x + _attention(self.norm1(x), self.wqkv, self.wo, self.heads, self.qkv)
        h = self.norm2(x)
        return x + (jax.nn.gelu(h @ self.gate) * (h @ self.up)) @ self.down


class MoE(eqx.Module):
    router: jax.Array
    up: jax.Array
    down: jax.Array
    top: int = eqx.field(static=True)
    routing: str = eqx.field(static=True)

    def __init__(self, d, hidden, experts, top, routing, *, key):
        k = jax.random.split(key, 3)
        self.router = _normal(k[0], (d, experts), d**-0.5)
        self.up = _normal(k[1], (experts, d, hidden), d**-0.5)
        self.down = _normal(k[2], (experts, hidden, d), hidden**-0.5)
        self.top, self.routing = top, routing

    def __call__(self, x):  # (length, d)
        weights, ids = jax.lax.top_k(x @ self.router, self.top)
        weights = jax.nn.softmax(weights, -1)
        if self.routing == "loop":
            experts = self.up.shape[0]
            dense = jnp.sum(jax.nn.one_hot(ids, experts, dtype=x.dtype) * weights[..., None], 1)
            out = jnp.zeros_like(x)
            for i in range(experts):
                out = out + dense[:, i : i + 1] * (jax.nn.gelu(x @ self.up[i]) @ self.down[i])
            return out
        if self.routing == "vmap":

            def token(x, ids):
                return jax.vmap(lambda i: jax.nn.gelu(x @ self.up[i]) @ self.down[i])(ids)

            out = jax.vmap(token)(x, ids)
        else:
            if self.routing == "take":
                up, down = jnp.take(self.up, ids, axis=0), jnp.take(self.down, ids, axis=0)
            else:
                up, down = self.up[ids], self.down[ids]
            h = jax.nn.gelu(jnp.einsum("td,tkdf->tkf", x, up))
            out = jnp.einsum("tkf,tkfd->tkd", h, down)
        return jnp.sum(out * weights[..., None], 1)


class MoEBlock(eqx.Module):
    norm1: RMSNorm
    wqkv: jax.Array
    wo: jax.Array
    norm2: RMSNorm
    moe: MoE
    heads: int = eqx.field(static=True)

    def __init__(self, d, heads, hidden, experts, top, routing, *, key):
        k = jax.random.split(key, 4)
        self.norm1, self.norm2 = RMSNorm(_normal(k[0], (d,), 0.1)), RMSNorm(jnp.zeros(d))
        self.wqkv = _normal(k[1], (d, 3 * d), d**-0.5)
        self.wo = _normal(k[2], (d, d), d**-0.5)
        self.moe = MoE(d, hidden, experts, top, routing, key=k[3])
        self.heads = heads

    def __call__(self, x):
        x = x + _attention(self.norm1(x), self.wqkv, self.wo, self.heads, "split")
        return x + self.moe(self.norm2(x))


class LM(eqx.Module):
    embed: jax.Array
    blocks: list
    norm: RMSNorm
    head: jax.Array

    def __call__(self, ids):
        x = self.embed[ids]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.head


def GemmaLM(vocab=64, d=16, heads=2, hidden=32, depth=2, qkv="slice", *, key) -> LM:
    k = jax.random.split(key, depth + 3)
    blocks = [GemmaBlock(d, heads, hidden, qkv, key=k[i]) for i in range(depth)]
    return LM(
        _normal(k[-3], (vocab, d), 1.0), blocks, RMSNorm(_normal(k[-2], (d,), 0.1)),
        _normal(k[-1], (d, vocab), d**-0.5),
    )  # fmt: skip


def MoELM(vocab=64, d=16, heads=2, hidden=24, experts=4, top=2, depth=1, routing="gather", *, key):
    k = jax.random.split(key, depth + 3)
    blocks = [MoEBlock(d, heads, hidden, experts, top, routing, key=k[i]) for i in range(depth)]
    return LM(
        _normal(k[-3], (vocab, d), 1.0), blocks, RMSNorm(_normal(k[-2], (d,), 0.1)),
        _normal(k[-1], (d, vocab), d**-0.5),
    )  # fmt: skip


def next_token_loss(model, ids):
    """One example's loss: the mean negative log-likelihood of each next token."""
    logits = jax.nn.log_softmax(model(ids[:-1]))
    return -jnp.mean(jnp.take_along_axis(logits, ids[1:, None], 1))

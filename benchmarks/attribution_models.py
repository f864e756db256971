"""The GPT-2-shaped model that attribution is measured and tested on, as plain JAX.

Parameters are a dict of arrays (so a PyTorch twin copies them leaf by leaf); the
forward pass marks TransformerLens' points with `jhooks.hook_point`, with each layer's
query, key and value inputs split per head (TransformerLens' `use_split_qkv_input`) so
that the residual stream's readers are points:

- writers: `hook_embed` (token and position embeddings), `blocks.{l}.attn.hook_result`
  (`[position, head, d_model]`: each head's output) and `blocks.{l}.hook_mlp_out`;
- readers: `blocks.{l}.hook_{q,k,v}_input` (`[position, head, d_model]`),
  `blocks.{l}.hook_mlp_in` and `hook_resid_final` (the unembedding's input);
- and `blocks.{l}.attn.hook_q`, `hook_k` (`[position, head, d_head]`),
  `hook_attn_scores`, `hook_pattern` (`[head, query, key]`), `hook_z`.

`mlp=False` gives an attention-only model (the induction model); `ln=False` drops the
layer norms.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import jhooks

WRITERS = ["hook_embed", "blocks.*.attn.hook_result", "blocks.*.hook_mlp_out"]
READERS = ["blocks.*.hook_[qkv]_input", "blocks.*.hook_mlp_in", "hook_resid_final"]
MASKED = -1e9  # a masked attention score (finite, so clean - corrupt is 0 there)


def init_gpt(
    key: jax.Array | np.random.Generator,
    *,
    vocab: int = 11,
    d_model: int = 16,
    heads: int = 4,
    d_head: int = 4,
    d_mlp: int = 32,
    layers: int = 2,
    max_len: int = 8,
    mlp: bool = True,
    ln: bool = True,
    scale: float = 0.3,
) -> dict:
    """Random parameters (normal, times `scale`; layer norms around 1), drawn from a JAX
    key, or from a NumPy generator (nothing to compile: quicker to start on a CPU)."""
    if isinstance(key, np.random.Generator):
        rng = key

        def standard(*shape: int) -> jax.Array:
            return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    else:
        keys = iter(jax.random.split(key, 8 + 20 * layers))

        def standard(*shape: int) -> jax.Array:
            return jax.random.normal(next(keys), shape)

    def normal(*shape: int) -> jax.Array:
        return scale * standard(*shape)

    def norm() -> tuple[jax.Array, jax.Array]:
        return 1.0 + 0.1 * standard(d_model), normal(d_model)

    params: dict = {"wte": normal(vocab, d_model), "wpe": normal(max_len, d_model)}
    params["w_u"] = normal(d_model, vocab)
    if ln:
        params["lnf_g"], params["lnf_b"] = norm()
    blocks = []
    for _ in range(layers):
        b = {
            "w_q": normal(heads, d_model, d_head),
            "w_k": normal(heads, d_model, d_head),
            "w_v": normal(heads, d_model, d_head),
            "b_q": normal(heads, d_head),
            "b_k": normal(heads, d_head),
            "b_v": normal(heads, d_head),
            "w_o": normal(heads, d_head, d_model),
            "b_o": normal(d_model),
        }
        if ln:
            b["ln1_g"], b["ln1_b"] = norm()
        if mlp:
            b["w_in"], b["b_in"] = normal(d_model, d_mlp), normal(d_mlp)
            b["w_out"], b["b_out"] = normal(d_mlp, d_model), normal(d_model)
            if ln:
                b["ln2_g"], b["ln2_b"] = norm()
        blocks.append(b)
    params["blocks"] = blocks
    return params


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * g + b


def gpt(params: dict, tokens: jax.Array) -> jax.Array:
    """Logits `[position, vocab]` for `tokens` `[position]`."""
    seq = tokens.shape[0]
    x = jhooks.hook_point(params["wte"][tokens] + params["wpe"][:seq], "hook_embed")
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    for i, b in enumerate(params["blocks"]):
        p = f"blocks.{i}."
        heads, _, d_head = b["w_q"].shape
        split = jnp.broadcast_to(x[:, None], (seq, heads, x.shape[-1]))

        def project(kind: str, b: dict = b, split: jax.Array = split, p: str = p) -> jax.Array:
            h = jhooks.hook_point(split, f"{p}hook_{kind}_input")
            if "ln1_g" in b:
                h = layer_norm(h, b["ln1_g"], b["ln1_b"])
            return jnp.einsum("thd,hde->the", h, b[f"w_{kind}"]) + b[f"b_{kind}"]

        q, k, v = project("q"), project("k"), project("v")
        q, k = jhooks.hook_point(q, f"{p}attn.hook_q"), jhooks.hook_point(k, f"{p}attn.hook_k")
        scores = jnp.einsum("qhe,khe->hqk", q, k) / math.sqrt(d_head)
        scores = jhooks.hook_point(jnp.where(causal, scores, MASKED), f"{p}attn.hook_attn_scores")
        pattern = jhooks.hook_point(jax.nn.softmax(scores, -1), f"{p}attn.hook_pattern")
        z = jhooks.hook_point(jnp.einsum("hqk,khe->qhe", pattern, v), f"{p}attn.hook_z")
        result = jnp.einsum("the,hed->thd", z, b["w_o"])
        result = jhooks.hook_point(result, f"{p}attn.hook_result")
        x = x + result.sum(1) + b["b_o"]
        if "w_in" in b:
            h = jhooks.hook_point(x, f"{p}hook_mlp_in")
            if "ln2_g" in b:
                h = layer_norm(h, b["ln2_g"], b["ln2_b"])
            h = jax.nn.gelu(h @ b["w_in"] + b["b_in"], approximate=True)
            x = x + jhooks.hook_point(h @ b["w_out"] + b["b_out"], f"{p}hook_mlp_out")
    x = jhooks.hook_point(x, "hook_resid_final")
    if "lnf_g" in params:
        x = layer_norm(x, params["lnf_g"], params["lnf_b"])
    return x @ params["w_u"]


def induction_batch(key: jax.Array, batch: int, half: int, vocab: int) -> jax.Array:
    """Random token sequences repeated once: `[batch, 2 * half]`."""
    first = jax.random.randint(key, (batch, half), 0, vocab)
    return jnp.concatenate([first, first], axis=1)


def repeats(
    rng: np.random.Generator, batch: tuple[int, ...], half: int, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random sequences repeated with a random period in `(half // 2, half]`, and the
    mask of the positions whose next token is a repeat: `([*batch, 2 * half], same)`.

    The period varies, so that copying from a fixed distance back does not work: the
    model has to find the earlier occurrence of the current token (induction). NumPy:
    every batch of a training run drawn at once, nothing to compile.
    """
    first = rng.integers(0, vocab, (*batch, 2 * half))
    period = rng.integers(half // 2 + 1, half + 1, (*batch, 1))
    position = np.arange(2 * half)
    tokens = np.take_along_axis(first, position % period, axis=-1)
    return tokens.astype(np.int32), position + 1 >= period


def train_induction(
    seed: int = 0,
    *,
    steps: int = 200,
    batch: int = 32,
    half: int = 8,
    vocab: int = 16,
    lr: float = 5e-2,
    log_every: int = 50,
    **kw,
) -> tuple[dict, list[float]]:
    """A 2-layer attention-only model trained to continue repeated sequences.

    Adam, its learning rate warmed up over the first tenth of the steps and decayed
    (cosine) to a tenth; no layer norms unless `ln=True` is passed (the model learns the
    task in fewer steps without them, and each step costs less). The initial weights
    and the data come from NumPy (`seed`): the one program compiled is the step.

    **Returns:**

    `(params, losses)`: the loss on the repeated tokens every `log_every` steps and at
    the last.
    """
    import optax

    rng = np.random.default_rng(seed)
    kw.setdefault("ln", False)
    params = init_gpt(rng, vocab=vocab, max_len=2 * half, mlp=False, scale=0.2, **kw)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr / 10)
    opt = optax.adam(schedule)
    state = jax.jit(opt.init)(params)
    tokens, repeated = repeats(rng, (steps, batch), half, vocab)

    def loss_fn(params: dict, tokens: jax.Array, repeated: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(jax.vmap(lambda t: gpt(params, t))(tokens)[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        mask = repeated[:, :-1]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    @jax.jit
    def step(params: dict, state: optax.OptState, tokens: jax.Array, repeated: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, repeated)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, tokens[i], repeated[i])
        if i % log_every == 0 or i == steps - 1:
            losses.append(float(loss))
    return params, losses


def as_numpy(params: dict) -> dict:
    return jax.tree.map(np.asarray, params)

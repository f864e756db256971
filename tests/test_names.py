"""`jhooks.NameMap`: a user's own map of TransformerLens' names, on a GPT-2 written in
Equinox the way a user would (attributes named as Hugging Face's GPT-2: `wte`, `h`,
`ln_1`, `attn.c_attn`...), and the errors of a map.

The values come back under TransformerLens' names and layout, equal to the model's
own submodules called in order by hand; patches through a layout function are written
back; the arrays a hook closes over are arguments of the program (a new value is
used); the gradients (`incl_bwd`) come back in the name's layout too.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

D, HEADS, LAYERS, VOCAB, CONTEXT = 16, 4, 2, 32, 8
B, T = 2, 6


class Linear(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __init__(self, n_in, n_out, key):
        self.weight = jax.random.normal(key, (n_in, n_out)) * 0.3
        self.bias = jax.random.normal(jax.random.fold_in(key, 1), (n_out,)) * 0.1

    def __call__(self, x):
        return x @ self.weight + self.bias


class Embedding(eqx.Module):
    weight: jax.Array

    def __init__(self, n, d, key):
        self.weight = jax.random.normal(key, (n, d))

    def __call__(self, ids):
        return self.weight[ids]


class LayerNorm(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __init__(self, key):
        self.weight = 1.0 + 0.1 * jax.random.normal(key, (D,))
        self.bias = 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (D,))

    def __call__(self, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * self.weight + self.bias


class Attention(eqx.Module):
    c_attn: Linear
    c_proj: Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.c_attn, self.c_proj = Linear(D, 3 * D, k1), Linear(D, D, k2)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        q = q.reshape(b, t, HEADS, D // HEADS)
        k = k.reshape(b, t, HEADS, D // HEADS)
        v = v.reshape(b, t, HEADS, D // HEADS)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
        pattern = jax.nn.softmax(scores, axis=-1)
        z = jnp.einsum("bhqk,bkhd->bqhd", pattern, v)
        return self.c_proj(z.reshape(b, t, D))


class MLP(eqx.Module):
    c_fc: Linear
    c_proj: Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.c_fc, self.c_proj = Linear(D, 4 * D, k1), Linear(4 * D, D, k2)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x)))


class Block(eqx.Module):
    ln_1: LayerNorm
    attn: Attention
    ln_2: LayerNorm
    mlp: MLP

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.ln_1, self.attn, self.ln_2, self.mlp = (
            LayerNorm(k[0]),
            Attention(k[1]),
            LayerNorm(k[2]),
            MLP(k[3]),
        )

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(eqx.Module):
    wte: Embedding
    wpe: Embedding
    h: list
    ln_f: LayerNorm

    def __init__(self, key):
        k = jax.random.split(key, LAYERS + 3)
        self.wte, self.wpe = Embedding(VOCAB, D, k[0]), Embedding(CONTEXT, D, k[1])
        self.h = [Block(k[3 + i]) for i in range(LAYERS)]
        self.ln_f = LayerNorm(k[2])

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T


def _heads(z):
    return z.reshape(*z.shape[:-1], HEADS, D // HEADS)


def _with_heads(z, new):
    return new.reshape(z.shape)


# The user's map: TransformerLens' names for this GPT-2.
GPT2_NAMES = jhooks.NameMap(
    {
        "hook_embed": "wte",
        "hook_pos_embed": "wpe",
        "blocks.{i}.hook_resid_pre": "h.{i}:in",
        "blocks.{i}.ln1.hook_normalized": "h.{i}.ln_1",
        "blocks.{i}.attn.hook_q": "h.{i}.attn/reshape",
        "blocks.{i}.attn.hook_k": "h.{i}.attn/reshape:1",
        "blocks.{i}.attn.hook_v": "h.{i}.attn/reshape:2",
        "blocks.{i}.attn.hook_attn_scores": "h.{i}.attn/where",
        "blocks.{i}.attn.hook_pattern": "h.{i}.attn/softmax",
        # The heads meet where they enter c_proj, as (batch, pos, d_model): TL's layout
        # (batch, pos, head, d_head) read from it.
        "blocks.{i}.attn.hook_z": jhooks.Name(
            "h.{i}.attn.c_proj:in", _heads, _with_heads, "(batch, pos, head, d_head)"
        ),
        "blocks.{i}.hook_attn_out": "h.{i}.attn",
        "blocks.{i}.hook_resid_mid": "h.{i}/add",
        "blocks.{i}.ln2.hook_normalized": "h.{i}.ln_2",
        "blocks.{i}.mlp.hook_pre": "h.{i}.mlp.c_fc",
        "blocks.{i}.mlp.hook_post": "h.{i}.mlp.c_proj:in",
        "blocks.{i}.hook_mlp_out": "h.{i}.mlp",
        "blocks.{i}.hook_resid_post": "h.{i}",
        "ln_final.hook_normalized": "ln_f",
    },
    "gpt2",
)


def by_hand(model, tokens, edit_z=None):
    """(logits, values by TransformerLens name): the submodules called in order."""
    got = {"hook_embed": model.wte(tokens), "hook_pos_embed": model.wpe(jnp.arange(T))}
    x = got["hook_embed"] + got["hook_pos_embed"]
    for i, block in enumerate(model.h):
        at = f"blocks.{i}."
        got[at + "hook_resid_pre"] = x
        h = got[at + "ln1.hook_normalized"] = block.ln_1(x)
        q, k, v = (_heads(a) for a in jnp.split(block.attn.c_attn(h), 3, axis=-1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
        pattern = jax.nn.softmax(scores, axis=-1)
        z = jnp.einsum("bhqk,bkhd->bqhd", pattern, v)
        if edit_z is not None and edit_z[0] == i:
            z = edit_z[1](z)
        a = block.attn.c_proj(z.reshape(B, T, D))
        got.update({
            at + "attn.hook_q": q, at + "attn.hook_k": k, at + "attn.hook_v": v,
            at + "attn.hook_attn_scores": scores, at + "attn.hook_pattern": pattern,
            at + "attn.hook_z": z, at + "hook_attn_out": a,
        })  # fmt: skip
        x = got[at + "hook_resid_mid"] = x + a
        h2 = got[at + "ln2.hook_normalized"] = block.ln_2(x)
        pre = got[at + "mlp.hook_pre"] = block.mlp.c_fc(h2)
        post = got[at + "mlp.hook_post"] = jax.nn.gelu(pre)
        m = got[at + "hook_mlp_out"] = block.mlp.c_proj(post)
        x = got[at + "hook_resid_post"] = x + m
    got["ln_final.hook_normalized"] = model.ln_f(x)
    return got["ln_final.hook_normalized"] @ model.wte.weight.T, got


@pytest.fixture(scope="module")
def gpt2():
    return jhooks.hookable(GPT2(jax.random.PRNGKey(0)))


def tokens(seed=0):
    return jax.random.randint(jax.random.PRNGKey(seed), (B, T), 0, VOCAB)


def close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_a_users_map_caches_every_name_in_its_layout(gpt2, maybe_jit):
    expected_logits, expected = by_hand(gpt2, tokens())
    logits, cache = maybe_jit(lambda m, x: GPT2_NAMES.run_with_cache(m, x))(gpt2, tokens())
    close(logits, expected_logits)
    assert sorted(cache) == sorted(expected)
    for name, value in expected.items():
        assert cache[name].shape == value.shape, name
        close(cache[name], value)


def test_selected_names_and_gradients_come_back_in_the_names_layout(gpt2, maybe_jit):
    names = ["blocks.*.attn.hook_z", "blocks.1.hook_resid_mid"]

    def loss(model, x):
        return model(x)[:, -1, 3].sum()

    def run(model, x):
        return GPT2_NAMES.run_with_cache(
            lambda x: loss(model, x), x, names_filter=names, incl_bwd=True
        )

    _, cache = maybe_jit(run)(gpt2, tokens(1))
    reached = ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z", "blocks.1.hook_resid_mid"]
    # In the order reached (a dict returned by jax.jit comes back sorted by key).
    order = list(cache) if maybe_jit is not jax.jit else reached + [n + "_grad" for n in reached]
    assert order == reached + [n + "_grad" for n in reached]
    assert sorted(cache) == sorted(order)
    _, expected = by_hand(gpt2, tokens(1))

    def loss_with_z(z):
        logits, _ = by_hand(gpt2, tokens(1), edit_z=(0, lambda _: z))
        return logits[:, -1, 3].sum()

    close(cache["blocks.0.attn.hook_z"], expected["blocks.0.attn.hook_z"])
    grad = jax.jit(jax.grad(loss_with_z))(expected["blocks.0.attn.hook_z"])
    assert cache["blocks.0.attn.hook_z_grad"].shape == (B, T, HEADS, D // HEADS)
    close(cache["blocks.0.attn.hook_z_grad"], grad)


def test_a_patch_through_a_layout_uses_the_arrays_its_hook_closes_over(gpt2, maybe_jit):
    """hook_z's layout function (c_proj's input reshaped to heads): the hook's return is
    written back; a new array closed over by the hook is used, not a stale constant."""

    def patched(model, x, scale):
        def hook(z, hook):
            assert z.shape == (B, T, HEADS, D // HEADS) and hook.name == "blocks.1.attn.hook_z"
            return z.at[:, :, 2].multiply(scale)

        return GPT2_NAMES.run_with_hooks(model, x, fwd_hooks=[("blocks.1.attn.hook_z", hook)])

    run = maybe_jit(patched)
    for scale in (jnp.float32(0.0), jnp.float32(3.0)):
        twin, _ = by_hand(gpt2, tokens(2), edit_z=(1, lambda z, s=scale: z.at[:, :, 2].multiply(s)))
        close(run(gpt2, tokens(2), scale), twin)


def test_a_backward_hook_sees_and_replaces_the_gradient_in_the_names_layout(gpt2, maybe_jit):
    """A backward hook on hook_z (c_proj's input, read as heads) that drops head 2's
    gradient: the model's gradient equals the hand computation's with that head's z
    under `stop_gradient`."""

    def loss(model, x):
        return model(x)[:, -1, 3].sum()

    def drop_head_2(grad, hook):
        assert grad.shape == (B, T, HEADS, D // HEADS) and hook.layer() == 1
        return grad.at[:, :, 2].set(0.0)

    def hooked(model, x):
        return GPT2_NAMES.run_with_hooks(
            lambda m: loss(m, x), model, bwd_hooks=[("blocks.1.attn.hook_z", drop_head_2)]
        )

    grad = eqx.filter_grad(hooked)
    grads = (eqx.filter_jit(grad) if maybe_jit is jax.jit else grad)(gpt2, tokens(5))

    def twin(model):
        edit = (1, lambda z: z.at[:, :, 2].set(jax.lax.stop_gradient(z[:, :, 2])))
        logits, _ = by_hand(model, tokens(5), edit_z=edit)
        return logits[:, -1, 3].sum()

    expected = eqx.filter_jit(eqx.filter_grad(twin))(gpt2)
    plain = eqx.filter_jit(eqx.filter_grad(lambda m: loss(m, tokens(5))))(gpt2)
    close(grads.h[0].attn.c_attn.weight, expected.h[0].attn.c_attn.weight)
    close(grads.wte.weight, expected.wte.weight)
    assert not np.allclose(grads.wte.weight, plain.wte.weight, atol=1e-4)  # it did change


def test_attribution_by_a_users_names(gpt2, maybe_jit):
    """AtP of hook_z through its layout function, per head: `(clean - corrupt) *
    dmetric/dz` summed over d_head, against the gradient of the hand computation."""
    clean, corrupt = tokens(3), tokens(4)

    def metric(logits):
        return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()

    def scored(model, clean, corrupt):
        return GPT2_NAMES.attribution(metric, model, clean, corrupt, nodes="blocks.*.attn.hook_z")

    scores = maybe_jit(scored)(gpt2, clean, corrupt)
    assert list(scores) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    _, at_clean = by_hand(gpt2, clean)
    _, at_corrupt = by_hand(gpt2, corrupt)
    for i in range(LAYERS):
        name = f"blocks.{i}.attn.hook_z"

        def metric_with_z(z, i=i):
            logits, _ = by_hand(gpt2, corrupt, edit_z=(i, lambda _: z))
            return metric(logits)

        grad = jax.jit(jax.grad(metric_with_z))(at_corrupt[name])
        close(scores[name], ((at_clean[name] - at_corrupt[name]) * grad).sum(-1), rtol=1e-4)


def test_a_map_extends_with_or():
    more = GPT2_NAMES | {"blocks.{i}.mlp.hook_gelu": "h.{i}.mlp/gelu"}
    assert isinstance(more, jhooks.NameMap) and "blocks.{i}.mlp.hook_gelu" not in GPT2_NAMES.names
    assert more.address("blocks.1.mlp.hook_gelu") == "h.1.mlp/gelu"
    assert more.address("blocks.*.attn.hook_z") == "h.*.attn.c_proj:in"
    assert jhooks.transformer_lens_names("llama3").address("blocks.0.attn.hook_z") == (
        "layers.0.attn.o_proj:in"
    )


def test_errors_name_the_name_and_what_was_expected(gpt2):
    with pytest.raises(
        ValueError, match=r"NameMap 'gpt2': no name 'blocks.0.attn.hook_zz'.*Did you mean"
    ):
        GPT2_NAMES.run_with_cache(gpt2, tokens(), names_filter="blocks.0.attn.hook_zz")
    with pytest.raises(ValueError, match=r"Only the layer index may be '\*'"):
        GPT2_NAMES.address("blocks.0.attn.hook_*")
    with pytest.raises(TypeError, match=r"takes names, '\*' patterns of the layer index"):
        GPT2_NAMES.run_with_cache(gpt2, tokens(), names_filter=lambda n: "hook_z" in n)
    # A layer the model does not have: the run's refusal, said of the name.
    with pytest.raises(
        ValueError, match=r"NameMap 'gpt2': 'blocks.7.hook_resid_post' stands for 'h.7': "
    ):
        GPT2_NAMES.run_with_cache(gpt2, tokens(), names_filter="blocks.7.hook_resid_post")
    with pytest.raises(TypeError, match=r"read and write go together.*got only read"):
        jhooks.Name("h.{i}.attn.c_proj:in", read=_heads)
    with pytest.raises(ValueError, match=r"'blocks.{i}.x' and its address 'h.0' must both hold"):
        jhooks.NameMap({"blocks.{i}.x": "h.0"}, "mine")
    with pytest.raises(TypeError, match=r"run_with_cache does not take max_steps"):
        GPT2_NAMES.run_with_cache(gpt2, tokens(), max_steps=4)
    with pytest.raises(TypeError, match=r"attribution scores nodes by name; \['edges'\]"):
        GPT2_NAMES.attribution(lambda y: y.sum(), gpt2, tokens(), tokens(1), edges=True)

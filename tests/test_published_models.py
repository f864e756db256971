"""Models published by other people (esm2quinox's ESM2 and equimo's ViT in Equinox,
mamba2-jax in Flax NNX), installed from the package index and used unmodified (tiny
random-initialised configurations): `run_with_cache` with no filter works, and values
inside them (module outputs and inputs, such as the residual stream
between attention and MLP) are cached, patched under jit and differentiated, equal to a
hand-annotated twin of the model's code.

Attention patterns by operation address (`blocks.0.attn/softmax`) are tested with that
feature, not here.
"""

import equinox as eqx
import esm2quinox
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equimo.models.vit import VisionTransformer
from flax import nnx
from mamba2_jax.modeling import Mamba2Config, Mamba2Model

import jhooks


def close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# esm2quinox's ESM2: layers stacked with eqx.filter_vmap and applied with lax.scan,
# inside its own eqx.filter_jit; a rotary embedding applied to q and to k; Equinox's
# MultiheadAttention.

LAYERS = 2


@eqx.filter_jit
def esm2_twin(model, tokens, scale=1.0, probes=None):
    """esm2quinox's forward pass written out by hand (a Python loop over the layers),
    with the residual stream between attention and MLP returned, and where it enters
    the second layer norm, scaled by `scale` and plus `probes[layer]`."""
    x = jax.vmap(model.embedding)(tokens)
    is_pad = tokens == 1
    x = jnp.where(jnp.logical_not(is_pad)[:, None], x, 0)
    dynamic, static = eqx.partition(model.layers, eqx.is_array)
    mids = []
    for i in range(model.num_layers):
        layer = eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static)

        def process_heads(q, k, v, layer=layer):
            rotate = jax.vmap(layer.rotary_embed, in_axes=1, out_axes=1)
            return rotate(q), rotate(k), v

        mask = jnp.broadcast_to(jnp.logical_not(is_pad), (x.shape[0], x.shape[0]))
        y = jax.vmap(layer.layer_norm1)(x)
        x = x + layer.attn(y, y, y, process_heads=process_heads, mask=mask)
        mids.append(x)
        y = x * scale + (0.0 if probes is None else probes[i])
        y = jax.vmap(layer.linear1)(jax.vmap(layer.layer_norm2)(y))
        x = x + jax.vmap(layer.linear2)(jax.nn.gelu(y, approximate=False))
    logits = jax.vmap(model.logit_head)(jax.vmap(model.layer_norm)(x))
    return logits, jnp.stack(mids)


@pytest.fixture(scope="module")
def esm2():
    plain = esm2quinox.ESM2(
        num_layers=LAYERS,
        embed_size=16,
        num_heads=2,
        token_dropout=False,
        key=jax.random.PRNGKey(0),
    )
    tokens = jnp.asarray(esm2quinox.tokenise(["SPIDERMAN", "FOO"])[1])  # padded
    return plain, jhooks.hookable(plain), tokens


RESID_MID = "layers.layer_norm2:in"  # the residual stream between attention and MLP


def test_esm2_cache_with_no_filter(esm2, maybe_jit):
    plain, model, tokens = esm2
    out, cache = maybe_jit(lambda t: jhooks.run_with_cache(model, t))(tokens)
    close(out.logits, plain(tokens).logits)
    # The rotary embedding is applied to q, then to k: one point per call.
    q_rotated, k_rotated = cache["layers.rotary_embed"], cache["layers.rotary_embed:1"]
    assert q_rotated.shape == k_rotated.shape == (LAYERS, 2, tokens.shape[0], 8)
    close(cache["layer_norm"], out.hidden)
    assert not any(name.endswith(":in") for name in cache)


@pytest.fixture(scope="module")
def esm2_twin_values(esm2):
    """The twin's residual stream, its logits with that scaled by 0.5, and the squared
    logits' sum and gradient there: computed once, for the eager and the jitted runs."""
    plain, _, tokens = esm2
    _, mids = esm2_twin(plain, tokens)
    halved = esm2_twin(plain, tokens, scale=0.5)[0]
    probes = jnp.zeros(mids.shape, jnp.float32)
    expected, grads = jax.jit(
        jax.value_and_grad(lambda p: jnp.sum(esm2_twin(plain, tokens, probes=p)[0] ** 2))
    )(probes)
    return mids, halved, expected, grads


def test_esm2_residual_stream_cached_patched_and_differentiated(esm2, esm2_twin_values, maybe_jit):
    _, model, tokens = esm2
    mids, halved, expected, grads = esm2_twin_values
    out = maybe_jit(
        lambda t: jhooks.run_with_hooks(model, t, fwd_hooks=[(RESID_MID, lambda v, n: v * 0.5)])
    )(tokens)
    close(out.logits, halved)

    def loss(t):
        return jnp.sum(model(t).logits ** 2)

    value, cache = maybe_jit(
        lambda t: jhooks.run_with_cache(loss, t, names_filter=RESID_MID, incl_bwd=True)
    )(tokens)
    close(value, expected, rtol=1e-4)
    close(cache[RESID_MID], mids)
    close(cache[RESID_MID + "_grad"], grads, rtol=1e-4)


# equimo's VisionTransformer: blocks whose two layer scales are one `Identity` object
# (`self.ls1 = self.ls2 = eqx.nn.Identity()`), attention mapped over heads by a vmap
# of equimo's own.


@pytest.fixture(scope="module")
def vit():
    plain = VisionTransformer(
        img_size=8,
        in_channels=3,
        dim=16,
        patch_size=4,
        num_heads=2,
        depths=[2],
        num_classes=5,
        key=jax.random.PRNGKey(1),
    )
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 8, 8)).astype(np.float32))
    return plain, jhooks.hookable(plain), x


def test_equimo_vit_cache_with_no_filter(vit, maybe_jit):
    plain, model, x = vit
    out, cache = maybe_jit(lambda x: jhooks.run_with_cache(lambda x: model(x, inference=True), x))(
        x
    )
    close(out, plain(x, inference=True))
    # The second block by hand, from the first block's output.
    block, name = plain.blocks[0].blocks[1], "blocks.0.blocks.1"
    x0 = cache["blocks.0.blocks.0"]
    attn = block.attn(jax.vmap(block.prenorm)(x0), inference=True, key=jax.random.PRNGKey(0))
    close(cache[name + ".attn"], attn)
    # The shared layer scale: `ls1` (its first call, the attention branch), `ls1:1`.
    close(cache[name + ".ls1"], jax.vmap(block.postnorm)(attn))
    resid_mid = x0 + cache[name + ".ls1"]
    close(cache[name + ".drop_path1"], resid_mid)
    mlp = block.mlp(jax.vmap(block.norm)(resid_mid), inference=True, key=jax.random.PRNGKey(0))
    close(cache[name + ".ls1:1"], mlp)
    close(cache[name], resid_mid + mlp)
    # The attention pattern (the output of its dropout), all heads: (heads, q, k).
    pattern = cache[name + ".attn.attn_drop"]
    assert pattern.shape == (2, 9, 9)
    close(jnp.sum(pattern, axis=-1), jnp.ones((2, 9), jnp.float32))


# mamba2-jax's Mamba2Model, a Flax NNX model: its blocks return (hidden, conv_state,
# ssm_state); the residual stream between two blocks enters the second block's norm.


def mamba2():
    cfg = Mamba2Config(
        vocab_size=16,
        hidden_size=16,
        state_size=8,
        head_dim=8,
        chunk_size=4,
        num_hidden_layers=2,
    )
    return Mamba2Model(cfg, rngs=nnx.Rngs(0))  # the same parameters on every call


def mamba2_twin(plain, ids, scale=1.0, probe=0.0):
    """The second block written out by hand, from the first block's output: where that
    enters the block's norm, scaled by `scale`, plus `probe`."""
    h0 = plain.layers[0](plain.embedder(ids))[0]
    block = plain.layers[1]
    out = block.mixer(block.norm((h0 * scale + probe).astype(jnp.float32)))[0]
    return plain.final_norm(h0 + out), h0


MAMBA2_IDS = jnp.asarray([[1, 5, 3, 7, 2, 9, 4, 4]], jnp.int32)


@pytest.fixture(scope="module")
def mamba2_twin_values():
    """The plain model's and the twin's values, computed once for the eager and the jitted
    runs: the plain output, the first block's output (by the twin and by the model), the
    twin's output with it scaled by 0.5, and its squared sum and gradient there."""
    plain, ids = mamba2(), MAMBA2_IDS
    twin = jax.jit(lambda scale, probe: mamba2_twin(plain, ids, scale, probe))
    _, h0 = twin(1.0, 0.0)
    hidden = plain(ids, output_hidden_states=True)
    twin_value, grad = jax.value_and_grad(lambda p: jnp.sum(twin(1.0, p)[0] ** 2))(
        jnp.zeros(h0.shape, jnp.float32)
    )
    return {
        "out": hidden["last_hidden_state"],
        "h0": h0,
        "first_block": hidden["hidden_states"][0],
        "halved": twin(0.5, 0.0)[0],
        "twin_value": twin_value,
        "grad": grad,
    }


def test_mamba2_residual_stream_cached_patched_and_differentiated(mamba2_twin_values, maybe_jit):
    model, ids, want = jhooks.hookable(mamba2()), MAMBA2_IDS, mamba2_twin_values
    name = "layers.1.norm:in"

    out, cache = maybe_jit(lambda ids: jhooks.run_with_cache(model, ids))(ids)
    close(out["last_hidden_state"], want["out"])
    assert "layers.1" in cache and not any(n.endswith(":in") for n in cache)

    close(want["h0"], want["first_block"])
    out = maybe_jit(
        lambda ids: jhooks.run_with_hooks(model, ids, fwd_hooks=[(name, lambda v, n: v * 0.5)])
    )(ids)
    close(out["last_hidden_state"], want["halved"])

    def loss(ids):
        return jnp.sum(model(ids)["last_hidden_state"] ** 2)

    value, cache = maybe_jit(
        lambda ids: jhooks.run_with_cache(loss, ids, names_filter=name, incl_bwd=True)
    )(ids)
    close(value, want["twin_value"], rtol=1e-4)
    close(cache[name], want["h0"])
    close(cache[name + "_grad"], want["grad"], rtol=1e-4)

"""Models published by other people (esm2quinox's ESM2 and equimo's ViT in Equinox,
mamba2-jax in Flax NNX), installed from the package index and used unmodified (tiny
random-initialised configurations): `run_with_cache` with no filter works, and values
inside them are cached, patched under the framework's jit (`eqx.filter_jit`, `nnx.jit`)
and differentiated, equal to a hand-annotated twin of the model's code:

- the attention pattern by operation address (`layers.attn/softmax`), or the SSM's inner
  values (`layers.1.mixer/broadcast_to`: its B matrix);
- the per-head outputs, where the heads meet the output projection (`attn.proj:in`);
- the residual stream between attention and MLP (`layers/add`, `layers.layer_norm2:in`).

The ViT's twin is the published code with hook points written in: the same program, so
the values are bitwise equal.
"""

import dataclasses
import math

import equinox as eqx
import esm2quinox
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from einops import rearrange
from equimo.layers.attention import Attention, AttentionBlock
from equimo.models.vit import VisionTransformer
from flax import nnx
from mamba2_jax.modeling import Mamba2Config, Mamba2Model, ssd_forward

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


def esm2_annotated(model, tokens, edit):
    """esm2quinox's forward pass with its attention written out by hand too, and
    `edit(site, layer, value)` applied to the attention pattern (`"pattern"`, `(heads, q,
    k)`), the per-head outputs (`"z"`, `(length, heads * head size)`) and the residual
    stream after attention (`"resid_mid"`): a twin with a hook point at each."""
    x = jax.vmap(model.embedding)(tokens)
    is_pad = tokens == 1
    x = jnp.where(jnp.logical_not(is_pad)[:, None], x, 0)
    dynamic, static = eqx.partition(model.layers, eqx.is_array)
    mask = jnp.broadcast_to(jnp.logical_not(is_pad), (x.shape[0], x.shape[0]))
    for i in range(model.num_layers):
        layer = eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static)
        attn, rotate = layer.attn, jax.vmap(layer.rotary_embed, in_axes=1, out_axes=1)
        y = jax.vmap(layer.layer_norm1)(x)
        q, k, v = (
            jax.vmap(proj)(y).reshape(y.shape[0], attn.num_heads, -1)
            for proj in (attn.query_proj, attn.key_proj, attn.value_proj)
        )
        q, k = rotate(q), rotate(k)
        scores = jnp.einsum("shd,Shd->hsS", q / math.sqrt(q.shape[-1]), k)
        pattern = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min))
        pattern = edit("pattern", i, pattern)
        z = jnp.einsum("hsS,Shd->shd", pattern, v).reshape(y.shape[0], -1)
        x = edit("resid_mid", i, x + jax.vmap(attn.output_proj)(edit("z", i, z)))
        y = jax.vmap(layer.linear1)(jax.vmap(layer.layer_norm2)(x))
        x = x + jax.vmap(layer.linear2)(jax.nn.gelu(y, approximate=False))
    return jax.vmap(model.logit_head)(jax.vmap(model.layer_norm)(x))


ESM2_SITES = {  # the twin's site: the address, and the module input, in the published model
    "pattern": "layers.attn/softmax",
    "z": "layers.attn.output_proj:in",
    "resid_mid": "layers/add",
}


@pytest.fixture(params=[False, True], ids=["eager", "filter_jit"])
def eqx_jit(request):
    """Runs a test body both without and with Equinox's `jit`."""
    return eqx.filter_jit if request.param else (lambda f: f)


def esm2_patch(site, value):
    """Head 1's pattern zeroed, head 0's output zeroed, the residual stream halved."""
    if site == "pattern":
        return value.at[1].set(0.0)
    if site == "z":
        return value.at[:, :8].set(0.0)
    return value * 0.5


def test_esm2_pattern_heads_and_residual_by_address(esm2, eqx_jit):
    """Cached, patched and differentiated at the three addresses at once, equal to the
    twin with the attention written out by hand."""
    plain, model, tokens = esm2
    names = list(ESM2_SITES.values())
    hooks = [(name, lambda v, n, s=site: esm2_patch(s, v)) for site, name in ESM2_SITES.items()]
    out = eqx_jit(lambda t: jhooks.run_with_hooks(model, t, fwd_hooks=hooks))(tokens)
    expected = eqx.filter_jit(esm2_annotated)(plain, tokens, lambda s, i, v: esm2_patch(s, v))
    close(out.logits, expected)
    plain_logits = plain(tokens).logits
    assert not np.allclose(expected, plain_logits, atol=1e-3)

    value, cache = eqx_jit(
        lambda t: jhooks.run_with_cache(
            lambda t: jnp.sum(model(t).logits ** 2), t, names_filter=names, incl_bwd=True
        )
    )(tokens)

    def twin_loss(probes):
        seen = {site: [] for site in ESM2_SITES}

        def edit(site, layer, v):
            seen[site].append(v)
            return v + probes[site][layer]

        loss = jnp.sum(esm2_annotated(plain, tokens, edit) ** 2)
        return loss, {site: jnp.stack(values) for site, values in seen.items()}

    probes = {site: jnp.zeros(cache[name].shape, jnp.float32) for site, name in ESM2_SITES.items()}
    (expected, values), grads = jax.jit(jax.value_and_grad(twin_loss, has_aux=True))(probes)
    close(expected, jnp.sum(plain_logits**2), rtol=1e-4)  # the twin is the published model
    close(value, expected, rtol=1e-4)
    assert cache["layers.attn/softmax"].shape == (LAYERS, 2, tokens.shape[0], tokens.shape[0])
    for site, name in ESM2_SITES.items():
        close(cache[name], values[site])  # (layers, ...): stacked by the model's scan
        close(cache[name + "_grad"], grads[site], rtol=1e-4)


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


class AnnotatedAttention(Attention):
    """equimo's `Attention.__call__` as published (with no mask and no rotary embedding,
    as the ViT calls it), with hook points on the pattern and the per-head outputs."""

    def __call__(self, x, key, inference=None):
        key1, key2 = jax.random.split(key, 2)
        qkv = jax.vmap(self.qkv)(x)
        qkv = rearrange(qkv, "s (n h d) -> n h s d", n=3, h=self.num_heads, d=self.head_dim)
        q, k, v = qkv
        q = jax.vmap(jax.vmap(self.q_norm))(q)
        k = jax.vmap(jax.vmap(self.k_norm))(k)
        attn = jnp.einsum("hqd,hkd->hqk", q, k) / jnp.sqrt(self.head_dim)
        attn = attn.astype(jnp.float32)
        attn = jax.nn.softmax(attn, axis=-1).astype(x.dtype)
        attn = jhooks.hook_point(attn, "hook_pattern")
        attn = self.attn_drop(attn, inference=inference, key=key1)
        x = jnp.einsum("hqk,hkd->hqd", attn, v)
        x = rearrange(x, "h s d -> s (h d)")
        x = jax.vmap(self.proj)(jhooks.hook_point(x, "hook_z"))
        return self.proj_drop(x, inference=inference, key=key2)


class AnnotatedBlock(AttentionBlock):
    """equimo's `AttentionBlock.__call__` as the ViT calls it, with a hook point on the
    residual stream between attention and MLP."""

    def __call__(self, x, key, rope_sincos=None, inference=None, mask=None):
        assert rope_sincos is None and mask is None  # as the ViT calls it
        key_attn, key_mlp, key_dr1, key_dr2 = jax.random.split(key, 4)
        y = self.attn(jax.vmap(self.prenorm)(x), inference=inference, key=key_attn)
        x = self.drop_path1(
            x, self.ls1(jax.vmap(self.postnorm)(y)), inference=inference, key=key_dr1
        )
        x = jhooks.hook_point(x, "hook_resid_mid")
        y = self.mlp(jax.vmap(self.norm)(x), inference=inference, key=key_mlp)
        return self.drop_path2(x, self.ls2(y), inference=inference, key=key_dr2)


def as_class(module, cls):
    """`module` with the class `cls` (a subclass adding no field): the same weights."""
    new = object.__new__(cls)
    for field in dataclasses.fields(module):
        object.__setattr__(new, field.name, getattr(module, field.name))
    return new


VIT_SITES = {  # the address (or module input) in the published ViT, and the twin's point
    "blocks.0.blocks.1.attn/softmax": "blocks.0.blocks.1.attn.hook_pattern",
    "blocks.0.blocks.1.attn.proj:in": "blocks.0.blocks.1.attn.hook_z",
    "blocks.0.blocks.1.drop_path1/add": "blocks.0.blocks.1.hook_resid_mid",
}


def vit_patch(value, name):
    """Head 1's pattern zeroed, head 0's output zeroed, the residual stream halved."""
    if name.endswith(("/softmax", "hook_pattern")):
        return value.at[1].set(0.0)
    if name.endswith(("proj:in", "hook_z")):
        return value.at[:, :8].set(0.0)
    return value * 0.5


def test_equimo_vit_pattern_heads_and_residual_by_address(vit, eqx_jit):
    """Cached, patched and differentiated at the three addresses at once, bitwise equal to
    the published code with hook points written in (the same program)."""
    plain, model, x = vit
    block = plain.blocks[0].blocks[1]
    block = as_class(
        eqx.tree_at(lambda b: b.attn, block, as_class(block.attn, AnnotatedAttention)),
        AnnotatedBlock,
    )
    twin = jhooks.hookable(eqx.tree_at(lambda m: m.blocks[0].blocks[1], plain, block))

    def loss(m, x):
        return jnp.sum(m(x, inference=True) ** 2)

    def run(m, x, names):
        out = jhooks.run_with_hooks(
            lambda x: m(x, inference=True), x, fwd_hooks=[(n, vit_patch) for n in names]
        )
        value, cache = jhooks.run_with_cache(loss, m, x, names_filter=names, incl_bwd=True)
        return out, value, cache

    out, value, cache = eqx_jit(run)(model, x, list(VIT_SITES))
    t_out, t_value, t_cache = eqx.filter_jit(run)(twin, x, list(VIT_SITES.values()))
    np.testing.assert_array_equal(out, t_out)
    assert not np.allclose(out, plain(x, inference=True), atol=1e-3)
    np.testing.assert_array_equal(value, t_value)
    for name, point in VIT_SITES.items():
        for suffix in ("", "_grad"):
            np.testing.assert_array_equal(cache[name + suffix], t_cache[point + suffix])
    assert cache["blocks.0.blocks.1.attn/softmax"].shape == (2, 9, 9)


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


def mixer_annotated(mixer, hidden, edit):
    """mamba2-jax's `Mamba2Mixer.__call__` as published (no cached state), with
    `edit(site, value)` applied to the SSM's input and output matrices (`"B"`, `"C"`:
    `(batch, length, heads, state)`) and to its per-head outputs (`"y"`: `(batch, length,
    heads * head size)`): a twin with a hook point at each."""
    b, length, _ = hidden.shape
    zxbcdt = mixer.in_proj(hidden)
    inner, state = mixer.intermediate_size, mixer.ssm_state_size
    d_mlp = (zxbcdt.shape[-1] - 2 * inner - 2 * state - mixer.num_heads) // 2
    cuts = [d_mlp, 2 * d_mlp, 2 * d_mlp + inner, 2 * d_mlp + 2 * inner + 2 * state]
    z0, x0, z, xbc, dt = jnp.split(zxbcdt, cuts, axis=-1)
    xbc = mixer.act(mixer.conv1d(xbc, conv_state=None)[0])
    x, b_t, c_t = jnp.split(xbc, [inner, inner + state], axis=-1)
    a = -jnp.exp(mixer.A_log[:].astype(jnp.float32))
    shape = (b, length, mixer.num_heads, state)
    y, _ = ssd_forward(
        x=x.reshape(b, length, -1, mixer.head_dim),
        dt=dt,
        A=a,
        B_mat=edit("B", jnp.broadcast_to(jnp.expand_dims(b_t, 2), shape)),
        C_mat=edit("C", jnp.broadcast_to(jnp.expand_dims(c_t, 2), shape)),
        chunk_size=mixer.chunk_size,
        D=mixer.D[:],
        dt_bias=mixer.dt_bias[:],
        dt_min=mixer.dt_min,
        dt_max=mixer.dt_max,
        initial_states=None,
        return_final_states=True,
    )
    y = mixer.norm(edit("y", y.reshape(b, length, -1)), residual=z)
    if d_mlp > 0:
        y = jnp.concatenate([mixer.act(z0) * x0, y], axis=-1)
    return mixer.out_proj(y)


MAMBA_SITES = {  # the twin's site: the address (or module input) in the published model
    "B": "layers.1.mixer/broadcast_to",
    "C": "layers.1.mixer/broadcast_to:1",
    "y": "layers.1.mixer.norm:in",
}


def mamba2_patch(site, value):
    """Head 1's B zeroed, C doubled, head 0's output zeroed."""
    if site == "B":
        return value.at[:, :, 1].set(0.0)
    if site == "C":
        return value * 2.0
    return value.at[..., :8].set(0.0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_mamba2_ssm_values_and_heads_by_address(jit):
    """The SSM's B and C and its per-head outputs, cached, patched under `nnx.jit` and
    differentiated, equal to the mixer's code written out with an edit at each."""
    plain, model = mamba2(), jhooks.hookable(mamba2())
    ids = jnp.asarray([[1, 5, 3, 7, 2, 9, 4, 4]], jnp.int32)
    wrap = nnx.jit if jit else (lambda f: f)
    names = list(MAMBA_SITES.values())

    def twin(edit):
        h0 = plain.layers[0](plain.embedder(ids))[0]
        block = plain.layers[1]
        out = mixer_annotated(block.mixer, block.norm(h0.astype(jnp.float32)), edit)
        return plain.final_norm(h0 + out)

    @wrap
    def run(m, ids):
        hooks = [
            (name, lambda v, n, s=site: mamba2_patch(s, v)) for site, name in MAMBA_SITES.items()
        ]
        patched = jhooks.run_with_hooks(m, ids, fwd_hooks=hooks)["last_hidden_state"]
        value, cache = jhooks.run_with_cache(
            lambda ids: jnp.sum(m(ids)["last_hidden_state"] ** 2),
            ids,
            names_filter=names,
            incl_bwd=True,
        )
        return patched, value, cache

    patched, value, cache = run(model, ids)
    plain_out = plain(ids)["last_hidden_state"]
    close(patched, jax.jit(lambda: twin(mamba2_patch))())
    assert not np.allclose(patched, plain_out, atol=1e-3)

    def twin_loss(probes):
        seen = {}

        def edit(site, v):
            seen[site] = v
            return v + probes[site]

        return jnp.sum(twin(edit) ** 2), seen

    probes = {site: jnp.zeros(cache[name].shape, jnp.float32) for site, name in MAMBA_SITES.items()}
    (twin_value, values), grads = jax.jit(jax.value_and_grad(twin_loss, has_aux=True))(probes)
    close(twin_value, jnp.sum(plain_out**2), rtol=1e-4)  # the twin is the published model
    close(value, twin_value, rtol=1e-4)
    for site, name in MAMBA_SITES.items():
        close(cache[name], values[site])
        close(cache[name + "_grad"], grads[site], rtol=1e-4)
    batch, length = ids.shape  # B: (batch, length, heads, state size)
    assert cache["layers.1.mixer/broadcast_to"].shape == (batch, length, 4, 8)

"""`jhooks.clipped_grad` on published JAX models (issue 27), tiny random-initialised
configurations: exact against `jax.vmap(grad)` + clipping, with no per-example fallback
(warnings are errors). Jitted only: the eager route runs the same rules
(tests/test_clipping_rules.py runs each rule both ways)."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from clipping_reference import assert_matches, nnx_reference

import jhooks

KEY = jax.random.key(0)


def test_esm2quinox():
    # A scan over layers (eqx.filter_vmap-built), rotary tables a jitted method closes
    # over, the embedding tied to the head's last linear layer.
    import esm2quinox

    model = esm2quinox.ESM2(num_layers=2, embed_size=8, num_heads=2, token_dropout=False, key=KEY)
    ids = jax.random.randint(KEY, (3, 6), 4, 20)

    def loss(m, tokens):  # masked-language-model style: predict every token
        logits = jax.nn.log_softmax(m(tokens).logits)
        return -jnp.mean(jnp.take_along_axis(logits, tokens[:, None], 1))

    assert_matches(loss, model, (ids,), 0.3, eqx.filter_jit, (None, 0))


def test_equimo_vit_with_class_and_register_tokens():
    import equimo.models.vit as vit

    model = vit.VisionTransformer(
        img_size=8, in_channels=3, dim=8, patch_size=4, num_heads=2, depths=[1],
        reg_tokens=2, num_classes=3, key=KEY,
    )  # fmt: skip
    xs = jax.random.normal(KEY, (3, 3, 8, 8))

    def loss(m, x, y):
        return -jax.nn.log_softmax(m(x, inference=True))[y]

    assert_matches(loss, model, (xs, jnp.arange(3) % 3), 0.3, eqx.filter_jit)


def test_mamba2_jax():
    # Flax NNX: A_log through exp, a depthwise convolution, dt_bias, D, the SSD chunks.
    import mamba2_jax.modeling as modeling
    from flax import nnx

    cfg = modeling.Mamba2Config(
        vocab_size=11, hidden_size=8, state_size=4, head_dim=4, chunk_size=4,
        num_hidden_layers=1, expand=2, conv_kernel=2,
    )  # fmt: skip
    model = modeling.Mamba2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    ids = jax.random.randint(KEY, (3, 6), 0, 11)

    def loss(m, tokens):
        logits = jax.nn.log_softmax(m(tokens[None])["logits"][0][:-1])
        return -jnp.mean(jnp.take_along_axis(logits, tokens[1:, None], 1))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads, norms = eqx.filter_jit(jhooks.clipped_grad(loss, 0.3))(model, ids)
    per, ref_norms = nnx_reference(loss, model, ids)
    leaves = jax.tree.leaves(per)
    w = jnp.minimum(1.0, 0.3 / ref_norms)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    got = jax.tree.leaves(grads)
    assert len(got) == len(leaves)
    for g, p in zip(got, leaves):
        want = jnp.tensordot(w, p, 1)
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))

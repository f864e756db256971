"""TransformerLens' names on the published LLM families (`jhooks.transformer_lens_names`).

tunix's Llama 3, Qwen 3 and Gemma 3 (google-tunix 0.1.7, Flax NNX), unmodified, in tiny
random-initialised configurations: every name of the family's map is cached, under its
TransformerLens name and layout, equal to the model's own submodules called in order by
hand with the attention written out (RoPE by tunix's own `apply_rope`, the heads of a
group sharing their key and value, the mask, the softmax); patching one head's
`hook_z` equals the hand-edited twin; attribution by names equals AtP computed by hand.
Eager and under `nnx.jit`.

The models are built by `tunix_models.py` (tunix's model modules imported without its
trainers, tiny configurations, random weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tunix_models import (
    FAMILIES,
    WINDOW,
    build,
    standard_promotion,  # noqa: F401  (autouse)
)

import jhooks

# tunix 0.1.7's own code uses what JAX 0.8.2 and Flax 0.12 deprecate (the mesh of
# `pxla.thread_resources`, a parameter's `.value`): the warnings its lines raise.
pytestmark = pytest.mark.filterwarnings(r"ignore::DeprecationWarning:tunix\.")

B, T = 2, 5


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    tunix, model = build(request.param)
    return request.param, tunix, model


def _inputs(seed: int = 0) -> tuple:
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (B, T), 0, 32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    return tokens, positions, None, mask


def close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# The hand computation: the model's own submodules called in order, the attention
# written out, every value in TransformerLens' layout, under its TransformerLens name.


def _same(x):
    return x


def _attention(family, tunix, attn, h, positions, mask, edit):
    """tunix's attention written out: (values by TransformerLens name, output);
    `edit(name, value)` edits the scores, the pattern or z."""
    if family == "gemma3":
        q = attn.q_einsum(h)
        k, v = attn.kv_einsum(h)
        normed_q, normed_k = attn._query_norm(q), attn._key_norm(k)
        rope = dict(base_frequency=attn.rope_base_frequency, scale_factor=attn.rope_scale_factor)
        # Gemma 3's local layers: a sliding window over the mask.
        t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        mask = mask & (jnp.abs(t - s) < WINDOW)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        normed_q, normed_k = (attn.q_norm(q), attn.k_norm(k)) if family == "qwen3" else (q, k)
        rope = {}
    d = q.shape[-1]
    rot_q = tunix.apply_rope(normed_q, positions, head_dim=d, **rope)
    rot_k = tunix.apply_rope(normed_k, positions, head_dim=d, **rope)
    group = q.shape[2] // k.shape[2]  # query heads per key head
    keys, values = jnp.repeat(rot_k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("btnd,bsnd->bnts", rot_q, keys) * d**-0.5
    scores = edit("hook_attn_scores", jnp.where(mask[:, None], scores, tunix.K_MASK))
    pattern = edit("hook_pattern", jax.nn.softmax(scores, axis=-1))
    z = edit("hook_z", jnp.einsum("bnts,bsnd->btnd", pattern, values))
    out = (attn.attn_vec_einsum if family == "gemma3" else attn.o_proj)(z)
    names = dict(
        hook_q=q, hook_k=k, hook_v=v, hook_rot_q=rot_q, hook_rot_k=rot_k,
        hook_attn_scores=scores, hook_pattern=pattern, hook_z=z,
    )  # fmt: skip
    return names, out


def by_hand(family, tunix, model, tokens, positions, cache, mask, edits=None):
    """(logits, values by TransformerLens name); `edits` maps a name (of z, the scores,
    the pattern or the residual stream after a block) to a function that edits it."""
    edits = edits or {}
    gemma = family == "gemma3"
    x = model.embedder.encode(tokens)
    got = {"hook_embed": x}
    for i, layer in enumerate(model.layers):
        at = f"blocks.{i}."
        got[at + "hook_resid_pre"] = x
        ln1, ln2 = (
            (layer.pre_attention_norm, layer.pre_ffw_norm)
            if gemma
            else (layer.input_layernorm, layer.post_attention_layernorm)
        )
        h = ln1(x)

        def edit(name, value, at=at):
            return edits.get(at + "attn." + name, _same)(value)

        names, a = _attention(family, tunix, layer.attn, h, positions, mask, edit)
        got.update({at + "attn." + n: v for n, v in names.items()})
        a = layer.post_attention_norm(a) if gemma else a
        x = x + a
        h2 = ln2(x)
        pre, pre_linear = layer.mlp.gate_proj(h2), layer.mlp.up_proj(h2)
        post = (nnx.gelu(pre) if gemma else nnx.silu(pre)) * pre_linear
        m = layer.mlp.down_proj(post)
        m = layer.post_ffw_norm(m) if gemma else m
        got.update({
            at + "ln1.hook_normalized": h, at + "hook_attn_out": a, at + "hook_resid_mid": x,
            at + "ln2.hook_normalized": h2, at + "mlp.hook_pre": pre,
            at + "mlp.hook_pre_linear": pre_linear, at + "mlp.hook_post": post,
            at + "hook_mlp_out": m,
        })  # fmt: skip
        x = edits.get(at + "hook_resid_post", _same)(x + m)
        got[at + "hook_resid_post"] = x
    x = model.final_norm(x)
    got["ln_final.hook_normalized"] = x
    logits = model.embedder.decode(x) if gemma else model.lm_head(x)
    return logits, got


_PLAIN: dict = {}  # family -> the compiled hand computation without edits
_ORACLES: dict = {}  # (test, family) -> what the hand computation gave: the same for eager and jit


def oracle(test: str, family: str, compute):
    """`compute()`, once per test and family (its eager and jitted runs share it)."""
    if (test, family) not in _ORACLES:
        _ORACLES[test, family] = compute()
    return _ORACLES[test, family]


def hand(family, tunix, model, inputs, edits=None):
    """`by_hand` compiled (`nnx.jit`): the same computation, in a fraction of the time
    that it takes op by op."""

    def run(model, tokens, positions, mask):
        return by_hand(family, tunix, model, tokens, positions, None, mask, edits)

    if edits is None:
        run = _PLAIN.setdefault(family, nnx.jit(run))
    else:
        run = nnx.jit(run)
    return run(model, inputs[0], inputs[1], inputs[3])


def hand_grads(family, tunix, model, inputs, metric, like):
    """The gradients of `metric` of the logits with respect to the values named in
    `like` (a zero added to each in the hand computation: every path stays)."""

    @nnx.jit
    def run(model, tokens, positions, mask, zeros):
        def of(added):
            edits = {name: (lambda x, d=d: x + d) for name, d in added.items()}
            logits, _ = by_hand(family, tunix, model, tokens, positions, None, mask, edits)
            return metric((logits, None))

        return jax.grad(of)(zeros)

    zeros = {name: jnp.zeros_like(value) for name, value in like.items()}
    return run(model, inputs[0], inputs[1], inputs[3], zeros)


def _wrap(jit):
    return nnx.jit if jit else (lambda f: f)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_every_name_is_cached_in_its_layout(family, jit):
    name, tunix, model = family
    tl = jhooks.transformer_lens_names(name)
    inputs = _inputs()
    expected_logits, expected = hand(name, tunix, model, inputs)

    @_wrap(jit)
    def cached(model, tokens, positions, mask):
        return tl.run_with_cache(model, tokens, positions, None, mask)

    (logits, _), cache = cached(model, inputs[0], inputs[1], inputs[3])
    assert sorted(cache) == sorted(expected)  # every name of the map, each layer
    close(logits, expected_logits)
    for key, value in expected.items():
        assert cache[key].shape == value.shape, key
        close(cache[key], value)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_patching_one_head_of_hook_z_equals_the_hand_edited_twin(family, jit):
    name, tunix, model = family
    tl = jhooks.transformer_lens_names(name)
    inputs = _inputs(seed=1)
    head = 2

    def zero_head(z):
        return z.at[:, :, head].set(0.0)

    seen = []

    def hook(z, hook):
        seen.append((hook.name, hook.layer(), z.shape))
        return zero_head(z)

    @_wrap(jit)
    def patched(model, tokens, positions, mask):
        return tl.run_with_hooks(
            model, tokens, positions, None, mask, fwd_hooks=[("blocks.1.attn.hook_z", hook)]
        )

    logits, _ = patched(model, inputs[0], inputs[1], inputs[3])
    twin, _ = oracle(
        "head", name, lambda: hand(name, tunix, model, inputs, {"blocks.1.attn.hook_z": zero_head})
    )
    plain, _ = hand(name, tunix, model, inputs)
    close(logits, twin)
    assert not np.allclose(np.asarray(twin), np.asarray(plain), atol=1e-3)  # it did change
    assert seen[0] == ("blocks.1.attn.hook_z", 1, (B, T, 4, 8))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_patching_through_a_layout_writes_back(family, jit):
    """A name whose value the model holds in another layout (Gemma's scores
    `(batch, query, head, key)`, Qwen's grouped `(batch, kv_head, group, query, key)`,
    Gemma's keys inside the stacked `kv_einsum` output, a module's `(cache, x)` output):
    the hook sees TransformerLens' layout, what it returns is put back in place."""
    name, tunix, model = family
    tl = jhooks.transformer_lens_names(name)
    inputs = _inputs(seed=2)
    head, query = 1, 3

    def uniform_row(pattern, hook):
        assert pattern.shape == (B, 4, T, T)  # (batch, head, query, key)
        return pattern.at[:, head, query].set(1.0 / T)

    def half_resid(x, hook):
        return 0.5 * x

    def hooked(model, tokens, positions, mask):
        return tl.run_with_hooks(
            model,
            tokens,
            positions,
            None,
            mask,
            fwd_hooks=[
                ("blocks.0.attn.hook_pattern", uniform_row),
                ("blocks.0.hook_resid_post", half_resid),
            ],
        )

    logits, _ = _wrap(jit)(hooked)(model, inputs[0], inputs[1], inputs[3])
    edits = {
        "blocks.0.attn.hook_pattern": lambda p: p.at[:, head, query].set(1.0 / T),
        "blocks.0.hook_resid_post": lambda x: 0.5 * x,
    }
    twin, _ = oracle("layout", name, lambda: hand(name, tunix, model, inputs, edits))
    plain, _ = hand(name, tunix, model, inputs)
    close(logits, twin)
    assert not np.allclose(np.asarray(twin), np.asarray(plain), atol=1e-3)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_attribution_by_names_equals_atp_by_hand(family, jit):
    """AtP of `hook_z` and `hook_attn_scores` by names: `(clean - corrupt) * dmetric/da`
    at the corrupted run, in TransformerLens' layout, summed over the last axis there."""
    name, tunix, model = family
    tl = jhooks.transformer_lens_names(name)
    clean, corrupt = _inputs(seed=3), _inputs(seed=4)

    def metric(out):
        return out[0][:, -1, 3].sum() - out[0][:, -1, 5].sum()

    nodes = ["blocks.1.attn.hook_z", "blocks.0.attn.hook_attn_scores"]

    @_wrap(jit)
    def scored(model, clean_tokens, corrupt_tokens):
        return tl.attribution(
            metric, lambda t: model(t, clean[1], None, clean[3]), clean_tokens, corrupt_tokens,
            nodes=nodes,
        )  # fmt: skip

    scores = scored(model, clean[0], corrupt[0])
    assert list(scores) == [nodes[1], nodes[0]]  # in the order the points were reached

    # By hand: the corrupted run's values and the metric's gradient with respect to each,
    # through the hand computation with the value put in.
    _, at_clean = hand(name, tunix, model, clean)
    _, at_corrupt = hand(name, tunix, model, corrupt)

    grads = oracle(
        "atp",
        name,
        lambda: hand_grads(name, tunix, model, corrupt, metric, {n: at_corrupt[n] for n in nodes}),
    )
    for key in nodes:
        expected = ((at_clean[key] - at_corrupt[key]) * grads[key]).sum(-1)
        close(scores[key], expected, rtol=1e-4, atol=1e-5)
    assert scores["blocks.1.attn.hook_z"].shape == (B, T, 4)  # (batch, pos, head)
    assert scores["blocks.0.attn.hook_attn_scores"].shape == (B, 4, T)  # (batch, head, query)

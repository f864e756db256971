"""`jhooks.attribution` on the inputs and models researchers bring (issue 37), against
plain-JAX computations of the same scores:

- points holding integers (token ids, positions; a pytree point with one) are left out,
  the floating leaves of a pytree point scored;
- clean and corrupted inputs that give a node two shapes raise, naming the node, both
  shapes and the remedy;
- attention scores masked with `-inf` (TransformerLens' own mask): AtP and integrated
  gradients give finite scores, 0 at the masked entries;
- a name that matches no point is refused as `attribution (nodes)`, `(readers)`...
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

EMBED = jax.random.normal(jax.random.PRNGKey(0), (5, 4))


def embedded(tokens):
    """Token ids and positions marked as points (integers), an embedding, and a pytree
    point holding a float and the token ids."""
    positions = jhooks.hook_point(jnp.arange(tokens.shape[0]), "hook_pos")
    tokens = jhooks.hook_point(tokens, "hook_tokens")
    shifted = 0.1 * positions[:, None].astype(EMBED.dtype)
    e = jhooks.hook_point(EMBED[tokens] + shifted, "hook_embed")
    h, _ = jhooks.hook_point((jnp.tanh(e), tokens), "pair")
    return 2.0 * h


def square(y):
    return jnp.sum(y**2)


CLEAN_TOKENS = jnp.array([0, 1, 2])
CORRUPT_TOKENS = jnp.array([3, 1, 4])


def plain_embed(tokens):
    return EMBED[tokens] + 0.1 * jnp.arange(tokens.shape[0], dtype=EMBED.dtype)[:, None]


def assert_close(actual, expected, tol):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


@pytest.mark.parametrize("method", ["atp", "ig"])
def test_integer_points_are_left_out_and_float_leaves_scored(maybe_jit, method):
    scores = maybe_jit(lambda c, k: jhooks.attribution(square, embedded, c, k, method=method))(
        CLEAN_TOKENS, CORRUPT_TOKENS
    )
    # The integer points have no gradient: no score. The pytree point: its float leaf
    # scored, None for its token ids.
    assert list(scores) == ["hook_embed", "pair"]
    assert scores["pair"][1] is None

    # Plain JAX: the metric as a function of the embedding, and of the pair's float.
    e_clean, e_corrupt = plain_embed(CLEAN_TOKENS), plain_embed(CORRUPT_TOKENS)

    def of_embed(e):
        return square(2.0 * jnp.tanh(e))

    def of_h(h):
        return square(2.0 * h)

    def expected(f, clean, corrupt):
        delta = clean - corrupt
        if method == "atp":
            grad = jax.grad(f)(corrupt)
        else:  # the default rule: alpha = k / 5, k = 0..4 (riemann_left)
            grad = sum(jax.grad(f)(corrupt + (k / 5) * delta) for k in range(5)) / 5
        return jnp.sum(delta * grad, axis=-1)

    assert_close(scores["hook_embed"], expected(of_embed, e_clean, e_corrupt), 1e-5)
    h_clean, h_corrupt = jnp.tanh(e_clean), jnp.tanh(e_corrupt)
    assert_close(scores["pair"][0], expected(of_h, h_clean, h_corrupt), 1e-5)
    assert float(jnp.max(jnp.abs(scores["pair"][0]))) > 0.1
    # Naming the pair alone scores it the same way.
    alone = jhooks.attribution(
        square, embedded, CLEAN_TOKENS, CORRUPT_TOKENS, nodes="pair", method=method
    )
    assert_close(alone["pair"][0], scores["pair"][0], 1e-6)
    # An integer point named alone: nothing to score.
    named = jhooks.attribution(square, embedded, CLEAN_TOKENS, CORRUPT_TOKENS, nodes="hook_pos")
    assert named == {}


@pytest.mark.parametrize(
    "options",
    [dict(), dict(method="ig", steps=2), dict(edges=True, writers="hook_embed", readers="pair")],
    ids=["atp", "ig", "eap"],
)
def test_inputs_of_different_lengths_raise_naming_the_node(maybe_jit, options):
    short = jnp.array([3, 1])
    with pytest.raises(
        ValueError,
        match=r"node 'hook_embed' is \(3, 4\) in the clean run and \(2, 4\) in the corrupted "
        r"run.*pad the shorter prompt",
    ):
        maybe_jit(lambda c, k: jhooks.attribution(square, embedded, c, k, **options))(
            CLEAN_TOKENS, short
        )


# One attention layer shaped as TransformerLens' (hook names, [position, head, d_head]
# queries and keys, [head, query, key] scores), causally masked with -inf as
# TransformerLens masks: jnp.where(mask, scores, -jnp.inf).
HEADS, POSITIONS, D = 2, 5, 4
ATTN_KEYS = jax.random.split(jax.random.PRNGKey(11), 4)
W_Q, W_K, W_V = (jax.random.normal(k, (HEADS, D, D)) for k in ATTN_KEYS[:3])
W_OUT = jax.random.normal(ATTN_KEYS[3], (POSITIONS, HEADS, D))
MASK = jnp.tril(jnp.ones((POSITIONS, POSITIONS), bool))
X_CLEAN = jax.random.normal(jax.random.PRNGKey(12), (POSITIONS, D))
X_CORRUPT = jax.random.normal(jax.random.PRNGKey(13), (POSITIONS, D))


def attention(x):
    q = jhooks.hook_point(jnp.einsum("pd,hde->phe", x, W_Q), "blocks.0.attn.hook_q")
    k = jhooks.hook_point(jnp.einsum("pd,hde->phe", x, W_K), "blocks.0.attn.hook_k")
    v = jnp.einsum("pd,hde->phe", x, W_V)
    scores = jnp.einsum("qhe,khe->hqk", q, k) / math.sqrt(D)
    scores = jhooks.hook_point(jnp.where(MASK, scores, -jnp.inf), "blocks.0.attn.hook_attn_scores")
    pattern = jhooks.hook_point(jax.nn.softmax(scores, axis=-1), "blocks.0.attn.hook_pattern")
    return jnp.einsum("hqk,khe->qhe", pattern, v)


def readout(z):
    return jnp.sum(z * W_OUT)


@pytest.mark.parametrize("method", ["atp", "ig"])
def test_minus_inf_masks_score_zero_and_the_rest_as_plain_jax(maybe_jit, method):
    name = "blocks.0.attn.hook_attn_scores"

    def run(sum_axes):
        return maybe_jit(
            lambda c, k: jhooks.attribution(
                readout, attention, c, k, nodes=name, method=method, sum_axes=sum_axes
            )[name]
        )(X_CLEAN, X_CORRUPT)

    scores = run(())
    assert scores.shape == (HEADS, POSITIONS, POSITIONS)
    assert np.all(np.isfinite(scores))
    assert np.all(np.asarray(scores)[:, ~np.asarray(MASK)] == 0.0)  # masked: 0

    # Plain JAX: the readout as a function of the scores (the values of the corrupted
    # run), the difference taken where the mask lets the score through.
    def values_and_scores(x):
        q, k = (jnp.einsum("pd,hde->phe", x, w) for w in (W_Q, W_K))
        s = jnp.where(MASK, jnp.einsum("qhe,khe->hqk", q, k) / math.sqrt(D), -jnp.inf)
        return jnp.einsum("pd,hde->phe", x, W_V), s

    v, s_corrupt = values_and_scores(X_CORRUPT)
    s_clean = values_and_scores(X_CLEAN)[1]

    def of_scores(s):
        return readout(jnp.einsum("hqk,khe->qhe", jax.nn.softmax(s, axis=-1), v))

    delta = jnp.where(MASK, s_clean - s_corrupt, 0.0)
    if method == "atp":
        grad = jax.grad(of_scores)(s_corrupt)
    else:  # riemann_left, 5 steps
        grad = sum(jax.grad(of_scores)(s_corrupt + (k / 5) * delta) for k in range(5)) / 5
    expected = jnp.where(MASK, delta * grad, 0.0)
    assert_close(scores, expected, 1e-5)
    assert float(jnp.max(jnp.abs(expected))) > 0.05
    # Summed over the keys (the default), every row finite too.
    assert_close(run((-1,)), jnp.sum(expected, axis=-1), 1e-5)


def test_name_errors_say_the_option_of_attribution(maybe_jit):
    def refused(match, **options):
        with pytest.raises(ValueError, match=match):
            maybe_jit(lambda c, k: jhooks.attribution(square, embedded, c, k, **options))(
                CLEAN_TOKENS, CORRUPT_TOKENS
            )

    refused(
        r"^attribution \(nodes\): no hook point named 'hook_embd'\. Did you mean",
        nodes=["hook_embd"],
    )
    refused(r"^attribution \(nodes\): no hook point named 'blocks\.\*'", nodes="blocks.*")
    refused(
        r"^attribution \(readers\): no hook point named 'pairs'",
        edges=True, writers="hook_embed", readers=["pairs"],
    )  # fmt: skip
    refused(
        r"^attribution \(writers\): no hook point named 'embed'",
        edges=True, writers="embed", readers=["pair"],
    )  # fmt: skip
    refused(
        r"^attribution \(interpolate\): no hook point named 'embed'",
        nodes="pair", method="ig", interpolate="embed",
    )  # fmt: skip
    refused(
        r"^attribution \(graddrop\): no hook point named 'layer'",
        nodes="pair", graddrop=["hook_embed", "layer"],
    )  # fmt: skip
    refused(r"^attribution \(nodes\): no operation at address '/nope'", nodes="/nope")

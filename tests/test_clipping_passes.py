"""`clipped_grad(..., passes=)`: its two routes, forced, are each exact everywhere.

`passes=1` keeps every site's activations and output gradients (under a checkpoint too);
`passes=2` computes the norms in the backward pass and the clipped sum in a second one
(without a checkpoint too). Each is checked against `jax.vmap(eqx.filter_grad)` + clipping,
and the compiled memory tells which route ran, so that a silently ignored `passes` fails.
Every route is run jitted on every model, and eagerly on the GPT with and without a
checkpoint.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clipping_reference import RTOL, assert_close, reference
from test_clipping import cnn_case, mlp_case, transformer_case
from test_clipping_models import (
    KEY,
    Scaled,
    ScanGPT,
    SharedInScan,
    compiled_bytes,
    next_token,
    plain_grad,
    xent,
)

import jhooks


def assert_route_matches(loss, model, batch, max_norm, passes, maybe_jit, in_axes=(None, 0, 0)):
    fn = jhooks.clipped_grad(loss, max_norm, in_axes=in_axes, passes=passes)
    grads, norms = maybe_jit(fn)(model, *batch)
    ref_grads, ref_norms = eqx.filter_jit(reference(loss, max_norm, in_axes))(model, *batch)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
    assert_close(grads, ref_grads)


def gpt(remat: bool, batch: int = 4):
    ids = jax.random.randint(KEY, (batch, 5), 0, 11)
    return ScanGPT(remat=remat), (ids, jnp.zeros(batch))


def checkpointed_pair():
    """A weight with two sites under a checkpoint (a pair of taps with `passes=2`)."""
    k1, k2 = jax.random.split(KEY)
    model = {"emb": eqx.nn.Embedding(7, 4, key=k1), "out": eqx.nn.Linear(4, 2, key=k2)}

    def loss(m, x, y):
        @jax.checkpoint
        def body(x):
            h = jnp.tanh(jax.vmap(m["emb"])(x)) + jax.vmap(m["emb"])(x[::-1])
            return jax.vmap(m["out"])(h)

        return -jnp.mean(jax.nn.log_softmax(body(x))[:, y])

    return loss, model, (jax.random.randint(k1, (6, 5), 0, 7), jnp.arange(6) % 2)


def scaled():
    k1, k2 = jax.random.split(KEY)
    model = Scaled(jax.random.normal(k1, (6, 6)), jax.random.normal(k2, (3, 6)))
    return xent, model, (jax.random.normal(KEY, (7, 6)), jnp.arange(7) % 3)


CASES = {
    "gpt-checkpoint": lambda: (next_token, *gpt(True)),
    "gpt-no-checkpoint": lambda: (next_token, *gpt(False)),
    "checkpointed-pair": checkpointed_pair,
    "shared-in-scan": lambda: (
        xent,
        SharedInScan(),
        (jax.random.normal(KEY, (7, 6)), jnp.arange(7) % 3),
    ),
    "scaled": scaled,
    "mlp": lambda: (xent, *mlp_case()),
    "cnn": lambda: (xent, *cnn_case()),
    "transformer": lambda: (xent, *transformer_case()),
}


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_each_route_is_exact(case, passes):
    loss, model, batch = CASES[case]()
    assert_route_matches(loss, model, batch, 0.05, passes, eqx.filter_jit)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("remat", [True, False], ids=["checkpoint", "no-checkpoint"])
def test_each_route_eagerly_and_unclipped(remat, passes):
    # Jitted, each route is checked above; eagerly, nothing is dropped by XLA.
    assert_route_matches(next_token, *gpt(remat), 1e3, passes, lambda f: f)


def test_each_route_with_padding_and_automatic_clipping():
    model, batch = gpt(True, 6)
    padding = jnp.array([False, True, False, False, True, False])
    automatic = lambda n, c: c / (n + 0.01)  # noqa: E731
    ref_grads, ref_norms = eqx.filter_jit(
        reference(next_token, 0.1, weigh=automatic, padding=padding)
    )(model, *batch)
    for passes in (1, 2):
        fn = jhooks.clipped_grad(next_token, 0.1, clipping="automatic", passes=passes)
        grads, norms = eqx.filter_jit(fn)(model, *batch, is_padding_example=padding)
        np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
        assert_close(grads, ref_grads)


def test_the_routes_trade_memory():
    # Under a checkpoint the default is two passes: the memory of the plain gradient (1.22x
    # here, the tied output layer's output gradient being the rest); `passes=1` keeps every
    # site's activations and output gradients for the batch, what the checkpoint saved
    # (2.58x here). Without a checkpoint the default is one pass.
    model = ScanGPT(vocab=512, d=64, length=16, heads=4, depth=6)
    ids = jax.random.randint(KEY, (32, 16), 0, 512)
    batch = (ids, jnp.zeros(32))
    plain = compiled_bytes(plain_grad(next_token), model, *batch)
    by_passes = {
        p: compiled_bytes(jhooks.clipped_grad(next_token, 1.0, passes=p), model, *batch)
        for p in (None, 1, 2)
    }
    assert by_passes[None] == by_passes[2], by_passes
    assert by_passes[2] <= 1.3 * plain, (by_passes, plain)
    assert by_passes[1] >= 2 * plain, (by_passes, plain)
    flat = ScanGPT(vocab=512, d=64, length=16, heads=4, depth=6, remat=False)
    flat_by_passes = {
        p: compiled_bytes(jhooks.clipped_grad(next_token, 1.0, passes=p), flat, *batch)
        for p in (None, 1, 2)
    }
    assert flat_by_passes[None] == flat_by_passes[1], flat_by_passes
    # Without a checkpoint two passes keep no output gradient, but the forward pass's
    # residuals live through both passes: a little less memory (1.29x against 1.33x here).
    assert flat_by_passes[2] < flat_by_passes[1], flat_by_passes


def test_passes_must_be_1_2_or_none():
    for bad in (0, 3, "two", 2.0):
        with pytest.raises(ValueError, match=r"passes must be 1, 2 or None; got "):
            jhooks.clipped_grad(xent, 1.0, passes=bad)  # type: ignore[arg-type]


def test_two_passes_need_one_group():
    model, batch = gpt(True)

    def group_of(path):
        return "embedding" if path.startswith(".emb") or path == ".pos" else "layers"

    fn = jhooks.clipped_grad(next_token, 1.0, groups=group_of, passes=2)
    with pytest.raises(ValueError, match=r"passes=2 needs one clipping norm .* made 2 groups"):
        fn(model, *batch)
    # One group is one weight per example: two passes serve it (the default under a
    # checkpoint too), and the norms come back as a dict, as with several groups.
    ref_grads, ref_norms = eqx.filter_jit(reference(next_token, 0.05))(model, *batch)
    for passes in (None, 2):
        one = jhooks.clipped_grad(next_token, 0.05, groups=lambda p: "all", passes=passes)
        grads, norms = eqx.filter_jit(one)(model, *batch)
        assert set(norms) == {"all"}
        np.testing.assert_allclose(norms["all"], ref_norms, rtol=RTOL)
        assert_close(grads, ref_grads)

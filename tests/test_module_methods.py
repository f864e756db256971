"""A module used only through other methods (tunix's `embedder.encode` / `.decode`): a
class with no `__call__` has a point per method call, `embedder.encode`; selecting the
module itself says why it has no point, and a module hook on it warns that it never runs.

The oracle is the same computation written with the embedding table by hand.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jhooks

V, D = 10, 4


class Embedder(eqx.Module):
    table: jax.Array

    def encode(self, tokens):
        return self.table[tokens] * jnp.sqrt(jnp.float32(D))

    def decode(self, x):
        return x @ self.table.T


class LM(eqx.Module):
    embedder: Embedder
    lin: eqx.nn.Linear

    def __call__(self, tokens):
        return self.embedder.decode(jnp.tanh(jax.vmap(self.lin)(self.embedder.encode(tokens))))


class NnxEmbedder(nnx.Module):
    def __init__(self, table):
        self.table = nnx.Param(table)

    def encode(self, tokens):
        return self.table[tokens] * jnp.sqrt(jnp.float32(D))

    def decode(self, x):
        return x @ self.table.T


class NnxLM(nnx.Module):
    def __init__(self, table, w):
        self.embedder = NnxEmbedder(table)
        self.w = nnx.Param(w)

    def __call__(self, tokens):
        return self.embedder.decode(jnp.tanh(self.embedder.encode(tokens) @ self.w))


TABLE = jnp.asarray(np.random.default_rng(0).normal(size=(V, D)).astype(np.float32))
TOKENS = jnp.array([1, 7, 3], jnp.int32)


def models():
    lin = eqx.nn.Linear(D, D, use_bias=False, key=jax.random.PRNGKey(1))
    eqx_model = jhooks.hookable(LM(Embedder(TABLE), lin))
    nnx_model = jhooks.hookable(NnxLM(TABLE, lin.weight.T))
    return {"equinox": eqx_model, "nnx": nnx_model}, lin.weight.T


@pytest.mark.parametrize("kind", ["equinox", "nnx"])
def test_a_modules_method_calls_are_points(kind, maybe_jit):
    model, w = models()[0][kind], models()[1]
    encoded = TABLE[TOKENS] * np.sqrt(D)  # by hand
    hidden = jnp.tanh(encoded @ w)

    _, cache = maybe_jit(lambda t: jhooks.run_with_cache(model, t))(TOKENS)
    assert {"embedder.encode", "embedder.decode"} <= set(cache)
    np.testing.assert_allclose(cache["embedder.encode"], encoded, rtol=1e-6)
    np.testing.assert_allclose(cache["embedder.decode"], hidden @ TABLE.T, rtol=1e-5, atol=1e-6)

    def zero_token_1(value, name):
        return value.at[1].set(0.0)

    out = maybe_jit(
        lambda t: jhooks.run_with_hooks(model, t, fwd_hooks=[("embedder.encode", zero_token_1)])
    )(TOKENS)
    expected = jnp.tanh(encoded.at[1].set(0.0) @ w) @ TABLE.T
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    # Outside a run the model computes what it did.
    np.testing.assert_allclose(model(TOKENS), hidden @ TABLE.T, rtol=1e-5, atol=1e-6)
    # The operations inside a method are addressed under the module's path.
    assert "embedder/mul" in {op.address for op in jhooks.ops(model, TOKENS)}


def test_selecting_the_module_itself_says_why_it_has_no_point(maybe_jit):
    model = models()[0]["equinox"]
    with pytest.raises(
        ValueError,
        match=r"run_with_cache \(names_filter\): no hook point named 'embedder'\. .* Points "
        r"under 'embedder' were reached \('embedder\.decode', 'embedder\.encode'\), but not "
        r"its own: a module's point is the output of its __call__, and a module whose class "
        r"has no __call__ \(used through other methods\) has a point per method instead",
    ):
        maybe_jit(lambda t: jhooks.run_with_cache(model, t, names_filter="embedder"))(TOKENS)


@pytest.mark.parametrize("kind", ["equinox", "nnx"])
def test_a_module_hook_on_a_module_without_call_warns_that_it_never_runs(kind):
    model = models()[0][kind]
    calls = []
    message = (
        r"Embedder at 'embedder' has no __call__: a forward hook runs when the module's "
        r"__call__ is called, as in PyTorch, so this one never runs\. The module is used "
        r"through its methods \(encode, decode\), whose outputs are points of runs: "
        r"jhooks\.run_with_hooks\(model, x, fwd_hooks=\[\('embedder\.encode', hook\)\]\)"
    )
    with pytest.warns(UserWarning, match=message) as warned:
        handle = jhooks.register_forward_hook(model.embedder, lambda m, a, o: calls.append(o))
    assert warned[0].filename == __file__  # the user's line
    with pytest.warns(UserWarning, match="a forward pre-hook runs when"):
        pre = jhooks.register_forward_pre_hook(model.embedder, lambda m, a: calls.append(a))
    model(TOKENS)
    assert calls == []  # as the warning says
    handle.remove()
    pre.remove()


class OwnEmbedder(jhooks.Module):  # written for jhooks, used through its methods too
    table: jax.Array

    def encode(self, tokens):
        return self.table[tokens]


def test_a_jhooks_module_without_call_has_method_points_too(maybe_jit):
    class Net(eqx.Module):
        embedder: OwnEmbedder

        def __call__(self, tokens):
            return jnp.sum(jnp.tanh(self.embedder.encode(tokens)))

    model = jhooks.hookable(Net(OwnEmbedder(TABLE)))

    def double(value, name):
        return 2.0 * value

    out, cache = maybe_jit(
        lambda t: jhooks.run_with_cache(
            lambda t: jhooks.run_with_hooks(model, t, fwd_hooks=[("embedder.encode", double)]),
            t,
            names_filter="embedder.encode",
        )
    )(TOKENS)
    np.testing.assert_allclose(cache["embedder.encode"], 2.0 * TABLE[TOKENS], rtol=1e-6)
    np.testing.assert_allclose(out, jnp.sum(jnp.tanh(2.0 * TABLE[TOKENS])), rtol=1e-5)

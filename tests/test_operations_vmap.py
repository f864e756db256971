"""Hooks at operation addresses and the user's `jax.vmap`: one meaning of a hook's value.

`jhooks.ops(model, x)` lists one example's operations. A hook at an address sees that
value when the vmap is around the run (`jax.vmap(lambda x: jhooks.run_with_hooks(...))`),
and is refused where it would see the batched operation instead (a model called under a
vmap inside the run's function), with the message a point's hook gets where it would see
one example: never a patch of one index on the wrong axis. The oracle is a twin with the
edit written into the model's code by hand.
"""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

T, D = 5, 8


class Attn(eqx.Module):
    qkv: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    zero_head: int | None = eqx.field(static=True, default=None)  # the hand-edited twin

    def __call__(self, x):
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        q, k, v = (a.reshape(T, self.heads, D // self.heads) for a in (q, k, v))
        pattern = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k), axis=-1)
        if self.zero_head is not None:
            pattern = pattern.at[self.zero_head].set(0.0)
        return jnp.einsum("hqk,khd->qhd", pattern, v).reshape(T, D)


class Layer(eqx.Module):
    attn: Attn

    def __call__(self, x):
        return x + self.attn(x)


class Model(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Scanned(eqx.Module):
    layers: Layer  # stacked: a leading axis of layers

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)
        return jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, params)[0]


def models(heads, zero_head=None):
    attn = Attn(eqx.nn.Linear(D, 3 * D, key=jax.random.PRNGKey(heads)), heads, zero_head)
    stacked = jax.tree.map(lambda a: a[None] if eqx.is_array(a) else a, Layer(attn))
    return Model([Layer(attn)]), Scanned(stacked)


def xs_data(batch):
    return jnp.asarray(np.random.default_rng(batch).normal(size=(batch, T, D)).astype(np.float32))


# (batch, heads): 3 examples of 2 heads, and 4 of 4, where an index on the wrong axis
# would not raise.
SHAPES = [(3, 2), (4, 4)]


ADDRESSES = {"plain": "layers.0.attn/softmax", "scanned": "layers.attn/softmax"}


@pytest.mark.parametrize("kind", ["plain", "scanned"])
@pytest.mark.parametrize("batch,heads", SHAPES)
def test_with_the_vmap_around_the_run_an_address_hook_sees_one_example(
    batch, heads, kind, maybe_jit
):
    xs = xs_data(batch)
    which = 0 if kind == "plain" else 1
    model = jhooks.hookable(models(heads)[which])
    twin = models(heads, zero_head=1)[which]
    address = ADDRESSES[kind]
    listed = {op.address: op.shape for op in jhooks.ops(model, xs[0])}
    assert listed[address] == (heads, T, T)
    seen = []

    def zero_head_1(pattern, name):
        seen.append(pattern.shape)
        return pattern.at[1].set(0.0)

    def run(x):
        return jhooks.run_with_hooks(model, x, fwd_hooks=[(address, zero_head_1)])

    out = maybe_jit(jax.vmap(run))(xs)
    assert seen == [(heads, T, T)]  # as jhooks.ops lists it
    np.testing.assert_allclose(out, jax.vmap(twin)(xs), rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, jax.vmap(model)(xs), atol=1e-3)  # the patch did something


@pytest.mark.parametrize("batch,heads", SHAPES)
def test_a_hook_under_the_users_vmap_around_the_model_is_refused(batch, heads, maybe_jit):
    xs = xs_data(batch)
    plain, scanned = (jhooks.hookable(m) for m in models(heads))

    def zero_head_1(pattern, name):
        return pattern.at[1].set(0.0)

    def refusal(kind, name):
        return (
            r"run_with_hooks: hook test_a_hook_under_the_users_vmap_around_the_model_is_refused"
            rf".<locals>.zero_head_1 selects {kind} '{re.escape(name)}', which is inside a "
            r"jax.vmap in the function, .* call the run inside the vmap \(jax.vmap\(lambda x: "
            r"jhooks.run_with_hooks\(...\)\)\), where hooks see one example."
        )

    for model, address in [(plain, ADDRESSES["plain"]), (scanned, ADDRESSES["scanned"])]:
        for hooks in ("fwd_hooks", "bwd_hooks"):
            run = functools.partial(
                jhooks.run_with_hooks, jax.vmap(model), **{hooks: [(address, zero_head_1)]}
            )
            with pytest.raises(ValueError, match=refusal("operation", address)):
                maybe_jit(run)(xs)
    # The module's point in the scan: refused with the same message, where the hook would
    # see one example of the vmap.
    with pytest.raises(ValueError, match=refusal("point", "layers.attn")):
        maybe_jit(
            lambda xs: jhooks.run_with_hooks(
                jax.vmap(scanned), xs, fwd_hooks=[("layers.attn", zero_head_1)]
            )
        )(xs)
    # Caching the address works: the cache shows the batched operation, here each
    # example's pattern stacked (the vmap's axis first).
    _, cache = maybe_jit(
        lambda xs: jhooks.run_with_cache(jax.vmap(plain), xs, names_filter="layers.0.attn/softmax")
    )(xs)
    per_example = jax.vmap(
        lambda x: jhooks.run_with_cache(plain, x, names_filter="layers.0.attn/softmax")[1][
            "layers.0.attn/softmax"
        ]
    )(xs)
    assert cache["layers.0.attn/softmax"].shape == (batch, heads, T, T)
    np.testing.assert_allclose(cache["layers.0.attn/softmax"], per_example, rtol=1e-6, atol=1e-7)

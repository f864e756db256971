"""Operation addresses under a `jit` with the attention's heads split over 8 devices.

tests/conftest.py gives JAX 8 CPU devices. The attention's weights have a head axis, sharded
over the devices, so every head's pattern is computed on its own device. Caching
`attn/softmax` must add no collective to the compiled program beyond the gather of the
cached value itself (counted in the optimized HLO), and give what a hand-placed
`hook_point` on the pattern gives (the twin), bitwise.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_operations import collectives, optimized_hlo

import jhooks

HEADS, T, D, E = 8, 4, 16, 2  # one head per device


class HeadAttention(eqx.Module):
    """Attention whose weights hold the heads on their first axis: `(heads, D, E)`."""

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array  # (heads, E, D)
    annotate: bool = eqx.field(static=True)

    def __call__(self, x):
        q, k, v = (jnp.einsum("td,hde->hte", x, w) for w in (self.wq, self.wk, self.wv))
        pattern = jax.nn.softmax(jnp.einsum("hqe,hke->hqk", q, k) / math.sqrt(E), axis=-1)
        if self.annotate:
            pattern = jhooks.hook_point(pattern, "hook_pattern")
        z = jnp.einsum("hqk,hke->hqe", pattern, v)
        return x + jnp.einsum("hqe,hed->qd", z, self.wo)  # the sum over heads


class Model(eqx.Module):
    attn: HeadAttention

    def __call__(self, x):
        return jnp.tanh(self.attn(x))


def model_pair(mesh):
    """(the model, its twin with a point on the pattern), weights split by head."""
    keys = jax.random.split(jax.random.key(4), 4)
    shapes = [(HEADS, D, E)] * 3 + [(HEADS, E, D)]
    weights = [
        jax.device_put(
            jax.random.normal(k, s, jnp.float32) / math.sqrt(s[1]),
            NamedSharding(mesh, P("heads", None, None)),
        )
        for k, s in zip(keys, shapes)
    ]
    return [jhooks.hookable(Model(HeadAttention(*weights, annotate))) for annotate in (False, True)]


def loss(model, x):
    return jnp.sum(model(x) ** 2)


def step(names, out_sharding=None):
    """Loss, gradients and the cache of `names`; the cache constrained to `out_sharding`."""

    def run(m, x):
        (value, cache), grads = jax.value_and_grad(
            lambda m: jhooks.run_with_cache(loss, m, x, names_filter=names), has_aux=True
        )(m)
        if out_sharding is not None:
            cache = jax.lax.with_sharding_constraint(cache, out_sharding)
        return value, grads, cache

    return run


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:HEADS]), ("heads",))


def x_data():
    return jnp.asarray(np.random.default_rng(3).normal(size=(T, D)).astype(np.float32))


def test_caching_an_address_with_heads_split_adds_no_collective(mesh):
    model, twin = model_pair(mesh)
    x = x_data()
    plain = collectives(step([]), model, x)
    assert "all-reduce" in plain  # the sum over heads, split over the devices
    # The cached pattern stays split by head, where it was computed: no collective added.
    cached = collectives(step("attn/softmax"), model, x)
    assert cached == plain
    assert optimized_hlo(step("attn/softmax"), model, x) == optimized_hlo(
        step("attn.hook_pattern"), twin, x
    )
    # Asked for on every device, the cached pattern adds its own gather, and nothing else.
    replicated = NamedSharding(mesh, P())
    gathered = optimized_hlo(step("attn/softmax", replicated), model, x)
    added = collectives(step("attn/softmax", replicated), model, x)
    assert added == sorted([*plain, "all-gather"])
    (gather,) = [line for line in gathered.splitlines() if "all-gather(" in line]
    assert f"f32[{HEADS},{T},{T}]" in gather.split("=")[1].split("all-gather(")[0]
    assert gathered == optimized_hlo(step("attn.hook_pattern", replicated), twin, x)


def test_values_with_heads_split_equal_the_twin_and_one_device(mesh, maybe_jit):
    model, twin = model_pair(mesh)
    x = x_data()
    value, grads, cache = maybe_jit(step("attn/softmax"))(model, x)
    t_value, t_grads, t_cache = maybe_jit(step("attn.hook_pattern"))(twin, x)
    np.testing.assert_array_equal(value, t_value)
    np.testing.assert_array_equal(cache["attn/softmax"], t_cache["attn.hook_pattern"])
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(t_grads)):
        np.testing.assert_array_equal(a, b)
    # One device, no sharding: the same numbers.
    local = jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), model)
    l_value, l_grads, l_cache = jax.jit(step("attn/softmax"))(local, x)
    np.testing.assert_allclose(value, l_value, rtol=1e-5)
    np.testing.assert_allclose(cache["attn/softmax"], l_cache["attn/softmax"], rtol=1e-5)
    assert cache["attn/softmax"].shape == (HEADS, T, T)
    np.testing.assert_allclose(cache["attn/softmax"].sum(-1), np.ones((HEADS, T)), rtol=1e-5)
    # Sharded and one-device reductions sum in other orders: on this project's machines
    # 3.7e-6 apart on a gradient entry of 0.011 (the test suite's XLA settings).
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(l_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

"""Hooks under every JAX transformation: vmap, scan, checkpoint, forward mode, several devices."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

import jhooks

xs = jnp.linspace(-1.0, 1.5, 12).reshape(4, 3)


def clip_loss(x, hooked=True):
    y = jnp.sin(x) * 3.0
    if hooked:
        y = jhooks.register_hook(y, lambda g: jnp.clip(g, -1.0, 1.0))
    return jnp.sum(y**2)


def clip_reference(x):
    y = jnp.sin(x) * 3.0
    return jnp.clip(2 * y, -1.0, 1.0) * 3.0 * jnp.cos(x)


def test_vmap_of_grad_hook_sees_per_example_values(maybe_jit):
    shapes = []

    def loss(x):
        y = jhooks.register_hook(jnp.sin(x) * 3.0, lambda g: (shapes.append(g.shape), g)[1])
        y = jhooks.register_hook(y, lambda g: jnp.clip(g, -1.0, 1.0))
        return jnp.sum(y**2)

    g = maybe_jit(jax.vmap(jax.grad(loss)))(xs)
    np.testing.assert_allclose(g, clip_reference(xs), rtol=1e-6)
    assert shapes == [(3,)]


def test_grad_of_vmap_hook_sees_per_example_values(maybe_jit):
    shapes = []

    def per_example(x):
        y = jhooks.register_hook(jnp.sin(x) * 3.0, lambda g: (shapes.append(g.shape), g)[1])
        y = jhooks.register_hook(y, lambda g: g / jnp.maximum(1.0, jnp.linalg.norm(g)))
        return jnp.sum(y**2)

    g = maybe_jit(jax.grad(lambda x: jnp.sum(jax.vmap(per_example)(x))))(xs)
    y = jnp.sin(xs) * 3.0
    norm = jnp.linalg.norm(2 * y, axis=1, keepdims=True)
    np.testing.assert_allclose(g, 2 * y / jnp.maximum(1.0, norm) * 3.0 * jnp.cos(xs), rtol=1e-5)
    assert shapes == [(3,)]  # per-example: the per-example norm clip above relies on it


def test_nested_vmap(maybe_jit):
    g = maybe_jit(jax.vmap(jax.vmap(jax.grad(lambda x: clip_loss(x)))))(xs[..., None])
    np.testing.assert_allclose(g[..., 0], clip_reference(xs), rtol=1e-6)
    g2 = maybe_jit(jax.grad(lambda x: jnp.sum(jax.vmap(jax.vmap(clip_loss))(x))))(xs)
    np.testing.assert_allclose(g2, clip_reference(xs), rtol=1e-6)


def test_scan(maybe_jit):
    def loss(x):
        def body(carry, xi):
            return carry + clip_loss(xi), None

        return jax.lax.scan(body, 0.0, x)[0]

    np.testing.assert_allclose(maybe_jit(jax.grad(loss))(xs), clip_reference(xs), rtol=1e-6)


def test_checkpoint(maybe_jit):
    calls = []

    def loss(x):
        y = jhooks.register_hook(jnp.sin(x) * 3.0, lambda g: (calls.append(1), g)[1])
        y = jhooks.register_hook(y, lambda g: jnp.clip(g, -1.0, 1.0))
        return jnp.sum(y**2)

    g = maybe_jit(jax.grad(jax.checkpoint(loss)))(xs)
    np.testing.assert_allclose(g, clip_reference(xs), rtol=1e-6)
    assert len(calls) == 1


def test_forward_mode_hooks_are_a_no_op(maybe_jit):
    t = jnp.ones_like(xs)
    out, tangent = maybe_jit(lambda x, t: jax.jvp(clip_loss, (x,), (t,)))(xs, t)
    ref_out, ref_tangent = jax.jvp(lambda x: clip_loss(x, hooked=False), (xs,), (t,))
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    np.testing.assert_allclose(tangent, ref_tangent, rtol=1e-6)
    np.testing.assert_allclose(
        maybe_jit(jax.jacfwd(clip_loss))(xs),
        jax.jacfwd(lambda x: clip_loss(x, hooked=False))(xs),
        rtol=1e-6,
    )


def test_hessian_and_jacrev(maybe_jit):
    def loss(x):
        y = jhooks.register_hook(jnp.sin(x), lambda g: g * 2.0)
        return jnp.sum(y**2)

    x = xs[0]
    np.testing.assert_allclose(
        maybe_jit(jax.hessian(loss))(x), jnp.diag(4 * jnp.cos(2 * x)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        maybe_jit(jax.jacrev(loss))(x), 2 * jnp.sin(2 * x), rtol=1e-5, atol=1e-6
    )


SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jhooks
    assert len(jax.devices()) == 8

    def loss(w, x):
        h = jhooks.register_hook(jnp.tanh(x @ w), lambda g: jnp.clip(g, -0.01, 0.01))
        h = jhooks.register_hook(h, jhooks.host(lambda g: None, ordered=False))
        return jnp.sum(h ** 2) / 16.0

    w = jnp.linspace(-1, 1, 12).reshape(4, 3)
    x = jnp.linspace(-2, 2, 64).reshape(16, 4)
    mesh = jax.make_mesh((8,), ("data",))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    step = jax.jit(jax.grad(loss))
    sharded = step(ws, xs)
    assert len(sharded.sharding.device_set) == 8
    single = jax.device_get(jax.grad(loss)(jax.device_put(w, jax.devices()[0]),
                                            jax.device_put(x, jax.devices()[0])))
    np.testing.assert_allclose(np.asarray(sharded), single, rtol=1e-5, atol=1e-7)

    from jax import shard_map
    def per_shard(w, x):  # the gradient of the replicated w is summed over shards by JAX
        return jax.grad(loss)(w, x)
    mapped = jax.jit(shard_map(per_shard, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    np.testing.assert_allclose(np.asarray(mapped(ws, xs)), single, rtol=1e-5, atol=1e-7)
    print("OK")
    """
)


def test_sharded_jit_and_shard_map_on_8_devices_match_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")

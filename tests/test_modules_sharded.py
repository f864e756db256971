"""Module hooks in a data-parallel jitted step over 8 simulated CPU devices.

XLA's device count is fixed when JAX starts, so the step runs in a fresh interpreter.
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jhooks

    assert len(jax.devices()) == 8, jax.devices()


    class Net(eqx.Module):
        fc1: eqx.nn.Linear
        fc2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.fc1 = eqx.nn.Linear(6, 16, key=k1)
            self.fc2 = eqx.nn.Linear(16, 3, key=k2)

        def __call__(self, x):
            return self.fc2(jax.nn.relu(self.fc1(x)))


    net = jhooks.hookable(Net(jax.random.PRNGKey(0)))
    net.fc1.register_forward_hook(lambda m, args, out: jnp.clip(out, -1.0, 1.0))
    net.fc2.register_full_backward_pre_hook(lambda m, go: (go[0] * 2.0,))
    net.fc2.register_full_backward_hook(lambda m, gi, go: (jnp.maximum(gi[0], 0.0),))
    net.register_parameter_hook("fc2.bias", jnp.zeros_like)
    net.register_parameter_hook("fc1.weight", lambda g: g / (1.0 + jnp.linalg.norm(g)))
    optim = optax.adam(1e-2)
    traces = []

    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        traces.append(None)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 6)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 64), jnp.int32)

    def train(model, x, y, steps=3):
        opt_state = optim.init(eqx.filter(model, eqx.is_array))
        history = []
        for _ in range(steps):
            model, opt_state, loss, grads = step(model, opt_state, x, y)
            history.append((loss, grads))
        return model, history

    one_model, one = train(net, x, y)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, data), jax.device_put(y, data)
    replicated = jax.device_put(net, NamedSharding(mesh, P()))
    many_model, many = train(replicated, xs, ys)
    assert len(xs.sharding.device_set) == 8

    for (l1, g1), (l8, g8) in zip(one, many):
        np.testing.assert_allclose(l1, l8, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(g8.fc2.bias).max()) == 0.0  # the parameter hook ran
        assert float(jnp.abs(g8.fc1.weight).max()) > 0.0
    np.testing.assert_array_equal(many_model.fc2.bias, net.fc2.bias)
    for a, b in zip(jax.tree.leaves(one_model), jax.tree.leaves(many_model)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The hooks changed the gradients: without them, the same step differs.
    plain = Net(jax.random.PRNGKey(0))
    g_plain = eqx.filter_grad(loss_fn)(plain, xs, ys)
    assert not np.allclose(g_plain.fc1.weight, one[0][1].fc1.weight)
    print("SHARDED-OK")
    """
)


def test_data_parallel_step_on_8_devices_matches_one_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "SHARDED-OK" in result.stdout

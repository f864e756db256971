"""Module hooks in a data-parallel jitted step over 8 CPU devices.

tests/conftest.py gives JAX 8 CPU devices (`jax_num_cpu_devices`), so the sharded step runs
in this process. The same hooked training runs on one device and with the batch split over
8; losses, gradients and weights must agree, and the hooks must have changed them.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jhooks

DEVICES = 8
STEPS = 3


class Net(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(6, 16, key=k1)
        self.fc2 = eqx.nn.Linear(16, 3, key=k2)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def hooked_net():
    net = jhooks.hookable(Net(jax.random.PRNGKey(0)))
    net.fc1.register_forward_hook(lambda m, args, out: jnp.clip(out, -1.0, 1.0))
    net.fc2.register_full_backward_pre_hook(lambda m, go: (go[0] * 2.0,))
    net.fc2.register_full_backward_hook(lambda m, gi, go: (jnp.maximum(gi[0], 0.0),))
    net.register_parameter_hook("fc2.bias", jnp.zeros_like)
    net.register_parameter_hook("fc1.weight", lambda g: g / (1.0 + jnp.linalg.norm(g)))
    return net


def train(model, x, y, steps=STEPS):
    """`steps` jitted optax steps: the final model and `(loss, grads)` of each step."""
    optim = optax.sgd(0.1)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    history = []
    for _ in range(steps):
        model, opt_state, loss, grads = step(model, opt_state, x, y)
        history.append((loss, grads))
    return model, history


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 6)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 64), jnp.int32)
    return x, y


def test_there_are_8_cpu_devices():
    assert len(jax.devices()) == DEVICES, "tests/conftest.py sets jax_num_cpu_devices to 8"


def test_data_parallel_step_on_8_devices_matches_one_device(batch):
    x, y = batch
    net = hooked_net()
    one_model, one = train(net, x, y)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    data = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, data), jax.device_put(y, data)
    replicated = jax.device_put(net, NamedSharding(mesh, P()))
    many_model, many = train(replicated, xs, ys)
    assert len(xs.sharding.device_set) == DEVICES
    assert len(jax.tree.leaves(many_model)[0].sharding.device_set) == DEVICES

    for (l1, g1), (l8, g8) in zip(one, many, strict=True):
        np.testing.assert_allclose(l1, l8, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(g8.fc2.bias).max()) == 0.0  # the parameter hook ran
        assert float(jnp.abs(g8.fc1.weight).max()) > 0.0
    np.testing.assert_array_equal(many_model.fc2.bias, net.fc2.bias)
    for a, b in zip(jax.tree.leaves(one_model), jax.tree.leaves(many_model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_hooks_change_the_sharded_gradients(batch):
    x, y = batch
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, data), jax.device_put(y, data)
    hooked = eqx.filter_jit(eqx.filter_grad(loss_fn))(hooked_net(), xs, ys)
    plain = eqx.filter_jit(eqx.filter_grad(loss_fn))(Net(jax.random.PRNGKey(0)), xs, ys)
    assert not np.allclose(plain.fc1.weight, hooked.fc1.weight)
    assert float(jnp.abs(hooked.fc2.bias).max()) == 0.0
    assert float(jnp.abs(plain.fc2.bias).max()) > 0.0

"""`jhooks.emit`: values out of the backward pass, as outputs of the compiled program."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jhooks


def _norm_hook(name):
    def hook(g):
        jhooks.emit(name, jnp.linalg.norm(g))

    return hook


def layered_loss(ws, x):
    h = x
    for i, w in enumerate(ws):
        h = jnp.tanh(h @ w)
        h = jhooks.register_hook(h, _norm_hook(f"layer{i}"))
        h = jhooks.retain_grad(h, f"h{i}")
    return jnp.sum(h**2)


def _weights(n=3, d=4):
    keys = jax.random.split(jax.random.key(0), n)
    return [jax.random.normal(k, (d, d)) / 2 for k in keys]


def test_emitted_norms_equal_norms_of_retained_gradients(maybe_jit):
    ws, x = _weights(), jnp.linspace(-1, 1, 4)
    grads, retained = maybe_jit(jhooks.grad(layered_loss))(ws, x)
    np.testing.assert_allclose(grads[0], jax.grad(layered_loss)(ws, x)[0], rtol=1e-6)
    for i in range(3):
        np.testing.assert_allclose(
            retained[f"layer{i}"], np.linalg.norm(retained[f"h{i}"]), rtol=1e-6
        )


def test_emit_is_a_no_op_under_plain_grad(maybe_jit):
    ws, x = _weights(), jnp.linspace(-1, 1, 4)
    g = maybe_jit(jax.grad(layered_loss))(ws, x)
    assert len(g) == 3


def test_emit_under_vmap_inside_carries_the_batch_dimension(maybe_jit):
    ws, xs = _weights(), jnp.linspace(-1, 1, 12).reshape(3, 4)

    def batch_loss(ws, xs):
        return jnp.sum(jax.vmap(layered_loss, in_axes=(None, 0))(ws, xs))

    _, retained = maybe_jit(jhooks.grad(batch_loss))(ws, xs)
    for i in range(3):
        assert retained[f"layer{i}"].shape == (3,)
        per_example = [jhooks.grad(layered_loss)(ws, x)[1][f"layer{i}"] for x in xs]
        np.testing.assert_allclose(retained[f"layer{i}"], per_example, rtol=1e-5)


def test_emit_under_vmap_outside(maybe_jit):
    ws, xs = _weights(), jnp.linspace(-1, 1, 12).reshape(3, 4)
    fun = jax.vmap(jhooks.grad(layered_loss), in_axes=(None, 0))
    _, retained = maybe_jit(fun)(ws, xs)
    per_example = [jhooks.grad(layered_loss)(ws, x)[1]["layer1"] for x in xs]
    np.testing.assert_allclose(retained["layer1"], per_example, rtol=1e-5)


def test_emit_from_module_backward_hooks_and_parameter_hooks(maybe_jit):
    net = jhooks.hookable(eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(1)))

    def grad_output_norm(module, grad_output):
        jhooks.emit(f"{jhooks.module_path(module)}.go", jnp.linalg.norm(grad_output[0]))

    handles = [layer.register_full_backward_pre_hook(grad_output_norm) for layer in net.layers]
    handles.append(net.register_parameter_hook("layers.0.weight", _norm_hook("w0")))
    x = jnp.arange(3.0)

    params, static = eqx.partition(net, eqx.is_array)

    def loss(params):
        out = eqx.combine(params, static)(x)
        return jnp.sum(jhooks.retain_grad(out, "out") ** 2)

    try:
        grads, retained = maybe_jit(jhooks.grad(loss))(params)
    finally:
        for h in handles:
            h.remove()
    np.testing.assert_allclose(retained["w0"], np.linalg.norm(grads.layers[0].weight), rtol=1e-6)
    np.testing.assert_allclose(retained["layers.2.go"], np.linalg.norm(retained["out"]), rtol=1e-6)
    assert set(retained) >= {"layers.0.go", "layers.1.go", "layers.2.go"}


def test_emitting_a_name_twice_names_both_hooks():
    def first(g):
        jhooks.emit("n", jnp.sum(g))

    def second(g):
        jhooks.emit("n", jnp.sum(g))

    def f(x):
        return jnp.sum(jhooks.register_hook(x, first, second))

    with pytest.raises(ValueError, match="twice in one backward pass: by .*first and by .*second"):
        jhooks.grad(f)(jnp.ones(2))


def test_emit_inside_a_nested_jit_is_refused_with_a_clear_error():
    def f(x):
        inner = jax.jit(lambda x: jhooks.register_hook(x * 2.0, _norm_hook("inner")))
        return jnp.sum(inner(x))

    with pytest.raises(ValueError, match="traces on its own within the differentiated"):
        jhooks.grad(f)(jnp.ones(2))


def test_per_layer_norms_every_step_of_a_jitted_optax_loop():
    ws, x = _weights(), jnp.linspace(-1, 1, 4)
    opt = optax.sgd(0.1)
    state = opt.init(ws)

    @jax.jit
    def step(ws, state):
        grads, retained = jhooks.grad(layered_loss)(ws, x)
        updates, state = opt.update(grads, state)
        norms = jnp.stack([retained[f"layer{i}"] for i in range(3)])
        return optax.apply_updates(ws, updates), state, norms

    history = []
    for _ in range(3):
        expected = [np.linalg.norm(jhooks.grad(layered_loss)(ws, x)[1][f"h{i}"]) for i in range(3)]
        ws, state, norms = step(ws, state)
        np.testing.assert_allclose(norms, expected, rtol=1e-5)
        history.append(norms)
    assert not np.allclose(history[0], history[-1])


def test_emit_with_sharded_inputs():
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    ws = _weights()
    xs = jax.device_put(jnp.linspace(-1, 1, 4 * len(devices)).reshape(len(devices), 4), sharding)

    def batch_loss(ws, xs):
        return jnp.sum(jax.vmap(layered_loss, in_axes=(None, 0))(ws, xs))

    _, retained = jax.jit(jhooks.grad(batch_loss))(ws, xs)
    expected = [jhooks.grad(layered_loss)(ws, x)[1]["layer2"] for x in np.asarray(xs)]
    np.testing.assert_allclose(retained["layer2"], expected, rtol=1e-5)


def test_run_with_cache_returns_emitted_values(maybe_jit):
    ws, x = _weights(), jnp.linspace(-1, 1, 4)

    def model(x):
        h = x
        for i, w in enumerate(ws):
            h = jhooks.hook_point(jnp.tanh(h @ w), f"h{i}")
        return jnp.sum(h**2)

    run = maybe_jit(
        lambda x: jhooks.run_with_hooks(
            lambda x: jhooks.run_with_cache(model, x, incl_bwd=True),
            x,
            bwd_hooks=[
                (
                    lambda n: n.startswith("h"),
                    lambda g, name: jhooks.emit(name + "_norm", jnp.linalg.norm(g)),
                )
            ],
        )
    )
    _, cache = run(x)
    for i in range(3):
        np.testing.assert_allclose(
            cache[f"h{i}_norm"], np.linalg.norm(cache[f"h{i}_grad"]), rtol=1e-6
        )

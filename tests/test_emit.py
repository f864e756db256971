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


def _retained_norm(fn, x, name="h"):
    """The norm of the gradient retained at `name` (per scan iteration if stacked)."""
    g = jhooks.grad(fn)(x)[1][name]
    return np.linalg.norm(np.asarray(g).reshape(-1, g.shape[-1]), axis=-1).reshape(g.shape[:-1])


W3 = jnp.array([[0.5, -0.2, 0.1], [0.3, 0.4, -0.6], [0.1, 0.2, 0.3], [0.9, -0.1, 0.4]])
X3 = jnp.array([1.0, 2.0, -1.0])


def _scan_loss(mark):
    def loss(x):
        def body(h, w):
            return mark(jnp.tanh(w * h)), None

        return jnp.sum(jax.lax.scan(body, x, W3)[0] ** 2)

    return loss


def test_emit_inside_scan_is_stacked_along_the_scan_axis(maybe_jit):
    emitting = _scan_loss(lambda h: jhooks.register_hook(h, _norm_hook("h")))
    grads, retained = maybe_jit(jhooks.grad(emitting))(X3)
    assert retained["h"].shape == (4,)  # one norm per iteration, in the forward order
    expected = _retained_norm(_scan_loss(lambda h: jhooks.retain_grad(h, "h")), X3)
    np.testing.assert_allclose(retained["h"], expected, rtol=1e-6)
    np.testing.assert_allclose(grads, jax.grad(emitting)(X3), rtol=1e-6)


@pytest.mark.parametrize("where", ["checkpoint", "cond", "jit"])
def test_emit_inside_checkpoint_cond_and_nested_jit(where, maybe_jit):
    def marked(x, mark):
        if where == "checkpoint":
            return jax.checkpoint(lambda x: mark(jnp.tanh(x)))(x)
        if where == "jit":
            return jax.jit(lambda x: mark(jnp.tanh(x)))(x)
        return jax.lax.cond(x[0] > 0, lambda x: mark(jnp.tanh(x)), lambda x: mark(-x), x)

    def loss(mark):
        return lambda x: jnp.sum(marked(x, mark) ** 3)

    _, retained = maybe_jit(jhooks.grad(loss(lambda h: jhooks.register_hook(h, _norm_hook("h")))))(
        X3
    )
    expected = _retained_norm(loss(lambda h: jhooks.retain_grad(h, "h")), X3)
    np.testing.assert_allclose(retained["h"], expected, rtol=1e-6)


def test_emit_in_run_with_hooks_backward_hooks_under_grad(maybe_jit):
    def model(x):
        return jnp.sum(jhooks.hook_point(jnp.tanh(x), "h") ** 2)

    def loss(x):
        hook = lambda g, name: jhooks.emit("h_norm", jnp.linalg.norm(g))  # noqa: E731
        return jhooks.run_with_hooks(model, x, bwd_hooks=[("h", hook)])

    _, retained = maybe_jit(jhooks.grad(loss))(X3)
    np.testing.assert_allclose(retained["h_norm"], np.linalg.norm(2 * np.tanh(X3)), rtol=1e-6)


def test_emit_in_the_forward_pass_is_ignored(maybe_jit):
    def loss(x):
        jhooks.emit("forward", x)  # not in a backward pass: ignored, no tracer leaks
        return jnp.sum(jhooks.register_hook(x, _norm_hook("g")) ** 2)

    _, retained = maybe_jit(jhooks.grad(loss))(X3)
    assert set(retained) == {"g"}
    np.testing.assert_allclose(retained["g"], np.linalg.norm(2 * X3), rtol=1e-6)


def test_emit_in_a_gradient_penalty_belongs_to_the_outer_backward_pass(maybe_jit):
    # The hook runs in the inner jax.grad's backward pass (ignored: not jhooks.grad's) and
    # again in jhooks.grad's own backward pass, where it emits the gradient that reaches
    # the hooked value there: d penalty / d h.
    def inner(x, eps, mark):
        return jnp.sum(mark(jnp.tanh(x) + eps) ** 2)

    def penalty(x, eps=0.0, mark=lambda h: jhooks.register_hook(h, _norm_hook("h"))):
        return jnp.sum(jax.grad(inner)(x, eps, mark) ** 2)

    _, retained = maybe_jit(jhooks.grad(penalty))(X3)
    d_eps = jax.grad(lambda e: penalty(X3, e * jnp.ones(3), lambda h: h))(0.0)
    by_eps = jax.jacobian(lambda e: penalty(X3, e, lambda h: h))(jnp.zeros(3))
    np.testing.assert_allclose(retained["h"], np.linalg.norm(by_eps), rtol=1e-5)
    assert np.isfinite(d_eps)


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

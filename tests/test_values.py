"""Value hooks: register_hook, retain_grad, jhooks.grad, register_multi_grad_hook."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import jhooks

x0 = jnp.array([0.5, -1.0, 2.0])


def test_hooks_run_in_order_each_seeing_the_previous_result(maybe_jit):
    seen = []

    def loss(x):
        y = jnp.sin(x)
        y = jhooks.register_hook(y, lambda g: g * 3.0, lambda g: (seen.append("b"), g + 1.0)[1])
        return jnp.sum(y**2)

    g = maybe_jit(jax.grad(loss))(x0)
    expected = (2 * jnp.sin(x0) * 3.0 + 1.0) * jnp.cos(x0)
    np.testing.assert_allclose(g, expected, rtol=1e-6)
    assert seen == ["b"]


def test_registering_again_adds_to_the_same_chain(maybe_jit):
    def loss(x):
        y = jhooks.register_hook(x * 2.0, lambda g: g + 1.0)
        z = y * 3.0  # a use made between the two registrations is hooked too
        y = jhooks.register_hook(y, lambda g: g * 10.0)
        return jnp.sum(z + y)

    g = maybe_jit(jax.grad(loss))(x0)
    # d/dy = 3 + 1 = 4, then +1 -> 5, then *10 -> 50, times dy/dx = 2.
    np.testing.assert_allclose(g, jnp.full(3, 100.0))


def test_uses_before_registration_are_not_hooked(maybe_jit):
    def loss(x):
        y = x * 2.0
        before = jnp.sum(y)
        y = jhooks.register_hook(y, jnp.zeros_like)
        return before + jnp.sum(y)

    np.testing.assert_allclose(maybe_jit(jax.grad(loss))(x0), jnp.full(3, 2.0))


def test_not_called_on_symbolic_zero(maybe_jit):
    calls = []

    def loss(x):
        y = jhooks.register_hook(x * 2.0, lambda g: calls.append(g))
        return jnp.sum(x**2) + 0 * jnp.sum(jax.lax.stop_gradient(y))

    np.testing.assert_allclose(maybe_jit(jax.grad(loss))(x0), 2 * x0)
    assert calls == []


def test_pytree_values(maybe_jit):
    def loss(tree):
        tree = jhooks.register_hook(tree, lambda g: {"a": g["a"] * 2.0, "b": g["b"]})
        return jnp.sum(tree["a"] ** 2) + jnp.sum(tree["b"])

    tree = {"a": x0, "b": jnp.ones(2)}
    g = maybe_jit(jax.grad(loss))(tree)
    np.testing.assert_allclose(g["a"], 4 * x0)
    np.testing.assert_allclose(g["b"], jnp.ones(2))


def test_pytree_hook_sees_zeros_where_no_gradient_reaches_and_none_where_not_differentiated(
    maybe_jit,
):
    seen = []

    def loss(a, b, c):
        a, b, c = jhooks.register_hook((a, b, c), jhooks.host(seen.append))
        return jnp.sum(a * 3.0)  # b is differentiated but unused; c is not differentiated

    jax.block_until_ready(maybe_jit(jax.grad(loss, argnums=(0, 1)))(x0, jnp.ones(2), jnp.ones(2)))
    ((ga, gb, gc),) = seen
    np.testing.assert_allclose(ga, jnp.full(3, 3.0))
    np.testing.assert_array_equal(gb, jnp.zeros(2))
    assert gc is None


def test_retain_grad_is_the_gradient_after_every_hook(maybe_jit):
    def loss(x):
        y = jhooks.register_hook(jnp.sin(x), lambda g: g * 2.0)
        y = jhooks.retain_grad(y, "y")
        y = jhooks.register_hook(y, lambda g: g + 1.0)
        z = jhooks.retain_grad(y * y, "z")
        return jnp.sum(z)

    (grads, retained) = maybe_jit(jhooks.grad(loss))(x0)
    gy = 2 * jnp.sin(x0) * 2.0 + 1.0
    np.testing.assert_allclose(retained["y"], gy, rtol=1e-6)
    np.testing.assert_allclose(retained["z"], jnp.ones(3))
    np.testing.assert_allclose(grads, gy * jnp.cos(x0), rtol=1e-6)


def test_value_and_grad_with_aux_and_argnums(maybe_jit):
    def loss(w, x):
        h = jhooks.retain_grad(w * x, "h")
        return jnp.sum(h**2), {"h": h}

    (value, aux), grads, retained = maybe_jit(
        jhooks.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    )(2.0 * jnp.ones(3), x0)
    np.testing.assert_allclose(value, jnp.sum((2 * x0) ** 2))
    np.testing.assert_allclose(aux["h"], 2 * x0)
    np.testing.assert_allclose(grads[0], 2 * (2 * x0) * x0)
    np.testing.assert_allclose(grads[1], 2 * (2 * x0) * 2.0)
    np.testing.assert_allclose(retained["h"], 4 * x0)

    (g, aux2), retained2 = maybe_jit(jhooks.grad(loss, has_aux=True))(2.0 * jnp.ones(3), x0)
    np.testing.assert_allclose(g, grads[0])
    np.testing.assert_allclose(retained2["h"], retained["h"])


def test_jhooks_grad_traces_twice_once_per_jit():
    traces = []

    def loss(x):
        traces.append(1)
        return jnp.sum(jhooks.retain_grad(x * 2.0, "y") ** 2)

    step = jax.jit(jhooks.grad(loss))
    step(x0)
    step(x0 + 1.0)
    assert len(traces) == 2  # discovery + differentiation, then cached


def test_retain_grad_beside_nested_jit_and_scan_with_hooks():
    # Chains inside nested jit/scan (cached by JAX between calls) do not disturb which
    # values are retained at the function's own level.
    inner = jax.jit(lambda x: jhooks.register_hook(jnp.sin(x), lambda g: g * 2.0))

    def body(c, xi):
        return c + jhooks.register_hook(xi * 2.0, lambda g: g + 1.0) ** 2, None

    def loss(x):
        s = jhooks.retain_grad(inner(x), "s")
        c, _ = jax.lax.scan(body, 0.0, s)
        return jhooks.retain_grad(c, "c")

    for _ in range(2):  # the second call reuses the jit and scan caches
        grads, retained = jhooks.grad(loss)(x0)
        gs = 2 * (2 * jnp.sin(x0)) + 1.0  # d c / d(2 s), after the scan body's hook
        np.testing.assert_allclose(retained["c"], 1.0)
        np.testing.assert_allclose(retained["s"], gs * 2.0, rtol=1e-6)
        np.testing.assert_allclose(grads, gs * 2.0 * 2.0 * jnp.cos(x0), rtol=1e-6)


def test_retain_grad_inside_a_staged_out_function_is_returned():
    def in_scan(x):
        def body(c, xi):
            return c + jhooks.retain_grad(xi * 2.0, "t") ** 2, None

        return jax.lax.scan(body, 0.0, x)[0]

    def in_jit(x):
        return jnp.sum(jax.jit(lambda x: jhooks.retain_grad(x * 2.0, "t"))(x))

    # Stacked along the scan's axis (tests/test_grad_loops.py has more).
    _, retained = jhooks.grad(lambda x: jnp.sum(in_scan(x)))(x0)
    np.testing.assert_allclose(retained["t"], 4.0 * x0, rtol=1e-6)
    _, retained = jhooks.grad(in_jit)(x0)
    np.testing.assert_allclose(retained["t"], jnp.ones_like(x0))
    # Under vmap it works: the retained gradient is per example.
    xs = jnp.stack([x0, 2 * x0])
    grads, retained = jhooks.grad(
        lambda xs: jnp.sum(jax.vmap(lambda x: jhooks.retain_grad(x * 2.0, "t") ** 2)(xs))
    )(xs)
    np.testing.assert_allclose(retained["t"], jnp.sum(4 * xs, axis=0), rtol=1e-6)


def test_retain_grad_under_plain_jax_grad_is_identity(maybe_jit):
    def loss(x):
        return jnp.sum(jhooks.retain_grad(x * 2.0, "y") ** 2)

    np.testing.assert_allclose(maybe_jit(jax.grad(loss))(x0), 8 * x0)


def test_multi_grad_hook_all(maybe_jit):
    seen = []

    def loss(a, b, c):
        a, b, c = jhooks.register_multi_grad_hook((a, b, c), jhooks.host(seen.append))
        return jnp.sum(a * 2.0) + jnp.sum(b**2)

    ga, gb = maybe_jit(jax.grad(loss, argnums=(0, 1)))(x0, x0, x0)
    (grads,) = seen
    np.testing.assert_allclose(grads[0], jnp.full(3, 2.0))
    np.testing.assert_allclose(grads[1], 2 * x0)
    assert grads[2] is None
    np.testing.assert_allclose(ga, 2.0 * jnp.ones(3))
    np.testing.assert_allclose(gb, 2 * x0)


def test_multi_grad_hook_any(maybe_jit):
    seen = []

    def loss(a, b):
        a, b = jhooks.register_multi_grad_hook([a, b], jhooks.host(seen.append), mode="any")
        return jnp.sum(b * 5.0)

    maybe_jit(jax.grad(loss, argnums=(0, 1)))(x0, x0)
    (g,) = seen
    np.testing.assert_allclose(g, jnp.full(3, 5.0))


def test_multi_grad_hook_not_called_without_gradient(maybe_jit):
    seen = []

    def loss2(a):
        (a,) = jhooks.register_multi_grad_hook((a,), lambda gs: seen.append(gs))
        return jnp.sum(jax.lax.stop_gradient(a))

    maybe_jit(jax.grad(loss2))(x0)
    assert seen == []


@settings(max_examples=20, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    scale=st.floats(-4, 4, allow_nan=False),
)
def test_scaling_hook_scales_the_gradient(shape, scale):
    x = jnp.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape)

    def loss(x, hooked):
        y = jnp.tanh(x)
        if hooked:
            y = jhooks.register_hook(y, lambda g: g * scale)
        return jnp.sum(y**2)

    np.testing.assert_allclose(
        jax.grad(loss)(x, True), scale * jax.grad(loss)(x, False), rtol=1e-5, atol=1e-6
    )

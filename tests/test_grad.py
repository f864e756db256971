"""`jhooks.grad` and `jhooks.value_and_grad` take what `jax.grad` takes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks


def test_python_int_used_to_slice(maybe_jit):
    def f(x, n):
        h = jhooks.retain_grad(x[:n] * 2.0, "h")
        return jnp.sum(h**2)

    fun = jhooks.grad(f)
    if maybe_jit is jax.jit:
        fun = jax.jit(fun, static_argnums=1)
    grads, retained = fun(jnp.arange(4.0), 2)
    np.testing.assert_allclose(grads, jax.grad(f)(jnp.arange(4.0), 2))
    np.testing.assert_allclose(retained["h"], [0.0, 4.0])


def test_string_argument_and_non_array_aux():
    def f(x, mode):
        return jnp.sum(jhooks.retain_grad(x, "x") ** 2), {"mode": mode}

    (grads, aux), retained = jhooks.grad(f, has_aux=True)(jnp.ones(2), "sum")
    assert aux == {"mode": "sum"}
    np.testing.assert_allclose(grads, 2.0)
    np.testing.assert_allclose(retained["x"], 2.0)


def test_module_holding_a_custom_jvp_activation(maybe_jit):
    mlp = eqx.nn.MLP(3, 1, 4, 2, activation=jax.nn.relu, key=jax.random.key(0))

    def f(x, mlp):
        h = jhooks.retain_grad(x * 1.0, "in")
        return jnp.sum(mlp(h))

    x = jnp.arange(3.0)
    jit = eqx.filter_jit if maybe_jit is jax.jit else maybe_jit  # jax.jit refuses the MLP
    grads, retained = jit(jhooks.grad(f))(x, mlp)
    np.testing.assert_allclose(grads, jax.grad(f)(x, mlp), rtol=1e-6)
    np.testing.assert_allclose(retained["in"], grads, rtol=1e-6)


def test_holomorphic_and_allow_int(maybe_jit):
    def f(z):
        return jnp.sum(jhooks.retain_grad(z * z, "sq"))

    z = jnp.array([1.0 + 1.0j, 2.0 - 1.0j])
    grads, retained = maybe_jit(jhooks.grad(f, holomorphic=True))(z)
    np.testing.assert_allclose(grads, jax.grad(f, holomorphic=True)(z))
    np.testing.assert_allclose(retained["sq"], jnp.ones(2))

    def g(x, n):
        return jnp.sum(jhooks.retain_grad(x * 2.0, "y")) + 0 * n

    (gx, gn), _ = jhooks.grad(g, argnums=(0, 1), allow_int=True)(jnp.ones(2), 3)
    np.testing.assert_allclose(gx, 2.0)
    assert gn.dtype == jax.dtypes.float0


def test_bad_argnums_names_the_function():
    def my_loss(x):
        return jnp.sum(x)

    with pytest.raises(ValueError, match="my_loss.*argument 2.*1 positional"):
        jhooks.grad(my_loss, argnums=2)(jnp.ones(2))

"""Bad input raises at trace time a clear error naming the hook and what was expected."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

x0 = jnp.array([1.0, 2.0, 3.0])


def wrong_shape(g):
    return g[:2]


def wrong_dtype(g):
    return g.astype(jnp.float16)


def wrong_structure(g):
    return (g, g)


@pytest.mark.parametrize(
    "hook, message",
    [
        (wrong_shape, "hook wrong_shape returned gradient float32[2], expected float32[3]"),
        (wrong_dtype, "hook wrong_dtype returned gradient float16[3], expected float32[3]"),
        (
            wrong_structure,
            "hook wrong_structure returned gradient (float32[3], float32[3]), expected float32[3]",
        ),
    ],
)
def test_value_hook_returning_the_wrong_gradient(maybe_jit, hook, message):
    def loss(x):
        return jnp.sum(jhooks.register_hook(x * 2.0, hook))

    with pytest.raises(ValueError, match=re.escape(message)):
        maybe_jit(jax.grad(loss))(x0)


def test_lambda_hooks_are_named_by_qualname():
    def loss(x):
        return jnp.sum(jhooks.register_hook(x, lambda g: g[0]))

    message = re.escape(
        "hook test_lambda_hooks_are_named_by_qualname.<locals>.loss.<locals>.<lambda>"
    )
    with pytest.raises(ValueError, match=message):
        jax.grad(loss)(x0)


@pytest.mark.parametrize(
    "register",
    [
        lambda f: jhooks.register_hook(x0, f),
        lambda f: jhooks.register_multi_grad_hook((x0,), f),
        lambda f: jhooks.Node(lambda a: a).register_hook(f),
        lambda f: jhooks.Node(lambda a: a).register_prehook(f),
        lambda f: jhooks.host(f),
    ],
)
def test_non_callable_hook(register):
    with pytest.raises(TypeError, match=r"must be callable, got 3 of type int"):
        register(3)


def test_multi_grad_mode():
    def observe(grads):
        pass

    message = r'hook .*observe: mode must be "all" or "any", got \'some\''
    with pytest.raises(ValueError, match=message):
        jhooks.register_multi_grad_hook((x0,), observe, mode="some")


def test_multi_grad_hook_must_return_none(maybe_jit):
    def replace(grads):
        return grads

    def loss(x):
        (x,) = jhooks.register_multi_grad_hook((x,), replace)
        return jnp.sum(x)

    with pytest.raises(ValueError, match=r"multi-grad hook .*replace returned .* must return None"):
        maybe_jit(jax.grad(loss))(x0)


def test_host_hook_that_returns_a_value(maybe_jit):
    def returns_a_value(g):
        return 1.0

    def loss(x):
        return jnp.sum(jhooks.register_hook(x, jhooks.host(returns_a_value)))

    with pytest.raises(Exception, match=r"host hook .*returns_a_value returned float: host hooks "):
        jax.block_until_ready(maybe_jit(jax.grad(loss))(x0))


def test_node_hook_returning_the_wrong_number_of_gradients(maybe_jit):
    def too_few(grad_inputs, grad_outputs):
        return (grad_inputs[0],)

    node = jhooks.Node(lambda a, b: a * b)
    node.register_hook(too_few)
    with pytest.raises(
        ValueError,
        match=r"hook \S*too_few of Node\(\S*<lambda>\) returned 1 grad_input entries, "
        r"expected None or a tuple of 2 grad_input entries like \(float32\[3\], float32\[3\]\)",
    ):
        maybe_jit(jax.grad(lambda a: jnp.sum(node(a, a))))(x0)


def test_node_prehook_returning_the_wrong_shape(maybe_jit):
    def bad(grad_outputs):
        return (grad_outputs[0][:1],)

    node = jhooks.Node(jnp.sin)
    node.register_prehook(bad)
    with pytest.raises(
        ValueError, match=re.escape("returned float32[1] as grad_output[0], expected float32[3]")
    ):
        maybe_jit(jax.grad(lambda a: jnp.sum(node(a))))(x0)


def test_retain_grad_errors():
    def dup(x):
        return jnp.sum(jhooks.retain_grad(x, "a") + jhooks.retain_grad(x * 2.0, "a"))

    with pytest.raises(ValueError, match="retain_grad name 'a' is used twice"):
        jhooks.grad(dup)(x0)
    message = r"retain_grad\('i'\) needs floating-point arrays, got int32\[3\]"
    with pytest.raises(TypeError, match=message):
        jhooks.retain_grad(jnp.arange(3), "i")

    def outer(x):
        y = jhooks.register_hook(x * 2.0, lambda g: g)

        def inner(z):
            return jnp.sum(z * jhooks.retain_grad(y, "o"))

        return jnp.sum(jhooks.grad(inner)(x)[0])

    with pytest.raises(ValueError, match=r"retain_grad\('o'\) was called on a value made outside"):
        jax.grad(outer)(x0)
    with pytest.raises(ValueError, match=r"retain_grad\('o'\) was called on a value made outside"):
        jhooks.grad(outer)(x0)


def test_errors_leave_later_calls_working():
    def loss(x):
        return jnp.sum(jhooks.register_hook(x, wrong_shape))

    with pytest.raises(ValueError):
        jax.grad(loss)(x0)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(x * 2.0))(x0), 2.0 * jnp.ones(3))

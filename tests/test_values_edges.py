"""Value hooks at the edges: containers, signed zeros, integer leaves, complex numbers."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

Pair = collections.namedtuple("Pair", ["a", "b"])


def test_multi_grad_hook_keeps_a_namedtuple(maybe_jit):
    seen = []

    def f(a, b):
        pair = jhooks.register_multi_grad_hook(Pair(a, b), lambda grads: seen.append(len(grads)))
        assert isinstance(pair, Pair)
        return jnp.sum(pair.a * pair.b)

    ga, gb = maybe_jit(jax.grad(f, argnums=(0, 1)))(jnp.ones(2), jnp.full(2, 3.0))
    np.testing.assert_allclose(ga, 3.0)
    np.testing.assert_allclose(gb, 1.0)
    assert seen == [2]


@pytest.mark.parametrize(
    "values, match",
    [(jnp.ones((2, 3)), "tuple or list of values"), ({"a": jnp.ones(2)}, "tuple\\(d.values")],
)
def test_multi_grad_hook_refuses_a_bare_array_or_a_dict(values, match):
    with pytest.raises(TypeError, match=match):
        jhooks.register_multi_grad_hook(values, lambda grads: None)


def test_retain_grad_keeps_negative_zero(maybe_jit):
    def f(x):
        y = jhooks.retain_grad(x * 1.0, "y")
        return jnp.sum(y), y

    (_, y), _, _ = maybe_jit(jhooks.value_and_grad(f, has_aux=True))(jnp.array([-0.0, 0.0]))
    np.testing.assert_array_equal(np.signbit(y), [True, False])


def test_pytree_hook_gets_none_for_an_integer_leaf(maybe_jit):
    seen = []

    def hook(grad):
        seen.append(grad["n"])
        return {"x": grad["x"] * 2.0, "n": None}

    def f(x):
        tree = jhooks.register_hook({"x": x, "n": jnp.arange(3)}, hook)
        return jnp.sum(tree["x"] * tree["n"].astype(jnp.float32))

    np.testing.assert_allclose(maybe_jit(jax.grad(f))(jnp.ones(3)), [0.0, 2.0, 4.0])
    assert seen == [None]


def test_retain_grad_refuses_a_value_without_floats():
    with pytest.raises(TypeError, match="retain_grad\\('n'\\) needs floating-point"):
        jhooks.grad(lambda x: jnp.sum(x) + jnp.sum(jhooks.retain_grad(jnp.arange(2), "n")))(
            jnp.ones(2)
        )


def test_complex_hooks_see_the_conjugate_of_pytorch(maybe_jit):
    # JAX's cotangent of a complex value is the conjugate of PyTorch's gradient
    # (docs/semantics.md): a hook multiplying by c in jhooks acts as one multiplying
    # by conj(c) in PyTorch, and the results are conjugates.
    c = 0.5 + 2.0j
    z0 = np.array([1.0 + 2.0j, -0.5 + 0.25j], np.complex64)

    def f(z):
        w = jhooks.register_hook(z * 1.0, lambda g: g * c)
        return jnp.sum(jnp.abs(w) ** 2 + jnp.real(w))

    got = maybe_jit(jax.grad(f))(jnp.asarray(z0))
    zt = torch.tensor(z0, requires_grad=True)
    wt = zt * 1.0
    wt.register_hook(lambda g: g * np.conj(c))
    (wt.abs() ** 2 + wt.real).sum().backward()
    assert zt.grad is not None
    np.testing.assert_allclose(got, np.conj(zt.grad.numpy()), rtol=1e-6)

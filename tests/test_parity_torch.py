"""Value, node and multi-grad hooks against PyTorch 2.13: the same graph and hooks in both."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

x_np = np.array([0.3, -1.2, 2.0, 0.7], dtype=np.float32)
w_np = np.array([1.5, 0.5, -0.25, 2.0], dtype=np.float32)


def torch_leaf(a):
    return torch.tensor(a, requires_grad=True)


def test_several_hooks_on_an_intermediate(maybe_jit):
    h1, h2, h3 = (lambda g: g * 3.0), (lambda g: g + 1.0), (lambda g: g.clamp(-2.0, 2.0))

    x = torch_leaf(x_np)
    y = torch.sin(x) * torch.tensor(w_np)
    y.register_hook(h1)
    y.register_hook(h2)
    y.register_hook(h3)
    (y**2).sum().backward()

    def loss(x):
        y = jnp.sin(x) * w_np
        y = jhooks.register_hook(y, h1, h2)
        y = jhooks.register_hook(y, lambda g: jnp.clip(g, -2.0, 2.0))
        return jnp.sum(y**2)

    np.testing.assert_allclose(maybe_jit(jax.grad(loss))(x_np), x.grad.numpy(), rtol=1e-5)


def test_hook_on_an_argument_the_torch_leaf(maybe_jit):
    x = torch_leaf(x_np)
    x.register_hook(lambda g: g * 0.5)
    x.register_hook(lambda g: g - 1.0)
    (torch.tanh(x) ** 3).sum().backward()

    def loss(x):
        x = jhooks.register_hook(x, lambda g: g * 0.5, lambda g: g - 1.0)
        return jnp.sum(jnp.tanh(x) ** 3)

    np.testing.assert_allclose(maybe_jit(jax.grad(loss))(x_np), x.grad.numpy(), rtol=1e-5)


def test_value_used_twice_hook_called_once_with_the_sum(maybe_jit):
    torch_seen, jax_seen = [], []

    x = torch_leaf(x_np)
    y = torch.sin(x)
    y.register_hook(lambda g: torch_seen.append(g.clone()))
    y.register_hook(lambda g: g * 2.0)
    (y * y + 3.0 * y).sum().backward()

    def loss(x):
        y = jnp.sin(x)
        y = jhooks.register_hook(y, jhooks.host(jax_seen.append), lambda g: g * 2.0)
        return jnp.sum(y * y + 3.0 * y)

    g = maybe_jit(jax.grad(loss))(x_np)
    assert len(torch_seen) == 1 and len(jax_seen) == 1
    np.testing.assert_allclose(jax_seen[0], torch_seen[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(g, x.grad.numpy(), rtol=1e-5)


def test_retain_grad_before_and_after_hooks(maybe_jit):
    x = torch_leaf(x_np)
    a = x * 2.0
    a.retain_grad()  # retained before the hook is registered ...
    a.register_hook(lambda g: g * 10.0)
    b = torch.exp(a * 0.1)
    b.register_hook(lambda g: g + 1.0)
    b.retain_grad()  # ... and after
    (b * torch.tensor(w_np)).sum().backward()

    def loss(x):
        a = jhooks.retain_grad(x * 2.0, "a")
        a = jhooks.register_hook(a, lambda g: g * 10.0)
        b = jhooks.register_hook(jnp.exp(a * 0.1), lambda g: g + 1.0)
        b = jhooks.retain_grad(b, "b")
        return jnp.sum(b * w_np)

    grads, retained = maybe_jit(jhooks.grad(loss))(x_np)
    np.testing.assert_allclose(retained["a"], a.grad.numpy(), rtol=1e-5)
    np.testing.assert_allclose(retained["b"], b.grad.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grads, x.grad.numpy(), rtol=1e-5)


def test_node_prehooks_and_hooks(maybe_jit):
    def pre(grad_outputs):
        return (grad_outputs[0] * 2.0,)

    def hook(grad_inputs, grad_outputs):
        return (grad_inputs[0] + grad_outputs[0], grad_inputs[1] * 0.5)

    a, b = torch_leaf(x_np), torch_leaf(w_np)
    y = a * b
    y.grad_fn.register_prehook(pre)
    y.grad_fn.register_hook(hook)
    (torch.sin(y)).sum().backward()

    mul = jhooks.Node(lambda a, b: a * b)
    mul.register_prehook(pre)
    mul.register_hook(hook)
    ga, gb = maybe_jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(mul(a, b))), argnums=(0, 1)))(
        x_np, w_np
    )
    np.testing.assert_allclose(ga, a.grad.numpy(), rtol=1e-5)
    np.testing.assert_allclose(gb, b.grad.numpy(), rtol=1e-5)


def test_node_hooks_see_torch_grad_inputs_and_grad_outputs(maybe_jit):
    torch_seen, jax_seen = [], []

    a, b = torch_leaf(x_np), torch_leaf(w_np)
    y = a * b
    y.grad_fn.register_hook(lambda gi, go: torch_seen.append((gi, go)))
    (y**2).sum().backward()

    mul = jhooks.Node(lambda a, b: a * b)
    mul.register_hook(jhooks.host(lambda gi, go: jax_seen.append((gi, go))))
    maybe_jit(jax.grad(lambda a, b: jnp.sum(mul(a, b) ** 2), argnums=(0, 1)))(x_np, w_np)
    (gi_t, go_t), (gi_j, go_j) = torch_seen[0], jax_seen[0]
    for t, j in zip(gi_t + go_t, gi_j + go_j):
        np.testing.assert_allclose(j, t.detach().numpy(), rtol=1e-6)


def test_multi_grad_hook_all_mode(maybe_jit):
    torch_seen, jax_seen = [], []

    a, b, c = torch_leaf(x_np), torch_leaf(w_np), torch_leaf(x_np)
    torch.autograd.graph.register_multi_grad_hook((a, b, c), torch_seen.append, mode="all")
    (a * b).sum().backward(inputs=[a, b])

    def loss(a, b, c):
        a, b, c = jhooks.register_multi_grad_hook((a, b, c), jhooks.host(jax_seen.append))
        return jnp.sum(a * b)

    maybe_jit(jax.grad(loss, argnums=(0, 1)))(x_np, w_np, x_np)
    (t_grads,), (j_grads,) = torch_seen, jax_seen
    assert [g is None for g in t_grads] == [g is None for g in j_grads] == [False, False, True]
    for t, j in zip(t_grads[:2], j_grads[:2]):
        np.testing.assert_allclose(j, t.numpy(), rtol=1e-6)


def test_multi_grad_hook_any_mode(maybe_jit):
    torch_seen, jax_seen = [], []

    a, b = torch_leaf(x_np), torch_leaf(w_np)
    torch.autograd.graph.register_multi_grad_hook((a, b), torch_seen.append, mode="any")
    (torch.cos(b) * 3.0).sum().backward(inputs=[b])

    def loss(a, b):
        a, b = jhooks.register_multi_grad_hook((a, b), jhooks.host(jax_seen.append), mode="any")
        return jnp.sum(jnp.cos(b) * 3.0)

    maybe_jit(jax.grad(loss, argnums=1))(x_np, w_np)
    assert len(torch_seen) == len(jax_seen) == 1
    np.testing.assert_allclose(jax_seen[0], torch_seen[0].numpy(), rtol=1e-6)


def test_grad_of_grad_matches_torch_double_backward(maybe_jit):
    x = torch_leaf(x_np)
    y = x**3
    y.register_hook(lambda g: g * 2.0)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad((g * torch.tensor(w_np)).sum(), x)

    def f(x):
        return jnp.sum(jhooks.register_hook(x**3, lambda g: g * 2.0))

    def first(x):
        return jnp.sum(jax.grad(f)(x) * w_np)

    np.testing.assert_allclose(maybe_jit(jax.grad(first))(x_np), gg.numpy(), rtol=1e-5)

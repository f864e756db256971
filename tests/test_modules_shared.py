"""Shared modules: one submodule under two parents, and `eqx.nn.Shared`, against PyTorch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def to_torch(x):
    return torch.tensor(np.asarray(x))


def batch(shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


class Twice(eqx.Module):
    """The same `Linear` object under two attribute names."""

    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


class TorchTwice(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        with torch.no_grad():
            self.a.weight.copy_(to_torch(net.a.weight))
            self.a.bias.copy_(to_torch(net.a.bias))
        self.b = self.a  # one module, one set of parameters

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def twice():
    lin = eqx.nn.Linear(3, 3, key=jax.random.PRNGKey(0))
    return jhooks.hookable(Twice(lin, lin))


def loss(net, x):
    return jnp.sum(jax.vmap(net)(x) ** 2)


def torch_loss(tm, x):
    tx = to_torch(x).requires_grad_(True)
    (tm(tx) ** 2).sum().backward()
    return tx


def clip(g):
    return g / jnp.maximum(1.0, jnp.linalg.norm(g) / 0.1)


def torch_clip(g):
    return g / torch.clamp(g.norm() / 0.1, min=1.0)


def test_parameter_hook_on_root_covers_every_use(maybe_jit):
    net = twice()
    assert net.a is net.b
    assert [n for n, _ in jhooks.named_parameters(net)] == ["a.weight", "a.bias"]
    seen = []
    jhooks.register_parameter_hook(net, "a.bias", jnp.zeros_like)
    jhooks.register_parameter_hook(net, "a.weight", clip)
    jhooks.register_parameter_hook(net, "a.weight", jhooks.host(lambda g: seen.append(g)))
    x = batch((4, 3))
    grads = maybe_jit(jax.grad(loss))(net, x)

    tm, torch_seen = TorchTwice(net), []
    tm.a.bias.register_hook(torch.zeros_like)
    tm.a.weight.register_hook(torch_clip)
    tm.a.weight.register_hook(lambda g: torch_seen.append(g.numpy().copy()))
    torch_loss(tm, x)
    # The hooks ran once, on the gradient summed over both uses, as PyTorch's.
    assert len(seen) == 1 == len(torch_seen)
    assert_close(seen[0], torch_seen[0])
    # The first appearance holds the hooked total gradient, the second none.
    assert_close(grads.a.weight, tm.a.weight.grad)
    assert_close(grads.a.bias, tm.a.bias.grad)
    assert float(jnp.abs(grads.a.bias).max()) == 0.0
    assert_close(grads.b.weight, np.zeros((3, 3)), rtol=0, atol=0)


def test_unhooked_shared_parameters_keep_equinox_gradients(maybe_jit):
    # Without a parameter hook the two appearances are two leaves, as in Equinox,
    # whose gradients add up to PyTorch's one.
    net = twice()
    jhooks.register_parameter_hook(net, "a.bias", lambda g: g)  # ties the bias only
    x = batch((4, 3))
    grads = maybe_jit(jax.grad(loss))(net, x)
    tm = TorchTwice(net)
    torch_loss(tm, x)
    assert_close(grads.a.weight + grads.b.weight, tm.a.weight.grad)
    assert float(jnp.abs(grads.a.weight).max()) > 0 and float(jnp.abs(grads.b.weight).max()) > 0
    assert_close(grads.a.bias, tm.a.bias.grad)
    plain = jax.grad(loss)(Twice(net.a, net.b), x)
    assert_close(grads.a.weight, plain.a.weight)


def test_module_hooks_on_a_shared_submodule_fire_for_every_call(maybe_jit):
    net = twice()
    calls, torch_calls = [], []
    jhooks.register_forward_pre_hook(net.a, lambda m, args: calls.append("pre"))
    jhooks.register_forward_hook(net.b, lambda m, args, out: out * 2.0)
    jhooks.register_full_backward_hook(net.a, lambda m, gi, go: (gi[0] * 0.5,))
    x = batch((4, 3))
    grads, x_grad = maybe_jit(jax.grad(loss, argnums=(0, 1)))(net, x)

    tm = TorchTwice(net)
    tm.a.register_forward_pre_hook(lambda m, args: torch_calls.append("pre"))
    tm.b.register_forward_hook(lambda m, args, out: out * 2.0)
    tm.a.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    tx = torch_loss(tm, x)
    assert len(calls) == 2 and len(torch_calls) == 2  # traced once, called twice
    assert_close(x_grad, tx.grad, atol=1e-5)
    assert_close(grads.a.weight + grads.b.weight, tm.a.weight.grad, atol=1e-5)
    assert_close(grads.a.bias + grads.b.bias, tm.a.bias.grad, atol=1e-5)


class Tied(eqx.Module):
    """An embedding whose matrix is also the output projection, with `eqx.nn.Shared`."""

    shared: eqx.nn.Shared

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        embedding = eqx.nn.Embedding(5, 3, key=k1)
        linear = eqx.nn.Linear(3, 5, use_bias=False, key=k2)
        where = lambda pair: pair[1].weight  # noqa: E731
        get = lambda pair: pair[0].weight  # noqa: E731
        self.shared = eqx.nn.Shared((embedding, linear), where, get)

    def __call__(self, token):
        embedding, linear = self.shared()
        return linear(jnp.tanh(embedding(token)))


class TorchTied(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.embedding = torch.nn.Embedding(5, 3)
        self.linear = torch.nn.Linear(3, 5, bias=False)
        with torch.no_grad():
            self.embedding.weight.copy_(to_torch(net.shared.pytree[0].weight))
        self.linear.weight = self.embedding.weight

    def forward(self, tokens):
        return self.linear(torch.tanh(self.embedding(tokens)))


def test_eqx_nn_shared_parameter_hook_and_module_hooks(maybe_jit):
    net = jhooks.hookable(Tied(jax.random.PRNGKey(0)))
    tokens = jnp.array([0, 3, 3, 1])
    seen, calls = [], []
    jhooks.register_parameter_hook(net, "shared.pytree.0.weight", clip)
    jhooks.register_parameter_hook(
        net, "shared.pytree.0.weight", jhooks.host(lambda g: seen.append(g))
    )
    jhooks.register_forward_hook(net.shared.pytree[1], lambda m, args, out: calls.append(1))
    jhooks.register_full_backward_pre_hook(net.shared.pytree[1], lambda m, go: (go[0] * 3.0,))

    def tied_loss(net, tokens):
        return jnp.sum(jnp.sin(jax.vmap(net)(tokens)))

    jit = eqx.filter_jit if maybe_jit is jax.jit else maybe_jit
    grads = jit(eqx.filter_grad(tied_loss))(net, tokens)
    tm, torch_seen = TorchTied(net), []
    tm.embedding.weight.register_hook(torch_clip)
    tm.embedding.weight.register_hook(lambda g: torch_seen.append(g.numpy().copy()))
    tm.linear.register_full_backward_pre_hook(lambda m, go: (go[0] * 3.0,))
    torch.sin(tm(torch.tensor(np.asarray(tokens)))).sum().backward()
    assert len(seen) == 1 and len(calls) == 1
    assert_close(seen[0], torch_seen[0])
    assert_close(grads.shared.pytree[0].weight, tm.embedding.weight.grad)

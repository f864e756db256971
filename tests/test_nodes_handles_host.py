"""Node hooks, handles, host hooks, and jit caching of hooks that live outside the trace."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

a0 = jnp.array([1.0, -2.0, 0.5])
b0 = jnp.array([0.5, 3.0, -1.0])


def test_node_without_hooks_is_the_function():
    node = jhooks.Node(jnp.sin)
    assert node.__name__ == "sin"
    np.testing.assert_allclose(node(a0), jnp.sin(a0))


def test_grad_inputs_have_none_for_non_array_arguments(maybe_jit):
    seen = []
    node = jhooks.Node(lambda a, scale, b: a * b * scale)
    node.register_hook(lambda gi, go: seen.append(tuple(g is None for g in gi)))
    maybe_jit(jax.grad(lambda a, b: jnp.sum(node(a, 2.0, b)), argnums=(0, 1)))(a0, b0)
    assert seen == [(False, True, False)]


def test_hooks_fire_from_the_output_side_when_no_input_is_differentiated(maybe_jit):
    # PyTorch: with no input requiring grad, full hooks get grad_input of all None.
    t_seen, j_seen = [], []
    lin = torch.nn.Linear(3, 2)
    lin.register_full_backward_hook(lambda m, gi, go: t_seen.append((gi, go[0].clone())))
    with pytest.warns(UserWarning, match="no inputs require gradients"):
        (lin(torch.tensor(np.asarray(a0))) * torch.tensor([1.0, -2.0])).sum().backward()

    w = jnp.asarray(lin.weight.detach().numpy())
    bias = jnp.asarray(lin.bias.detach().numpy())
    v0 = jnp.array([1.0, -2.0])

    def loss(w):  # the weight is differentiated, the node's only argument is not
        node = jhooks.Node(lambda x: w @ x + bias)
        node.register_hook(jhooks.host(lambda gi, go: j_seen.append((gi, go[0]))))
        return jnp.sum(node(a0) * v0)

    grads = maybe_jit(jax.grad(loss))(w)
    np.testing.assert_allclose(grads, lin.weight.grad.numpy(), rtol=1e-6)
    (t_gi, t_go), (j_gi, j_go) = t_seen[0], j_seen[0]
    assert t_gi == j_gi == (None,)
    np.testing.assert_allclose(j_go, t_go.numpy())


def test_handles_remove_is_idempotent_and_ids_unique():
    node = jhooks.Node(lambda a: a * 2.0)
    h1 = node.register_hook(lambda gi, go: (gi[0] * 10.0,))
    h2 = node.register_prehook(lambda go: (go[0] + 1.0,))
    assert h1.id != h2.id
    grad = jax.grad(lambda a: jnp.sum(node(a)))
    np.testing.assert_allclose(grad(a0), jnp.full(3, 40.0))
    h1.remove()
    h1.remove()
    np.testing.assert_allclose(grad(a0), jnp.full(3, 4.0))
    with node.register_hook(lambda gi, go: (gi[0] * 0.0,)):
        np.testing.assert_allclose(grad(a0), jnp.zeros(3))
    np.testing.assert_allclose(grad(a0), jnp.full(3, 4.0))
    h2.remove()
    np.testing.assert_allclose(grad(a0), jnp.full(3, 2.0))


@pytest.mark.usefixtures("settled_hook_state")  # it counts traces
def test_jitted_function_retraces_when_node_hooks_change_and_never_runs_stale():
    traces = []
    node = jhooks.Node(lambda a: a * 2.0)

    @jax.jit
    def step(a):
        traces.append(1)
        return jax.grad(lambda a: jnp.sum(node(a)))(a)

    np.testing.assert_allclose(step(a0), jnp.full(3, 2.0))
    np.testing.assert_allclose(step(a0), jnp.full(3, 2.0))
    assert len(traces) == 1
    handle = node.register_prehook(lambda go: (go[0] * 3.0,))
    np.testing.assert_allclose(step(a0), jnp.full(3, 6.0))
    assert len(traces) == 2
    handle.remove()
    np.testing.assert_allclose(step(a0), jnp.full(3, 2.0))
    assert len(traces) == 2  # back to the set of hooks of the first trace: its program


def test_host_hooks_run_every_step_in_pytorch_order():
    # In the backward pass PyTorch calls the hooks of later values first.
    t_order, j_order = [], []
    x = torch.tensor(np.asarray(a0), requires_grad=True)
    y = torch.sin(x)
    y.register_hook(lambda g: t_order.append("y"))
    z = y * 2.0
    z.register_hook(lambda g: t_order.append("z"))
    x.register_hook(lambda g: t_order.append("x"))
    z.sum().backward()

    def loss(x):
        x = jhooks.register_hook(x, jhooks.host(lambda g: j_order.append("x")))
        y = jhooks.register_hook(jnp.sin(x), jhooks.host(lambda g: j_order.append("y")))
        z = jhooks.register_hook(y * 2.0, jhooks.host(lambda g: j_order.append("z")))
        return jnp.sum(z)

    step = jax.jit(jax.grad(loss))
    for _ in range(3):
        jax.block_until_ready(step(a0))
    assert j_order == t_order * 3 == ["z", "y", "x"] * 3


def test_host_hook_gets_numpy_values():
    seen = []

    def loss(x):
        return jnp.sum(jhooks.register_hook(x * 3.0, jhooks.host(seen.append)))

    jax.block_until_ready(jax.jit(jax.grad(loss))(a0))
    assert isinstance(seen[0], np.ndarray)
    np.testing.assert_allclose(seen[0], np.ones(3))


def test_import_pulls_in_neither_torch_nor_optax_and_little_beyond_equinox():
    code = (
        "import sys; import equinox; before = set(sys.modules); import jhooks; "
        "new = set(sys.modules) - before; "
        "print('torch' in sys.modules, 'optax' in sys.modules, "
        "len([m for m in new if not m.startswith('jhooks')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    torch_loaded, optax_loaded, n_new = out.stdout.split()
    assert torch_loaded == "False" and optax_loaded == "False"
    assert int(n_new) <= 5, out.stdout  # jhooks' own modules aside

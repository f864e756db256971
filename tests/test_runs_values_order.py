"""Hooks on values run in program order and at every point they select, as PyTorch
runs forward hooks: the program calls them through host calls that have no JAX effect
(`_core/_jax_compat/_host_call.py`), each made to wait for the one before it, in a
program that keeps unused values (`_runs/_program.py`). Oracle: the same hooks on the
same computation in PyTorch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

RNG = np.random.default_rng(3)
WQ, WK, WV = (RNG.normal(size=(8, 8)).astype(np.float32) * 0.3 for _ in range(3))
X = RNG.normal(size=(4, 8)).astype(np.float32)


def attention(x):
    # q, k and v are independent: XLA may compute (and call the hooks of) them in any
    # order, and ran the host call at k before the one at q before they were chained.
    q = jhooks.hook_point(jnp.sin(x @ WQ), "q")
    k = jhooks.hook_point(jnp.sin(x @ WK), "k")
    v = jhooks.hook_point(jnp.sin(x @ WV), "v")
    jhooks.hook_point(jnp.cos(x).sum(), "unused")  # its value is not used
    return jax.nn.softmax(q @ k.T) @ v


class TorchAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Identity() for _ in range(3))
        self.unused = torch.nn.Identity()

    def forward(self, x):
        q = self.q(torch.sin(x @ torch.from_numpy(WQ)))
        k = self.k(torch.sin(x @ torch.from_numpy(WK)))
        v = self.v(torch.sin(x @ torch.from_numpy(WV)))
        self.unused(torch.cos(x).sum())
        return torch.softmax(q @ k.T, -1) @ v


def torch_log() -> tuple[list, np.ndarray]:
    net, log = TorchAttention(), []
    for name in ("q", "k", "v", "unused"):

        def hook(module, args, out, name=name):
            # Each hook reads the value the hook before it kept, as path patching does.
            log.append((name, float(out.mean()), log[-1][1] if log else None))

        getattr(net, name).register_forward_hook(hook)
    for _ in range(3):
        out = net(torch.from_numpy(X))
    return log, out.detach().numpy()


@pytest.mark.parametrize("jit", [False, True])
def test_hooks_on_values_run_in_program_order_at_every_point_as_in_torch(jit):
    expected, expected_out = torch_log()
    log: list = []

    def hook(z, name):
        log.append((str(name), float(z.mean()), log[-1][1] if log else None))

    hooks = [(name, hook) for name in ("q", "k", "v", "unused")]
    run = lambda x: jhooks.run_with_hooks(attention, x, fwd_hooks=hooks)  # noqa: E731
    if jit:
        # Under the user's jit a hook runs when JAX traces it (JAX's rule): once, on
        # tracers, where `float` is refused; the order of the trace is program order.
        order: list = []
        traced = jax.jit(
            lambda x: jhooks.run_with_hooks(
                attention,
                x,
                fwd_hooks=[(n, lambda z, name: order.append(str(name))) for n, _ in hooks],
            )
        )
        with pytest.warns(UserWarning, match="once per compilation"):
            outs = [traced(jnp.asarray(X)) for _ in range(3)]
        assert order == ["q", "k", "v", "unused"]
        np.testing.assert_allclose(outs[-1], expected_out, rtol=1e-5, atol=1e-6)
        return
    for _ in range(3):
        out = run(jnp.asarray(X))
    assert [e[0] for e in log] == [e[0] for e in expected]  # 3 calls of q, k, v, unused
    np.testing.assert_allclose([e[1] for e in log], [e[1] for e in expected], rtol=1e-5)
    kept = [e[2] for e in log]
    assert kept[0] is None and expected[0][2] is None
    np.testing.assert_allclose(kept[1:], [e[2] for e in expected][1:], rtol=1e-5)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-6)


def test_a_hook_on_values_at_an_unused_point_runs_in_a_scan_and_a_cond_each_call():
    calls: list = []

    def model(x):
        def body(c, _):
            jhooks.hook_point(c * 3.0, "unused_in_scan")
            return c * 1.5, None

        y = jax.lax.scan(body, x, None, length=3)[0]
        jax.lax.cond(y.sum() > 0, lambda: jhooks.hook_point(y * 2.0, "unused_in_cond"), lambda: y)
        return y

    hooks = [
        (n, lambda z, name: calls.append((str(name), float(z.sum()))))
        for n in ("unused_in_scan", "unused_in_cond")
    ]
    x = jnp.ones(2)
    for _ in range(2):
        calls.clear()
        out = jhooks.run_with_hooks(model, x, fwd_hooks=hooks)
        # The same sums computed by hand: the scan's carry before each step, times 3.
        expected = [("unused_in_scan", 2 * 3.0 * 1.5**i) for i in range(3)]
        expected.append(("unused_in_cond", 2 * 2.0 * 1.5**3))
        assert [c[0] for c in calls] == [e[0] for e in expected]
        np.testing.assert_allclose([c[1] for c in calls], [e[1] for e in expected], rtol=1e-6)
        np.testing.assert_allclose(out, np.ones(2) * 1.5**3, rtol=1e-6)


def test_hooks_on_values_in_a_scan_body_run_in_program_order_each_iteration():
    # Inside a loop's body, too: the body's host calls wait for each other, and nothing
    # of the body's trace is kept when it ends (jax.checking_leaks). There a host call
    # waits for the one before it only while that one's value is in use (the body's
    # trace holds it; jhooks holds it weakly): after a point whose value the body drops,
    # the next one may run first (docs/semantics.md).
    log: list = []

    def model(x):
        def body(c, _):
            q = jhooks.hook_point(jnp.sin(c @ WQ), "q")
            k = jhooks.hook_point(jnp.sin(c @ WK), "k")
            v = jhooks.hook_point(jnp.sin(c @ WV), "v")
            jhooks.hook_point(jnp.cos(c).sum(), "unused")
            return c + jax.nn.softmax(q @ k.T) @ v, None

        return jax.lax.scan(body, x, None, length=2)[0]

    names = ("q", "k", "v", "unused")
    hooks = [(n, lambda z, name: log.append(str(name))) for n in names]
    with jax.checking_leaks():
        for _ in range(3):
            log.clear()
            jhooks.run_with_hooks(model, jnp.asarray(X), fwd_hooks=hooks)
            assert log == list(names) * 2


def torch_checkpoint_log() -> tuple[list, np.ndarray]:
    from torch.utils.checkpoint import checkpoint

    inner, log = torch.nn.Identity(), []
    inner.register_forward_hook(lambda m, a, out: log.append(("f", out.mean().item())))
    inner.register_full_backward_hook(lambda m, gi, go: log.append(("b", go[0].mean().item())))
    x = torch.from_numpy(X).requires_grad_()
    wq = torch.from_numpy(WQ)
    block = lambda t: torch.sin(inner(torch.sin(t @ wq) * 3))  # noqa: E731
    (checkpoint(block, x, use_reentrant=False) ** 2).sum().backward()
    return log, x.grad.numpy()


@pytest.mark.parametrize("jit", [False, True])
def test_a_hook_on_values_in_a_checkpoint_runs_again_in_the_backward_as_in_torch(jit):
    # PyTorch's checkpoint computes the block's forward again in the backward pass, and
    # calls its forward hooks again there: jax.checkpoint does the same with a hook on
    # values, which runs on the recomputed value (the forward's entry is kept for it).
    expected, expected_grad = torch_checkpoint_log()
    log: list = []

    def model(x):
        block = jax.checkpoint(lambda t: jnp.sin(jhooks.hook_point(jnp.sin(t @ WQ) * 3, "inner")))
        return jnp.sum(block(x) ** 2)

    def loss(x):
        return jhooks.run_with_hooks(
            model,
            x,
            fwd_hooks=[("inner", lambda z, n: log.append(("f", float(z.mean()))))],
            bwd_hooks=[("inner", lambda g, n: log.append(("b", float(g.mean()))))],
        )

    if jit:
        # Under the user's jit the hooks are traced with it (JAX's rule): `float` is
        # refused, naming the hook; the gradient is the same.
        with pytest.raises(
            jax.errors.ConcretizationTypeError, match="hook .*<lambda> tried to read a traced value"
        ):
            jax.jit(jax.grad(loss))(jnp.asarray(X))
        plain = jax.jit(jax.grad(lambda x: jhooks.run_with_hooks(model, x)))(jnp.asarray(X))
        np.testing.assert_allclose(plain, expected_grad, rtol=1e-5, atol=1e-6)
        return
    for _ in range(2):
        log.clear()
        grad = jax.grad(loss)(jnp.asarray(X))
        assert [e[0] for e in log] == [e[0] for e in expected] == ["f", "f", "b"]
        np.testing.assert_allclose([e[1] for e in log], [e[1] for e in expected], rtol=1e-5)
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_a_hook_on_values_under_grad_of_grad_runs_once_as_in_torch(jit):
    # It raised "a jhooks host call is differentiated through its custom_jvp only" on
    # 1712e16: the differentiated host call is differentiated again by the same rule.
    net, torch_log = torch.nn.Identity(), []
    net.register_forward_hook(lambda m, a, out: torch_log.append(out.sum().item()))
    tx = torch.from_numpy(X[0]).requires_grad_()
    (g,) = torch.autograd.grad(torch.sin(net(tx * 3)).sum(), tx, create_graph=True)
    g.sum().backward()
    log: list = []

    def loss(x):
        model = lambda x: jnp.sin(jhooks.hook_point(x * 3.0, "a"))  # noqa: E731
        hooks = [("a", lambda z, n: log.append(float(z.sum())))]
        return jnp.sum(jhooks.run_with_hooks(model, x, fwd_hooks=hooks))

    second = jax.grad(lambda x: jnp.sum(jax.grad(loss)(x)))
    if jit:
        with pytest.raises(jax.errors.ConcretizationTypeError, match="tried to read a traced"):
            jax.jit(second)(jnp.asarray(X[0]))
        return
    out = second(jnp.asarray(X[0]))
    np.testing.assert_allclose(out, tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log, torch_log, rtol=1e-5)
    assert len(log) == len(torch_log) == 1

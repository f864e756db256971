"""Property tests: random graphs with random hook chains, jhooks against PyTorch.

Each example builds a small computation graph (elementwise ops, a matmul, values used
twice, several outputs summed) with chains of hooks (scale, clip, add a constant,
replace with zeros, observe) on random nodes, runs it in PyTorch and in jhooks, and
compares gradients and the order the hooks ran in. `JHOOKS_PROPERTY_EXAMPLES=500`
runs more examples than CI's default.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import jhooks

EXAMPLES = int(os.environ.get("JHOOKS_PROPERTY_EXAMPLES", "25"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

UNARY = {
    "sin": (jnp.sin, torch.sin),
    "tanh": (jnp.tanh, torch.tanh),
    "square": (lambda a: a * a, lambda a: a * a),
    "matmul": (None, None),  # with the weight matrix
}
BINARY = {"add": (jnp.add, torch.add), "mul": (jnp.multiply, torch.mul)}


@dataclass(frozen=True)
class HookSpec:
    kind: str  # scale, clip, add, zeros, observe
    c: float

    def jax_fn(self, log: list, tag: tuple) -> Callable:
        def hook(g):
            log.append(tag)
            return self._apply(g, jnp)

        return hook

    def torch_fn(self, log: list, tag: tuple) -> Callable:
        def hook(g):
            log.append(tag)
            return self._apply(g, torch)

        return hook

    def _apply(self, g, lib):
        if self.kind == "scale":
            return g * self.c
        if self.kind == "clip":
            return lib.clip(g, -abs(self.c), abs(self.c))
        if self.kind == "add":
            return g + self.c
        if self.kind == "zeros":
            return g * 0.0
        return None


@dataclass(frozen=True)
class NodeSpec:
    op: str
    args: tuple[int, ...]
    hooks: tuple[HookSpec, ...]


hooks_st = st.lists(
    st.builds(
        HookSpec,
        st.sampled_from(["scale", "clip", "add", "zeros", "observe"]),
        st.sampled_from([-1.5, -0.5, 0.25, 0.75, 2.0]),
    ),
    max_size=3,
).map(tuple)


@st.composite
def graphs(draw):
    n = draw(st.integers(2, 6))
    nodes = [NodeSpec("input", (), draw(hooks_st))]
    for i in range(1, n):
        if draw(st.booleans()):
            op = draw(st.sampled_from(sorted(BINARY)))
            args = (draw(st.integers(0, i - 1)), draw(st.integers(0, i - 1)))
        else:
            op = draw(st.sampled_from(sorted(UNARY)))
            args = (draw(st.integers(0, i - 1)),)
        nodes.append(NodeSpec(op, args, draw(hooks_st)))
    outputs = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True))
    return nodes, tuple(outputs)


def run_jax(nodes, outputs, w, log):
    def f(x):
        values = []
        for i, node in enumerate(nodes):
            if node.op == "input":
                v = x
            elif node.op == "matmul":
                v = w @ values[node.args[0]]
            elif node.op in BINARY:
                v = BINARY[node.op][0](values[node.args[0]], values[node.args[1]])
            else:
                v = UNARY[node.op][0](values[node.args[0]])
            if node.hooks:
                fns = [h.jax_fn(log, (i, k)) for k, h in enumerate(node.hooks)]
                v = jhooks.register_hook(v, *fns)
            values.append(v)
        return sum(jnp.sum(jnp.tanh(values[o]) * (o + 1)) for o in outputs)

    return f


def run_torch(nodes, outputs, w, x, log):
    values = []
    for i, node in enumerate(nodes):
        if node.op == "input":
            v = x * 1.0
        elif node.op == "matmul":
            v = w @ values[node.args[0]]
        elif node.op in BINARY:
            v = BINARY[node.op][1](values[node.args[0]], values[node.args[1]])
        else:
            v = UNARY[node.op][1](values[node.args[0]])
        for k, h in enumerate(node.hooks):
            v.register_hook(h.torch_fn(log, (i, k)))
        values.append(v)
    return sum((torch.tanh(values[o]) * (o + 1)).sum() for o in outputs)


W = np.array([[0.5, -0.3, 0.8], [0.1, 0.9, -0.4], [-0.7, 0.2, 0.6]])


def torch_grad(nodes, outputs, x0, log=None):
    x = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    out = run_torch(nodes, outputs, torch.tensor(W), x, [] if log is None else log)
    out.backward()
    assert x.grad is not None
    return x.grad.numpy()


X0 = np.array([0.3, -0.6, 0.9])


@SETTINGS
@given(graphs())
def test_gradients_and_hook_order_match_torch(graph):
    nodes, outputs = graph
    torch_log, jax_log = [], []
    expected = torch_grad(nodes, outputs, X0, torch_log)
    f = run_jax(nodes, outputs, jnp.asarray(W, jnp.float32), jax_log)
    got = jax.grad(f)(jnp.asarray(X0, jnp.float32))
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-5)
    assert jax_log == torch_log
    jitted = jax.jit(jax.grad(run_jax(nodes, outputs, jnp.asarray(W, jnp.float32), [])))
    np.testing.assert_allclose(jitted(jnp.asarray(X0, jnp.float32)), expected, rtol=2e-4, atol=1e-5)


@SETTINGS
@given(graphs())
def test_per_example_gradients_under_vmap_match_a_torch_loop(graph):
    nodes, outputs = graph
    xs = np.stack([X0, -X0[::-1], X0 * 0.5])
    expected = np.stack([torch_grad(nodes, outputs, x) for x in xs])
    f = run_jax(nodes, outputs, jnp.asarray(W, jnp.float32), [])
    got = jax.jit(jax.vmap(jax.grad(f)))(jnp.asarray(xs, jnp.float32))
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-5)


@SETTINGS
@given(graphs())
def test_grad_of_grad_matches_torch_double_backward(graph):
    nodes, outputs = graph
    # PyTorch writes tanh's derivative with tanh's saved output, so its double
    # backward also reaches a hook on that output through the derivative itself,
    # which JAX's rule for tanh does not (docs/semantics.md, "Second order").
    assume(not any(node.op == "tanh" and node.hooks for node in nodes))
    v = np.array([1.0, -2.0, 0.5])
    x = torch.tensor(X0, dtype=torch.float64, requires_grad=True)
    out = run_torch(nodes, outputs, torch.tensor(W), x, [])
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    if not g.requires_grad:  # the first gradient does not depend on x
        expected = np.zeros(3)
    else:
        (gg,) = torch.autograd.grad((g * torch.tensor(v)).sum(), x, allow_unused=True)
        expected = np.zeros(3) if gg is None else gg.numpy()
    f = run_jax(nodes, outputs, jnp.asarray(W, jnp.float32), [])
    second = jax.grad(lambda x: jnp.sum(jax.grad(f)(x) * jnp.asarray(v, jnp.float32)))
    got = jax.jit(second)(jnp.asarray(X0, jnp.float32))
    np.testing.assert_allclose(got, expected, rtol=5e-4, atol=5e-5)

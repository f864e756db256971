"""The hook tests of PyTorch's `test/test_autograd.py`, case by case, on jhooks.

Each test is named `test_autograd_TestAutograd_<case>` after the PyTorch test it
translates and computes its expected values by running PyTorch 2.13. Cases that cannot
be translated are listed with their reason in docs/pytorch.md.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks


def test_autograd_TestAutograd_test_grad_nonleaf_many_outputs(maybe_jit):
    # Gradients with respect to intermediates do not reach the hook on what made them.
    x_t = torch.randn(4, 2, requires_grad=True)
    a_t, b_t = x_t.chunk(2)
    t_called = []
    x_t.register_hook(lambda g: t_called.append(1))
    go = torch.randn(2, 2)
    ga_t, gb_t = torch.autograd.grad(a_t + 2 * b_t, [a_t, b_t], grad_outputs=go)

    called = []
    x = jhooks.register_hook(jnp.asarray(x_t.detach().numpy()), lambda g: called.append(1))
    a, b = jnp.split(x, 2)
    _, vjp = jax.vjp(lambda a, b: a + 2 * b, a, b)
    ga, gb = maybe_jit(vjp)(jnp.asarray(go.numpy()))
    np.testing.assert_allclose(ga, ga_t.numpy())
    np.testing.assert_allclose(gb, gb_t.numpy())
    assert called == t_called == []


def test_autograd_TestAutograd_test_grad_nonleaf_register_hook(maybe_jit):
    x_np = np.random.default_rng(0).normal(size=5).astype(np.float32)
    x_t = torch.tensor(x_np, requires_grad=True)
    x_list = x_t.unbind()
    t_seen = []
    x_list[0].register_hook(t_seen.append)
    for i in range(5):
        x_list[i].backward()

    seen = []

    def element(x, i):
        x0, *rest = jnp.split(x, 5)
        x0 = jhooks.register_hook(x0, jhooks.host(seen.append))
        return jnp.concatenate([x0, *rest])[i]

    for i in range(5):
        g = maybe_jit(jax.grad(lambda x, i=i: element(x, i)))(jnp.asarray(x_np))
        jax.block_until_ready(g)
        assert x_t.grad is not None
        np.testing.assert_array_equal(g, np.eye(5, dtype=np.float32)[i])
    # PyTorch calls the hook with 1.0, then with None for each backward pass that reaches
    # the node of unbind but not x_list[0]. JAX's transpose of the concatenation gives
    # x0 an explicit zero, which it cannot tell from a computed one: the hook gets 0.0
    # (docs/semantics.md, "Where JAX cannot know").
    assert [None if g is None else float(g) for g in t_seen] == [1.0, None, None, None, None]
    assert [float(g[0]) for g in seen] == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_autograd_TestAutograd_test_hook_with_no_name(maybe_jit):
    class MyHookClass:  # a hook without __name__
        def __call__(self, grad):
            return grad * 1.0

    x_t = torch.randn(5, requires_grad=True)
    y_t = x_t.clone()
    y_t.register_hook(MyHookClass())
    y_t.sum().backward()

    def loss(x):
        return jnp.sum(jhooks.register_hook(x * 1.0, MyHookClass()))

    assert x_t.grad is not None
    np.testing.assert_array_equal(maybe_jit(jax.grad(loss))(jnp.ones(5)), x_t.grad.numpy())


def test_autograd_TestAutograd_test_retains_grad_can_always_observe_tensor_prehook(maybe_jit):
    double = lambda g: g * 2  # noqa: E731

    expected = []
    for hooks_before in (1, 0):
        a = torch.tensor(1.0, requires_grad=True)
        b = a.clone()
        if hooks_before:
            b.register_hook(double)
        b.retain_grad()
        b.register_hook(double)
        b.clone().backward()
        assert b.grad is not None
        expected.append(b.grad.item())

    got = []
    for hooks_before in (1, 0):

        def loss(a, hooks_before=hooks_before):
            b = a * 1.0
            if hooks_before:
                b = jhooks.register_hook(b, double)
            b = jhooks.retain_grad(b, "b")
            b = jhooks.register_hook(b, double)
            return b * 1.0

        _, retained = maybe_jit(jhooks.grad(loss))(jnp.float32(1.0))
        got.append(float(retained["b"]))
    assert got == expected == [4.0, 2.0]


def test_autograd_TestAutograd_test_accumulate_grad_posthooks_should_not_execute(maybe_jit):
    # The tensor hook on a is not run by a backward pass that asks for b's gradient
    # only (PyTorch's AccumulateGrad post-hook part has no JAX counterpart).
    def boom(g):
        raise RuntimeError("must not run")

    a_t, b_t = torch.tensor(1.0, requires_grad=True), torch.tensor(1.0, requires_grad=True)
    a_t.register_hook(boom)
    (a_t + b_t + a_t.clone()).sum().backward(inputs=[b_t])
    assert b_t.grad is not None

    def loss(a, b):
        a = jhooks.register_hook(a, boom)
        return a + b + a * 1.0

    g = maybe_jit(jax.grad(loss, argnums=1))(jnp.float32(1.0), jnp.float32(1.0))
    np.testing.assert_array_equal(g, b_t.grad.numpy())


def test_autograd_TestAutograd_test_hooks(maybe_jit):
    x_np, y_np = np.ones((5, 5), np.float32), np.full((5, 5), 4.0, np.float32)

    def torch_run(z_hooks, y_hooks):
        x, y = torch.tensor(x_np, requires_grad=True), torch.tensor(y_np, requires_grad=True)
        counter = [0]
        z = x**2 + x * 2 + x * y + y
        x.register_hook(lambda g: None)
        for h in z_hooks:
            z.register_hook(h(counter))
        for h in y_hooks:
            y.register_hook(h(counter))
        z.backward(torch.ones(5, 5))
        assert y.grad is not None
        return counter[0], y.grad.numpy()

    def jhooks_run(z_hooks, y_hooks):
        counter = [0]

        def loss(x, y):
            for h in y_hooks:
                y = jhooks.register_hook(y, h(counter))
            z = x**2 + x * 2 + x * y + y
            for h in z_hooks:
                z = jhooks.register_hook(z, h(counter))
            return jnp.sum(z)

        gy = maybe_jit(jax.grad(loss, argnums=1))(jnp.asarray(x_np), jnp.asarray(y_np))
        return counter[0], np.asarray(gy)

    def count(inc):
        def make(counter):
            def hook(grad):
                counter[0] += inc

            return hook

        return make

    def modify(counter):
        return lambda g: g * 2

    for z_hooks, y_hooks in [
        ([count(1)], []),
        ([count(1), count(2)], []),
        ([modify], []),
        ([modify], [modify]),
    ]:
        t_count, t_gy = torch_run(z_hooks, y_hooks)
        j_count, j_gy = jhooks_run(z_hooks, y_hooks)
        assert j_count == t_count
        np.testing.assert_allclose(j_gy, t_gy)


def _mul2_node():
    return jhooks.Node(lambda x: x * 2)


def test_autograd_TestAutograd_test_grad_fn_prehooks(maybe_jit):
    t_seen, j_seen = [], []

    def hooks(seen, counter):
        def posthook(grad_input, grad_output):  # returns None: the same as grad_input
            seen.append((counter[0], np.asarray(grad_output[0]), np.asarray(grad_input[0])))

        def prehook(grad_output):
            counter[0] += 1
            return (grad_output[0] * 2,)

        return posthook, prehook

    a_t = torch.tensor([1.0], requires_grad=True)
    b_t = a_t * 2
    counter_t = [0]
    post, pre = hooks(t_seen, counter_t)
    assert b_t.grad_fn is not None
    for register, hook in [
        (b_t.grad_fn.register_hook, post),
        (b_t.grad_fn.register_hook, post),
        (b_t.grad_fn.register_prehook, pre),
        (b_t.grad_fn.register_prehook, lambda x: None),
        (b_t.grad_fn.register_prehook, pre),
        (b_t.grad_fn.register_prehook, pre),
        (b_t.grad_fn.register_prehook, lambda x: x),
        (b_t.grad_fn.register_prehook, lambda x: None),
    ]:
        register(hook)
    b_t.sum().backward()

    node, counter = _mul2_node(), [0]
    post, pre = hooks(j_seen, counter)
    post = jhooks.host(post)  # it reads values: on the host, every step
    for register, hook in [
        (node.register_hook, post),
        (node.register_hook, post),
        (node.register_prehook, pre),
        (node.register_prehook, lambda x: None),
        (node.register_prehook, pre),
        (node.register_prehook, pre),
        (node.register_prehook, lambda x: x),
        (node.register_prehook, lambda x: None),
    ]:
        register(hook)
    g = maybe_jit(jax.grad(lambda a: jnp.sum(node(a))))(jnp.ones(1))
    jax.block_until_ready(g)
    assert a_t.grad is not None
    np.testing.assert_allclose(g, a_t.grad.numpy())  # 16
    assert counter == counter_t == [3]  # the pre-hooks are traced once, before the posthooks
    assert len(j_seen) == len(t_seen) == 2
    for (_, jgo, jgi), (tc, tgo, tgi) in zip(j_seen, t_seen):
        assert tc == 3
        np.testing.assert_allclose(jgo, tgo)  # 8
        np.testing.assert_allclose(jgi, tgi)  # 16


def test_autograd_TestAutograd_test_grad_fn_prehooks_multiple_outputs(maybe_jit):
    b_np = np.random.default_rng(0).random((3, 3)).astype(np.float32)
    b_t = torch.tensor(b_np, requires_grad=True)
    var, mean = torch.var_mean(b_t, dim=0)
    (var + mean).sum().backward()
    a_t = torch.tensor(b_np, requires_grad=True)
    var, mean = torch.var_mean(a_t, dim=0)
    assert mean.grad_fn is not None
    mean.grad_fn.register_prehook(lambda go: (go[0] * 2, go[1] * 2))
    (var + mean).sum().backward()

    counter = [0]
    node = jhooks.Node(lambda b: (jnp.var(b, axis=0, ddof=1), jnp.mean(b, axis=0)))

    def prehook(go):
        counter[0] += 1
        return (go[0] * 2, go[1] * 2)

    node.register_prehook(prehook)
    g = maybe_jit(jax.grad(lambda b: jnp.sum(sum(node(b)))))(jnp.asarray(b_np))
    assert a_t.grad is not None and b_t.grad is not None
    np.testing.assert_allclose(g, a_t.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, 2 * b_t.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert counter == [1]

    # A node with a non-differentiable output: its grad_output entry is None.
    k = 3
    seen = []
    double_mul2 = jhooks.Node(lambda x, a, y: (a * x * 2, a, a * y * 2))

    def prehook2(go):
        seen.append(go[1] is None)
        return (go[0] * 2, None, go[2] * 2)

    double_mul2.register_prehook(prehook2)

    def loss(a, b):
        c, _, d = double_mul2(a, k, b)
        return jnp.sum(c + d)

    ga, gb = maybe_jit(jax.grad(loss, argnums=(0, 1)))(jnp.ones((3, 3)), jnp.ones((3, 3)))
    np.testing.assert_allclose(ga, np.full((3, 3), 4.0 * k))  # PyTorch's 4 * k
    np.testing.assert_allclose(gb, np.full((3, 3), 4.0 * k))
    assert seen == [True]


def test_autograd_TestAutograd_test_grad_fn_prehooks_remove_hooks(maybe_jit):
    # Removing a handle before the backward pass.
    node, counter = _mul2_node(), [0]

    def prehook(go):
        counter[0] += 1

    handle = node.register_prehook(prehook)
    node.register_prehook(prehook)
    handle.remove()
    g = maybe_jit(jax.grad(lambda a: jnp.sum(node(a))))(jnp.ones((3, 3)))
    np.testing.assert_allclose(g, np.full((3, 3), 2.0))
    assert counter == [1]

    # Removing handles during the backward pass: the hooks of this pass still run.
    node, counter = _mul2_node(), [0]

    def prehook1(go):
        handle2.remove()
        handle3.remove()  # removing one already removed is fine

    def prehook2(go):
        counter[0] += 1

    node.register_prehook(prehook1)
    handle2 = node.register_prehook(prehook2)
    handle3 = node.register_prehook(prehook2)
    handle3.remove()
    g = jax.grad(lambda a: jnp.sum(node(a)))(jnp.ones((3, 3)))
    np.testing.assert_allclose(g, np.full((3, 3), 2.0))
    assert counter == [1]

    a_t = torch.rand(3, 3, requires_grad=True)
    b_t = a_t * 2
    t_counter = [0]
    assert b_t.grad_fn is not None
    b_t.grad_fn.register_prehook(lambda go: (h2.remove(), h3.remove(), None)[-1])
    h2 = b_t.grad_fn.register_prehook(lambda go: t_counter.__setitem__(0, t_counter[0] + 1))
    h3 = b_t.grad_fn.register_prehook(lambda go: t_counter.__setitem__(0, t_counter[0] + 1))
    h3.remove()
    b_t.sum().backward()
    assert t_counter == counter


def test_autograd_TestAutograd_test_hooks_cpp(maybe_jit):
    bn = torch.nn.BatchNorm1d(5, affine=False).eval()
    x_t = torch.ones(5, 5, requires_grad=True)
    z_t = bn(x_t)
    counter_t = [0]

    def bw_hook(counter):
        def hook(grad):
            counter[0] += 1
            return grad * 2

        return hook

    z_t.register_hook(bw_hook(counter_t))
    z_t.sum().backward()

    counter = [0]

    def loss(x):  # BatchNorm1d in eval mode: running mean 0, variance 1
        z = (x - 0.0) / jnp.sqrt(1.0 + bn.eps)
        return jnp.sum(jhooks.register_hook(z, bw_hook(counter)))

    g = maybe_jit(jax.grad(loss))(jnp.ones((5, 5)))
    assert x_t.grad is not None
    np.testing.assert_allclose(g, x_t.grad.numpy(), rtol=1e-6)
    assert counter == counter_t == [1]


def test_autograd_TestAutograd_test_hook_none(maybe_jit):
    # A function whose backward gives no gradient for its second input: the hooks on
    # both outputs still get a gradient, not None.
    @jax.custom_vjp
    def none_gradient(x, y):
        return x, y

    none_gradient.defvjp(lambda x, y: ((x, y), None), lambda _, g: (g[0], jnp.zeros_like(g[1])))

    seen = []

    def hook(grad):
        seen.append(grad is not None)

    def loss(x, y):
        rx, ry = none_gradient(x, y)
        rx = jhooks.register_hook(rx, hook)
        ry = jhooks.register_hook(ry, hook)
        return jnp.sum(rx + ry)

    x_np, y_np = np.ones((5, 5), np.float32), np.ones((5, 5), np.float32)
    g = maybe_jit(jax.grad(loss, argnums=(0, 1)))(x_np, y_np)
    np.testing.assert_allclose(g[0], np.ones((5, 5)))

    class NoneGradientFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x, y

        @staticmethod
        def backward(ctx, grad_x, grad_y):
            return grad_x, None

    t_seen = []
    x_t, y_t = torch.tensor(x_np, requires_grad=True), torch.tensor(y_np)
    rx, ry = NoneGradientFunction.apply(x_t, y_t)  # type: ignore[misc]
    rx.register_hook(lambda g: t_seen.append(g is not None))
    ry.register_hook(lambda g: t_seen.append(g is not None))
    (rx + ry).sum().backward()
    assert seen == t_seen == [True, True]


def test_autograd_TestAutograd_test_retain_grad(maybe_jit):
    # PyTorch also accumulates .grad over two backward passes; JAX returns gradients.
    inp_np = np.random.default_rng(0).random((1, 3)).astype(np.float32)
    inp_t = torch.tensor(inp_np, requires_grad=True)
    h1_t = inp_t * 3
    h1_t.retain_grad()
    h1_t.retain_grad()
    inp_t.retain_grad()  # a no-op on a leaf
    (h1_t * h1_t).sum().backward()

    def loss(inp):
        inp = jhooks.retain_grad(inp, "input")
        h1 = jhooks.retain_grad(inp * 3, "h1")
        h1 = jhooks.retain_grad(h1, "h1")
        return jnp.sum(h1 * h1)

    grads, retained = maybe_jit(jhooks.grad(loss))(jnp.asarray(inp_np))
    assert h1_t.grad is not None and inp_t.grad is not None
    np.testing.assert_allclose(retained["h1"], h1_t.grad.numpy(), rtol=1e-6)  # h1 * 2
    np.testing.assert_allclose(retained["input"], inp_t.grad.numpy(), rtol=1e-6)  # input * 18
    np.testing.assert_allclose(grads, inp_t.grad.numpy(), rtol=1e-6)


def test_autograd_TestAutograd_test_requires_grad(maybe_jit):
    # Hooks on values that do not require grad are not called.
    def error(grad):
        raise RuntimeError("must not run")

    def loss(x, y, z):
        x, y = jhooks.register_hook(x, error), jhooks.register_hook(y, error)
        a = jhooks.register_hook(x + y, error)
        return jnp.sum(a + z)

    x, y, z = (jnp.full((5, 5), v) for v in (1.0, 2.0, 3.0))
    np.testing.assert_array_equal(maybe_jit(jax.grad(loss, argnums=2))(x, y, z), np.ones((5, 5)))
    x_t, y_t = torch.randn(5, 5), torch.randn(5, 5)
    z_t = torch.randn(5, 5, requires_grad=True)
    a_t = x_t + y_t
    assert not a_t.requires_grad
    (a_t + z_t).backward(torch.ones(5, 5))
    assert z_t.grad is not None
    np.testing.assert_array_equal(np.ones((5, 5)), z_t.grad.numpy())


def test_autograd_TestAutograd_test_return_leaf(maybe_jit):
    # A hook on an output that is one of the inputs gets only that output's gradient.
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a, a + b

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            return grad_a + grad_b, grad_b

    x_np = np.random.default_rng(0).random((5, 5)).astype(np.float32)
    x_t, y_t = torch.tensor(x_np, requires_grad=True), torch.tensor(x_np, requires_grad=True)
    q_t, p_t = Identity.apply(x_t, y_t)  # type: ignore[misc]
    t_seen = []
    q_t.register_hook(lambda g: t_seen.append(g.numpy().copy()))
    (q_t + p_t + x_t).sum().backward()

    seen = []

    def loss(x, y):
        q, p = x, x + y
        q = jhooks.register_hook(q, jhooks.host(seen.append))
        return jnp.sum(q + p + x)

    gx, gy = maybe_jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x_np), jnp.asarray(x_np))
    jax.block_until_ready(gx)
    assert x_t.grad is not None and y_t.grad is not None
    np.testing.assert_allclose(gx, x_t.grad.numpy())  # 3
    np.testing.assert_allclose(gy, y_t.grad.numpy())  # 1
    np.testing.assert_allclose(seen[0], t_seen[0])  # ones

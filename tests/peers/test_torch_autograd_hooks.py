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


def test_autograd_TestAutograd_test_checkpointing_without_reentrant_parameter_used_in_an_out(
    maybe_jit,
):
    # A hook on w runs once, with w used both outside and inside a checkpoint.
    w_np = np.random.default_rng(0).random((3, 3)).astype(np.float32)
    x_np = np.random.default_rng(1).random((3, 3)).astype(np.float32)
    w_t, x_t = torch.tensor(w_np, requires_grad=True), torch.tensor(x_np, requires_grad=True)
    t_count = [0]
    w_t.register_hook(lambda g: t_count.__setitem__(0, t_count[0] + 1))
    h_t = w_t * x_t
    out_t = torch.utils.checkpoint.checkpoint(lambda x: w_t * x, h_t, use_reentrant=False)
    out_t.sum().backward()

    count = [0]

    def loss(w, x):
        w = jhooks.register_hook(w, lambda g: count.__setitem__(0, count[0] + 1))
        return jnp.sum(jax.checkpoint(lambda h: w * h)(w * x))

    gw = maybe_jit(jax.grad(loss))(jnp.asarray(w_np), jnp.asarray(x_np))
    assert w_t.grad is not None
    np.testing.assert_allclose(gw, w_t.grad.numpy(), rtol=1e-6)
    assert count == t_count == [1]


def test_autograd_TestAutograd_test_reentrant_with_non_leaf_variable_hook(maybe_jit):
    # A hook that computes a gradient of its own (PyTorch: a reentrant backward).
    p_np = np.random.default_rng(0).random(4).astype(np.float32)
    param_t = torch.tensor(p_np, requires_grad=True)

    def manual_increase_gradient(grad):
        with torch.enable_grad():
            g = grad.detach().requires_grad_()
            ((g * 2) + 5).sum().backward()
        assert g.grad is not None
        return g.grad + grad

    tmp_t = param_t * param_t
    tmp_t.register_hook(manual_increase_gradient)
    tmp_t.sum().backward()

    def hook(grad):
        return jax.grad(lambda g: jnp.sum(g * 2 + 5))(grad) + grad

    def loss(param):
        return jnp.sum(jhooks.register_hook(param * param, hook))

    g = maybe_jit(jax.grad(loss))(jnp.asarray(p_np))
    assert param_t.grad is not None
    np.testing.assert_allclose(g, param_t.grad.numpy(), rtol=1e-6)  # 6 * param


def test_autograd_TestAutograd_test_full_backward_hook_double_backward(maybe_jit):
    import equinox as eqx

    class MSE(eqx.Module):
        def __call__(self, a, b):
            return jnp.mean((a - b) ** 2)

    x_np, y_np = np.array([0.7], np.float32), np.array([0.3], np.float32)
    x_t = torch.tensor(x_np, requires_grad=True)
    func, t_counter = torch.nn.MSELoss(), [0]
    func.register_full_backward_hook(lambda m, gi, go: t_counter.__setitem__(0, t_counter[0] + 1))
    (gx_t,) = torch.autograd.grad(func(x_t, torch.tensor(y_np)), x_t, create_graph=True)
    t_after_first = t_counter[0]
    (ggx_t,) = torch.autograd.grad(gx_t, x_t)

    m, counter = jhooks.hookable(MSE()), [0]
    m.register_full_backward_hook(lambda mod, gi, go: counter.__setitem__(0, counter[0] + 1))
    first = jax.grad(lambda x: m(x, jnp.asarray(y_np)))
    np.testing.assert_allclose(maybe_jit(first)(jnp.asarray(x_np)), gx_t.detach().numpy())
    assert counter[0] == t_after_first == 1
    counter[0] = 0
    second = maybe_jit(jax.grad(lambda x: jnp.sum(first(x))))(jnp.asarray(x_np))
    np.testing.assert_allclose(second, ggx_t.numpy())
    assert counter[0] == t_counter[0] - t_after_first + 1  # once, for the inner backward


def _multi_grad_inputs():
    return [np.random.default_rng(i).random(2).astype(np.float32) for i in range(4)]


def test_autograd_TestAutograd_test_multi_grad_all_hooks(maybe_jit):
    # PyTorch: four values made by different kinds of node (the C++ custom op of the
    # peer test, built with load_inline, is a plain op here); a multi-grad hook over
    # them; backward passes with respect to some of them only.
    class Foo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, gO):
            return gO

    arrays = _multi_grad_inputs()
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    t1 = leaves[0].mul(2)
    t2 = Foo.apply(leaves[1])
    t3 = torch._C._functions.UndefinedGrad()(leaves[2])
    t4 = leaves[3].clone()
    t_res, t_count = [None], [0]

    def t_hook(grads):
        t_count[0] += 1
        t_res[0] = [g is not None for g in grads]

    handle = torch.autograd.graph.register_multi_grad_hook((t1, t2, t3, t4), t_hook)
    out = t2 * t3
    expected = []
    for inputs in [(t2, t3), (t1, t4), (t1, t3)]:
        out.sum().backward(inputs=inputs, retain_graph=True)
        expected.append((t_count[0], t_res[0]))
    handle.remove()
    out.sum().backward(inputs=(t1, t3), retain_graph=True)
    expected.append((t_count[0], t_res[0]))

    res, count = [None], [0]

    def hook(grads):
        count[0] += 1
        res[0] = [g is not None for g in grads]

    def loss(t1, t2, t3, t4, hooked=True):
        if hooked:
            t1, t2, t3, t4 = jhooks.register_multi_grad_hook((t1, t2, t3, t4), hook)
        return jnp.sum(t2 * t3)

    made = [jnp.asarray(a) * 2 if i == 0 else jnp.asarray(a) for i, a in enumerate(arrays)]
    got = []
    for argnums in [(1, 2), (0, 3), (0, 2)]:
        jax.block_until_ready(maybe_jit(jax.grad(loss, argnums=argnums))(*made))
        got.append((count[0], res[0]))
    jax.grad(lambda *a: loss(*a, hooked=False), argnums=(0, 2))(*made)  # "removed"
    got.append((count[0], res[0]))
    assert got == expected
    assert expected[:3] == [
        (1, [False, True, True, False]),
        (1, [False, True, True, False]),
        (2, [False, False, True, False]),
    ]

    # A backward that raises before the values' gradients are ready: no call.
    @jax.custom_vjp
    def fails(x):
        return x

    def fails_bwd(_, g):
        raise RuntimeError("error message")

    fails.defvjp(lambda x: (x, None), fails_bwd)

    def failing(t2, t3):
        t2, t3 = jhooks.register_multi_grad_hook((t2, t3), hook)
        return jnp.sum(fails(t2) * t3)

    import pytest

    with pytest.raises(RuntimeError, match="error message"):
        jax.grad(failing, argnums=(0, 1))(made[1], made[2])
    assert count[0] == 2


def test_autograd_TestAutograd_test_multi_grad_any_hooks():
    # Per module: a tensor hook on z and an "any" multi-grad hook on (sin z, cos z);
    # the any-hook runs once, before z's hook, and the second module's first.
    order_t = []

    class TorchMultiOutput(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.base = base

        def forward(self, x):
            z = self.lin(x)
            out = torch.sin(z), torch.cos(z)
            z.register_hook(lambda *a: order_t.append(self.base))
            torch.autograd.graph.register_multi_grad_hook(
                out, lambda *a: order_t.append(self.base + 1), mode="any"
            )
            return out

    mod1, mod2 = TorchMultiOutput(0), TorchMultiOutput(2)
    inp = torch.randn(2, 3)
    y = mod1(inp)
    out = mod2(y[0] + y[1])
    (out[0] + out[1]).sum().backward()

    order = []

    def multi_output(lin, base, x):
        z = jhooks.register_hook(x @ lin[0].T + lin[1], jhooks.host(lambda g: order.append(base)))
        return jhooks.register_multi_grad_hook(
            (jnp.sin(z), jnp.cos(z)), jhooks.host(lambda g: order.append(base + 1)), mode="any"
        )

    def loss(l1, l2, x):
        y = multi_output(l1, 0, x)
        out = multi_output(l2, 2, y[0] + y[1])
        return jnp.sum(out[0] + out[1])

    lins = [
        tuple(jnp.asarray(p.detach().numpy()) for p in (m.lin.weight, m.lin.bias))
        for m in (mod1, mod2)
    ]
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(*lins, inp.numpy()))
    assert order == order_t == [3, 2, 1, 0]


def test_autograd_TestAutograd_test_multi_grad_hooks_invalid_mode():
    import pytest

    with pytest.raises(ValueError, match=r"Expects mode to be one of \('all', 'any'\)"):
        torch.autograd.graph.register_multi_grad_hook(
            (torch.rand(2, requires_grad=True),), lambda _: None, mode="foo"
        )
    with pytest.raises(ValueError, match='mode must be "all" or "any", got \'foo\''):
        jhooks.register_multi_grad_hook((jnp.ones(2),), lambda _: None, mode="foo")  # type: ignore[arg-type]


def _in_threads(fn, n=3):
    """Runs `fn(i)` in `n` Python threads at once (PyTorch's test runs 5); returns the
    errors they raised."""
    import threading

    errors: list[BaseException] = []

    def run(i):
        try:
            fn(i)
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _threaded_recorder(mode):
    """A lock, a record and a multi-grad hook that counts its calls (and, with
    `mode="all"`, which values got a gradient) from any thread."""
    import threading

    lock = threading.Lock()
    result = {"count": 0, "seen": set()}

    def hook(grads):
        with lock:
            result["count"] += 1
            if mode == "all":
                result["seen"].add(tuple(g is not None for g in grads))

    return lock, result, hook


def _torch_threaded_multi_grad(mode):
    """PyTorch's threaded case: count, what the hook saw, errors (one backward raises)."""
    lock, result, hook = _threaded_recorder(mode)
    ts = [torch.tensor(a, requires_grad=True) for a in _multi_grad_inputs()]
    handle = torch.autograd.graph.register_multi_grad_hook(ts, hook, mode=mode)
    out = (ts[1] * ts[2]).sum()
    _in_threads(lambda i: out.backward(inputs=(ts[1], ts[2]), retain_graph=True))
    first = (result["count"], sorted(result["seen"]))
    result.update(count=0, seen=set())
    calls = [0]

    class Func(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, gO):
            with lock:
                calls[0] += 1
                if calls[0] == 1:
                    raise RuntimeError("error message")
            return gO

    out = (Func.apply(ts[1]) * ts[2]).sum()  # type: ignore[operator]
    errors = _in_threads(lambda i: out.backward(inputs=(ts[1], ts[2]), retain_graph=True))
    handle.remove()
    return first, (result["count"], sorted(result["seen"]), len(errors))


def _jhooks_threaded_multi_grad(mode):
    lock, result, hook = _threaded_recorder(mode)
    made = [jnp.asarray(a) for a in _multi_grad_inputs()]

    def loss(t1, t2, t3, t4, fails=None):
        t1, t2, t3, t4 = jhooks.register_multi_grad_hook((t1, t2, t3, t4), hook, mode=mode)
        return jnp.sum((t2 if fails is None else fails(t2)) * t3)

    _in_threads(lambda i: jax.grad(loss, argnums=(1, 2))(*made))
    first = (result["count"], sorted(result["seen"]))
    result.update(count=0, seen=set())
    calls = [0]

    @jax.custom_vjp
    def fails(x):
        return x

    def fails_bwd(_, g):
        with lock:
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("error message")
        return (g,)

    fails.defvjp(lambda x: (x, None), fails_bwd)
    errors = _in_threads(lambda i: jax.grad(loss, argnums=(1, 2))(*made, fails=fails))
    return first, (result["count"], sorted(result["seen"]), len(errors))


def test_autograd_TestMultithreadAutograd_test_multi_grad_all_hooks():
    # Each backward pass, in its own thread, calls the hook once; one that raises, none.
    expected = _torch_threaded_multi_grad("all")
    assert _jhooks_threaded_multi_grad("all") == expected
    assert expected == ((3, [(False, True, True, False)]), (2, [(False, True, True, False)], 1))


def test_autograd_TestMultithreadAutograd_test_multi_grad_any_hooks():
    # PyTorch runs the "any" hook as soon as t3's gradient arrives, before the backward
    # that raises; jhooks runs it once the pass has every gradient (docs/semantics.md,
    # `mode="any"`), so the pass that raises calls no hook.
    t_first, t_second = _torch_threaded_multi_grad("any")
    first, second = _jhooks_threaded_multi_grad("any")
    assert first == t_first == (3, [])
    assert t_second == (3, [], 1)
    assert second == (2, [], 1)

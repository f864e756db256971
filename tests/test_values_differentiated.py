"""A value that is not differentiated gets no gradient: what hooks over several values are
told, against PyTorch's `requires_grad`, under jit, vmap, scan and grad of grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

ones = np.ones(3, np.float32)


def torch_received(which):
    """PyTorch: a multi-grad hook over four leaves, `torch.autograd.grad` with respect
    to those `which` selects only: which of the four the hook got a gradient for."""
    ts = [torch.tensor(ones * (i + 1), requires_grad=True) * 1.0 for i in range(4)]
    seen = []
    torch.autograd.graph.register_multi_grad_hook(
        ts, lambda grads: seen.append([g is not None for g in grads])
    )
    loss = (ts[0] * ts[1] * ts[2] * ts[3]).sum()
    loss.backward(inputs=[t for t, w in zip(ts, which) if w])
    return seen


def product(a, b, c, d):
    return jnp.sum(a * b * c * d)


def received_by(fn):
    seen = []

    def loss(a, b, c, d):
        a, b, c, d = jhooks.register_multi_grad_hook(
            (a, b, c, d), jhooks.host(lambda grads: seen.append([g is not None for g in grads]))
        )
        return fn(a, b, c, d)

    return loss, seen


def args():
    return [jnp.asarray(ones * (i + 1)) for i in range(4)]


@pytest.mark.parametrize("which", [(False, False, True, False), (True, False, False, True)])
def test_multi_grad_all_tells_which_values_got_a_gradient(which, maybe_jit):
    loss, seen = received_by(product)
    argnums = tuple(i for i, w in enumerate(which) if w)
    jax.block_until_ready(maybe_jit(jax.grad(loss, argnums=argnums))(*args()))
    assert seen == torch_received(which) == [list(which)]


def test_multi_grad_all_under_vmap_scan_and_grad_of_grad():
    expected = torch_received((False, False, True, False))[0]

    def scanned(a, b, c, d):
        def body(carry, _):
            return carry + product(a, b, c, d), None

        return jax.lax.scan(body, 0.0, None, length=2)[0]

    loss, seen = received_by(scanned)
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=2))(*args()))
    assert seen == [expected]  # the hook is outside the scan: called once

    loss, seen = received_by(product)
    a, b, c, d = args()
    batched = jax.vmap(jax.grad(loss, argnums=2), in_axes=(None, None, 0, None))
    jax.block_until_ready(batched(a, b, jnp.stack([c, c]), d))
    assert seen and all(s == expected for s in seen)

    seen.clear()
    hessian_row = jax.grad(lambda c: jnp.sum(jax.grad(loss, argnums=2)(a, b, c, d) ** 2))
    jax.block_until_ready(hessian_row(c))
    assert seen and all(s == expected for s in seen)


def test_multi_grad_all_inside_scan_sees_none_for_the_values_not_differentiated(maybe_jit):
    seen = []

    def loss(a, c):
        def body(carry, x):
            x, cc = jhooks.register_multi_grad_hook(
                (x, c), jhooks.host(lambda grads: seen.append([g is not None for g in grads]))
            )
            return carry + jnp.sum(x * cc), None

        return jax.lax.scan(body, 0.0, a)[0]

    jax.block_until_ready(maybe_jit(jax.grad(loss, argnums=1))(jnp.ones((2, 3)), jnp.ones(3)))
    assert seen == [[False, True]] * 2


def test_multi_grad_all_not_called_when_none_of_its_values_is_differentiated(maybe_jit):
    # PyTorch: a and b require grad, but the backward pass asks for w's gradient only.
    t_calls = []
    a, b, w = (torch.tensor(ones, requires_grad=True) * 1.0 for _ in range(3))
    w.retain_grad()
    torch.autograd.graph.register_multi_grad_hook((a, b), lambda grads: t_calls.append(1))
    ((a * w).sum() + (b * w).sum()).backward(inputs=[w])
    assert t_calls == []

    calls = []

    def loss(a, b, w):
        # A sibling in one pytree hook that is differentiated, as w is, once made the
        # tangents of a and b look differentiated too.
        a, b, w = jhooks.register_hook((a, b, w), lambda g: None)
        a, b = jhooks.register_multi_grad_hook((a, b), lambda grads: calls.append(grads))
        return jnp.sum(a * w) + jnp.sum(b * w)

    g = maybe_jit(jax.grad(loss, argnums=2))(*(jnp.asarray(ones) for _ in range(3)))
    assert w.grad is not None
    np.testing.assert_allclose(g, w.grad.numpy())
    assert calls == []


def test_multi_grad_any_gets_the_gradient_of_the_differentiated_value(maybe_jit):
    t_seen = []
    a, c = (torch.tensor(ones, requires_grad=True) * 1.0 for _ in range(2))
    torch.autograd.graph.register_multi_grad_hook(
        (a, c), lambda g: t_seen.append(g.clone()), mode="any"
    )
    ((a * 2.0).sum() + (c * 3.0).sum()).backward(inputs=[c])

    seen = []

    def loss(a, c):
        a, c = jhooks.register_multi_grad_hook((a, c), jhooks.host(seen.append), mode="any")
        return jnp.sum(a * 2.0) + jnp.sum(c * 3.0)

    jax.block_until_ready(maybe_jit(jax.grad(loss, argnums=1))(jnp.asarray(ones), ones))
    (t_g,) = t_seen
    (g,) = seen
    np.testing.assert_allclose(g, t_g.numpy())


def test_node_hook_gets_none_for_an_input_not_differentiated(maybe_jit):
    a_t = torch.tensor(ones, requires_grad=True)
    b_t = torch.tensor(3 * ones)
    out = a_t * b_t
    t_seen = []
    assert out.grad_fn is not None
    out.grad_fn.register_hook(lambda gi, go: t_seen.append(gi))
    out.sum().backward()

    seen = []
    node = jhooks.Node(lambda a, b: a * b)
    node.register_hook(jhooks.host(lambda gi, go: seen.append(gi)))
    grad = maybe_jit(jax.grad(lambda a, b: jnp.sum(node(a, b))))(
        jnp.asarray(ones), jnp.asarray(3 * ones)
    )
    np.testing.assert_allclose(grad, a_t.grad.numpy())
    ((t_ga, t_gb),) = t_seen
    ((ga, gb),) = seen
    assert t_gb is None and gb is None
    np.testing.assert_allclose(ga, t_ga.numpy())


def test_node_hook_return_for_an_input_not_differentiated_is_dropped(maybe_jit):
    node = jhooks.Node(lambda a, b: a * b)
    node.register_hook(lambda gi, go: (gi[0] * 2.0, jnp.full(3, 7.0)))
    loss = lambda a, b: jnp.sum(node(a, b))  # noqa: E731
    np.testing.assert_allclose(
        maybe_jit(jax.grad(loss))(jnp.asarray(ones), jnp.asarray(3 * ones)), 6 * ones
    )


class Scaled(jhooks.Module):
    def __call__(self, x, scale):
        return x * scale


def test_module_full_backward_hook_gets_zeros_through_stop_gradient_as_pytorch(maybe_jit):
    class TScaled(torch.nn.Module):
        def forward(self, x, scale):
            return x * scale

    t_seen = []
    tm = TScaled()
    tm.register_full_backward_hook(lambda m, gi, go: t_seen.append(gi))
    x_t, s_t = torch.tensor(ones, requires_grad=True), torch.tensor(2 * ones, requires_grad=True)
    tm(x_t, s_t.detach()).sum().backward()

    seen = []
    m = Scaled()
    m.register_full_backward_hook(jhooks.host(lambda mod, gi, go: seen.append(gi)))

    def loss(x, s):
        return jnp.sum(m(x, jax.lax.stop_gradient(s)))

    gx, gs = maybe_jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(ones), 2 * ones)
    np.testing.assert_allclose(gx, x_t.grad.numpy())
    np.testing.assert_allclose(gs, np.zeros(3))
    ((t_gx, t_gs),) = t_seen
    ((j_gx, j_gs),) = seen
    # PyTorch's BackwardHook materializes the gradient of an argument that does not
    # require grad as zeros, when another argument does.
    np.testing.assert_array_equal(j_gs, t_gs.numpy())
    np.testing.assert_allclose(j_gx, t_gx.numpy())


def test_module_full_backward_hook_under_vmap_gets_zeros_for_an_unbatched_constant():
    seen = []
    m = Scaled()
    m.register_full_backward_hook(lambda mod, gi, go: seen.append(gi[1]))

    def loss(xs, s):
        return jnp.sum(jax.vmap(m, in_axes=(0, None))(xs, s))

    g = jax.grad(loss)(jnp.ones((2, 3)), 2 * ones)
    np.testing.assert_allclose(g, 2 * np.ones((2, 3)))
    (gs,) = seen
    assert gs.shape == (3,)  # one example's, as the hook is traced once under vmap


def test_retain_grad_twice_under_one_name_is_allowed(maybe_jit):
    x_t = torch.tensor(ones, requires_grad=True)
    y_t = x_t * 2.0
    y_t.retain_grad()
    y_t.retain_grad()
    (y_t**2).sum().backward()

    def loss(x):
        y = jhooks.retain_grad(x * 2.0, "y")
        y = jhooks.retain_grad(y, "y")
        return jnp.sum(y**2)

    _, retained = maybe_jit(jhooks.grad(loss))(jnp.asarray(ones))
    assert y_t.grad is not None
    np.testing.assert_allclose(retained["y"], y_t.grad.numpy())

    def scanned(x):
        def body(c, xi):
            t = jhooks.retain_grad(jhooks.retain_grad(xi * 2.0, "t"), "t")
            return c + t**2, None

        return jax.lax.scan(body, 0.0, x)[0]

    _, retained = maybe_jit(jhooks.grad(scanned))(jnp.asarray(ones))
    np.testing.assert_allclose(retained["t"], y_t.grad.numpy())


def test_retain_grad_one_name_on_two_values_still_refused():
    def loss(x):
        return jnp.sum(jhooks.retain_grad(x * 2.0, "y") + jhooks.retain_grad(x * 3.0, "y"))

    with pytest.raises(ValueError, match="'y' is used twice"):
        jhooks.grad(loss)(jnp.asarray(ones))


def test_where_jax_cannot_know_a_scan_carry_counts_as_differentiated_at_every_step():
    # PyTorch: the carry starts as a constant, so the first step's hook sees None. JAX
    # decides once for the whole scan: the carry is differentiated at every step, and
    # the first step's hook sees a zero gradient (docs/semantics.md).
    seen = []

    def loss(x):
        def body(h, _):
            (h,) = jhooks.register_multi_grad_hook(
                (h,), jhooks.host(lambda grads: seen.append(grads[0] is None))
            )
            return h + x, None

        return jnp.sum(jax.lax.scan(body, jnp.zeros(3), None, length=2)[0])

    jax.block_until_ready(jax.grad(loss)(jnp.asarray(ones)))
    assert seen == [False, False]


def test_where_jax_cannot_know_a_cond_output_counts_as_differentiated_in_every_branch():
    # PyTorch: the branch that ran returns a constant, which does not require grad (a
    # hook cannot even be registered on it). JAX differentiates the cond's output whichever
    # branch runs: the hook sees a (zero-derived) gradient for it, not None.
    seen = []

    def loss(x, pick):
        y = jax.lax.cond(pick, lambda x: x * 2.0, lambda x: jnp.ones(3), x)
        y, z = jhooks.register_multi_grad_hook(
            (y, x * 3.0), jhooks.host(lambda grads: seen.append([g is None for g in grads]))
        )
        return jnp.sum(y * z)

    g = jax.grad(loss)(jnp.asarray(ones), False)
    jax.block_until_ready(g)
    np.testing.assert_allclose(g, 3 * ones)  # the gradient is right
    assert seen == [[False, False]]


class Unused(jhooks.Module):
    def __call__(self, x, s):
        return x * 2.0


def test_module_hook_gets_zeros_for_an_argument_no_gradient_reaches_node_hook_none(maybe_jit):
    class TUnused(torch.nn.Module):
        def forward(self, x, s):
            return x * 2.0

    t_seen = []
    tm = TUnused()
    tm.register_full_backward_hook(lambda m, gi, go: t_seen.append(gi))
    x_t, s_t = (torch.tensor(ones, requires_grad=True) * 1.0 for _ in range(2))
    tm(x_t, s_t).sum().backward()

    seen, node_seen = [], []
    m = Unused()
    m.register_full_backward_hook(jhooks.host(lambda mod, gi, go: seen.append(gi)))
    node = jhooks.Node(lambda x, s: x * 2.0)
    node.register_hook(jhooks.host(lambda gi, go: node_seen.append(gi)))
    for f in (m, node):
        g = maybe_jit(jax.grad(lambda x, s, f=f: jnp.sum(f(x, s)), argnums=(0, 1)))(
            jnp.asarray(ones), jnp.asarray(ones)
        )
        jax.block_until_ready(g)
        np.testing.assert_array_equal(g[1], np.zeros(3))
    ((t_gx, t_gs),) = t_seen
    ((gx, gs),) = seen
    np.testing.assert_allclose(gx, t_gx.numpy())
    np.testing.assert_array_equal(gs, t_gs.numpy())  # zeros, as PyTorch's module hook
    ((_, node_gs),) = node_seen
    assert node_gs is None  # PyTorch's grad_fn hooks: an undefined gradient is None

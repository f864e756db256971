"""The hook primitive at the edges: second order, vmap with unbatched values, leaks."""

import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks


def _torch_double_backward(x0: float, scale: float) -> float:
    x = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    y = x * 1.0
    y.register_hook(lambda g: g * scale)
    (g,) = torch.autograd.grad((y**3).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g, x)
    return gg.item()


def test_second_order_runs_hooks_on_every_backward_pass(maybe_jit):
    # PyTorch runs a value's hooks on every backward pass through it: the first
    # backward, and the second one that differentiates the first.
    def f(x):
        y = jhooks.register_hook(x, lambda g: g * 3.0)
        return y**3

    x0 = 0.7
    expected = _torch_double_backward(x0, 3.0)
    got = maybe_jit(jax.grad(jax.grad(f)))(jnp.float32(x0))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert expected == pytest.approx(3.0 * 3.0 * 6.0 * x0)


def test_first_order_unchanged_by_second_order_support(maybe_jit):
    def f(x):
        return jnp.sum(jhooks.register_hook(x, lambda g: g * 3.0) ** 2)

    x = jnp.arange(3.0)
    np.testing.assert_allclose(maybe_jit(jax.grad(f))(x), 6.0 * x)


def _hooked_pair_product(x):
    y = jhooks.register_hook(jnp.sin(x), lambda g: g * 2.0)
    return jnp.sum(y * y[::-1])


def test_reverse_over_reverse_hessian_matches_torch_double_backward(maybe_jit):
    x0 = np.array([0.3, -0.4, 1.1])
    xt = torch.tensor(x0, requires_grad=True)
    yt = torch.sin(xt)
    yt.register_hook(lambda g: g * 2.0)
    (gt,) = torch.autograd.grad((yt * yt.flip(0)).sum(), xt, create_graph=True)
    rows = [torch.autograd.grad(gt[i], xt, retain_graph=True)[0].numpy() for i in range(3)]
    hessian = maybe_jit(jax.jacrev(jax.jacrev(_hooked_pair_product)))(jnp.asarray(x0))
    np.testing.assert_allclose(hessian, np.stack(rows), rtol=1e-6)


def test_forward_over_reverse_runs_hooks_in_the_reverse_pass_only(maybe_jit):
    # jax.hessian is jacfwd(jacrev(f)): hooks are a no-op in forward mode, so the
    # hook scales only the reverse pass: half of the reverse-over-reverse terms
    # that go through y twice.
    x = jnp.asarray([0.3, -0.4, 1.1])
    plain = jax.hessian(lambda x: jnp.sum(jnp.sin(x) * jnp.sin(x)[::-1]))(x)
    got = maybe_jit(jax.hessian(_hooked_pair_product))(x)
    np.testing.assert_allclose(got, 2.0 * plain, rtol=1e-6)


def _shared_weight_total(clip: float, w0: np.ndarray, xs: np.ndarray) -> np.ndarray:
    # PyTorch: one weight shared by the batch, its hook sees the total gradient.
    w = torch.tensor(w0, requires_grad=True)
    w_hooked = w * 1.0
    w_hooked.register_hook(lambda g: g.clamp(-clip, clip))
    (w_hooked * torch.tensor(xs)).sum().backward()
    assert w.grad is not None
    return w.grad.numpy()


def test_vmap_unbatched_value_hook_sees_total_gradient(maybe_jit):
    w0 = np.array([0.5, -1.0, 2.0], np.float32)
    xs = np.arange(12.0, dtype=np.float32).reshape(4, 3) / 4

    def per_example(w, x):
        w, x = jhooks.register_hook((w, x), lambda g: (jnp.clip(g[0], -1.0, 1.0), g[1]))
        return jnp.sum(w * x)

    def loss(w, xs):
        return jnp.sum(jax.vmap(per_example, in_axes=(None, 0))(w, xs))

    got, got_x = maybe_jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(w0), jnp.asarray(xs))
    np.testing.assert_allclose(got, _shared_weight_total(1.0, w0, xs))
    # The batched value still gets per-example hooks: its gradient is w per example.
    np.testing.assert_allclose(got_x, np.broadcast_to(w0, xs.shape))


def test_vmap_unbatched_value_stays_unbatched_out_axes_none(maybe_jit):
    def f(w, x):
        w, x = jhooks.register_multi_grad_hook((w, x), lambda grads: None)
        return w * 2.0, x + 1.0

    w, xs = jnp.ones(3), jnp.ones((4, 3))
    out_w, out_x = maybe_jit(jax.vmap(f, in_axes=(None, 0), out_axes=(None, 0)))(w, xs)
    assert out_w.shape == (3,) and out_x.shape == (4, 3)


def test_vmap_hook_making_unbatched_gradient_per_example_is_refused():
    def per_example(w, x):
        w, x = jhooks.register_hook((w, x), lambda g: (g[1], g[1]))
        return jnp.sum(w * x)

    def loss(w, xs):
        return jnp.sum(jax.vmap(per_example, in_axes=(None, 0))(w, xs))

    with pytest.raises(ValueError, match="total gradient"):
        jax.grad(loss, argnums=(0, 1))(jnp.ones(3), jnp.ones((4, 3)))


def test_nested_vmap_mixed_batching_matches_loop(maybe_jit):
    # Outer vmap over a, inner over b; c unbatched everywhere. The hook sees the
    # gradient of each value as one example of each vmap it belongs to.
    def f(a, b, c):
        a, b, c = jhooks.register_hook((a, b, c), lambda g: jax.tree.map(jnp.tanh, g))
        return jnp.sum(a * b * c)

    a, b, c = jnp.arange(2.0) + 1, jnp.arange(3.0) + 1, jnp.float32(0.5)

    def loss(a, b, c):
        inner = jax.vmap(f, in_axes=(None, 0, None))
        return jnp.sum(jax.vmap(inner, in_axes=(0, None, None))(a, b, c))

    got = maybe_jit(jax.grad(loss, argnums=(0, 1, 2)))(a, b, c)
    # By hand: for fixed (i, j) the gradient of a_i is b_j c; a is shared over j, so its
    # hook sees sum_j b_j c; b is shared over i, its hook sees sum_i a_i c; c is shared
    # over both and sees sum_ij a_i b_j.
    ga = np.tanh(np.sum(b) * c) * np.ones(2)
    gb = np.tanh(np.sum(a) * c) * np.ones(3)
    gc_ = np.tanh(np.sum(a) * np.sum(b))
    np.testing.assert_allclose(got[0], ga, rtol=1e-6)
    np.testing.assert_allclose(got[1], gb, rtol=1e-6)
    np.testing.assert_allclose(got[2], gc_, rtol=1e-6)


class _Marker:
    pass


def _hooked_loss(refs: list):
    def loss(x):
        marker = _Marker()
        refs.append(weakref.ref(marker))
        y = jhooks.register_hook(jnp.sin(x), lambda g: g * 2.0 if marker else g)
        y = jhooks.retain_grad(y, "y")
        return jnp.sum(y**2)

    return loss


@pytest.mark.parametrize("grad", [jax.grad, lambda f: jhooks.grad(f)], ids=["jax", "jhooks"])
def test_eager_gradients_do_not_keep_traces_alive(grad):
    refs: list = []
    loss = _hooked_loss(refs)
    for _ in range(20):
        grad(loss)(jnp.ones(3))
    gc.collect()
    assert len(refs) >= 20
    assert sum(r() is not None for r in refs) == 0


def _every_kind_of_hook(x, net):
    node = jhooks.Node(lambda a: a * 2.0)
    with node.register_hook(lambda gi, go: (gi[0] * 2,)):
        y = jhooks.register_hook(jnp.sin(x), lambda g: g * 2.0)
        y = jhooks.retain_grad(y, "y")
        y, z = jhooks.register_multi_grad_hook((y, x), lambda grads: None)
        y = node(y + z)
        y = jhooks.hook_point(y, "point")
        return jnp.sum(net(y) ** 2)


def test_no_leaked_tracers_for_any_kind_of_hook(frozen_gc):
    net = jhooks.hookable(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    handles = [
        net.register_forward_pre_hook(lambda m, args: (args[0] * 1.0,)),
        net.register_forward_hook(lambda m, args, out: out + 0.0),
        net.register_full_backward_pre_hook(lambda m, go: (go[0] * 2,)),
        net.register_full_backward_hook(lambda m, gi, go: (gi[0] * 2,)),
        net.register_parameter_hook("bias", lambda g: g * 0.5),
        jhooks.register_module_forward_hook(lambda m, args, out: None),
    ]
    x = jnp.arange(3.0)
    try:
        with jax.checking_leaks():
            jax.jit(jax.grad(_every_kind_of_hook))(x, net)
            jax.grad(_every_kind_of_hook)(x, net)
            jax.jit(jhooks.grad(_every_kind_of_hook))(x, net)
            jax.vmap(jax.grad(_every_kind_of_hook), in_axes=(0, None))(jnp.ones((2, 3)), net)
            jax.grad(lambda x: jnp.sum(jax.vmap(_every_kind_of_hook, (0, None))(x, net)))(
                jnp.ones((2, 3))
            )
            jhooks.run_with_cache(
                lambda x: _every_kind_of_hook(x, net),
                x,
                incl_bwd=True,
            )
            jhooks.run_with_hooks(
                lambda x: _every_kind_of_hook(x, net),
                x,
                fwd_hooks=[("point", lambda v, name: v * 2)],
                bwd_hooks=[("point", lambda g, name: g * 2)],
            )
    finally:
        for h in handles:
            h.remove()

"""`retain_grad` inside `lax.scan`, `lax.cond`, nested `jax.jit` and `jax.checkpoint`
under `jhooks.grad`: stacked along the scan axis, checked against an unrolled loop and
against PyTorch's `retain_grad`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax

import jhooks

L, B, D = 4, 3, 5
rng = np.random.default_rng(0)
W_np = (rng.normal(size=(L, D, D)) / np.sqrt(D)).astype(np.float32)
b_np = (0.1 * rng.normal(size=(L, D))).astype(np.float32)
x_np = rng.normal(size=(B, D)).astype(np.float32)
params = (jnp.asarray(W_np), jnp.asarray(b_np))
x = jnp.asarray(x_np)


def layer(h, w, b):
    return jnp.tanh(h @ w + b)


def scanned_loss(params, x):
    @jax.checkpoint
    def body(h, wb):
        h = jhooks.retain_grad(layer(h, *wb), "h")
        return h, None

    h, _ = lax.scan(body, x, params)
    return jnp.sum(h**2)


def unrolled_loss(params, x):
    w, b = params
    h = x
    for i in range(L):
        h = jhooks.retain_grad(layer(h, w[i], b[i]), f"h{i}")
    return jnp.sum(h**2)


def torch_grads():
    w = torch.tensor(W_np, requires_grad=True)
    b = torch.tensor(b_np, requires_grad=True)
    h = torch.tensor(x_np)
    hs = []
    for i in range(L):
        h = torch.tanh(h @ w[i] + b[i])
        h.retain_grad()
        hs.append(h)
    (h**2).sum().backward()
    return np.stack([h.grad.numpy() for h in hs]), w.grad.numpy(), b.grad.numpy()


def test_scan_over_layers_matches_unrolled_and_torch(maybe_jit):
    (gw, gb), retained = maybe_jit(jhooks.grad(scanned_loss))(params, x)
    assert retained["h"].shape == (L, B, D)

    (uw, ub), unrolled = maybe_jit(jhooks.grad(unrolled_loss))(params, x)
    stacked = jnp.stack([unrolled[f"h{i}"] for i in range(L)])
    np.testing.assert_allclose(retained["h"], stacked, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, uw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gb, ub, rtol=1e-5, atol=1e-6)

    th, tw, tb = torch_grads()
    np.testing.assert_allclose(retained["h"], th, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gw, tw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gb, tb, rtol=1e-4, atol=1e-6)


def test_value_and_grad_with_aux_and_a_retain_at_base(maybe_jit):
    def loss(params, x):
        x = jhooks.retain_grad(x * 1.0, "x")
        out = scanned_loss(params, x)
        return out, {"out": out}

    (value, aux), (gw, _), retained = maybe_jit(jhooks.value_and_grad(loss, has_aux=True))(
        params, x
    )
    np.testing.assert_allclose(value, scanned_loss(params, x), rtol=1e-6)
    np.testing.assert_allclose(aux["out"], value)
    _, unrolled = jhooks.grad(unrolled_loss)(params, x)
    np.testing.assert_allclose(retained["h"][0], unrolled["h0"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(retained["x"], jax.grad(scanned_loss, 1)(params, x), rtol=1e-5)


def test_nested_scans_stack_two_axes(maybe_jit):
    ws = jnp.asarray(rng.normal(size=(2, 3, D)).astype(np.float32))

    def loss(ws, x):
        def outer(h, row):
            def inner(h, w):
                h = jhooks.retain_grad(jnp.sin(h * w), "h")
                return h, None

            return lax.scan(inner, h, row)[0], None

        return jnp.sum(lax.scan(outer, x, ws)[0] ** 2)

    def unrolled(ws, x):
        h = x
        for i in range(2):
            for j in range(3):
                h = jhooks.retain_grad(jnp.sin(h * ws[i, j]), f"h{i}{j}")
        return jnp.sum(h**2)

    g, retained = maybe_jit(jhooks.grad(loss))(ws, x)
    ug, expected = jhooks.grad(unrolled)(ws, x)
    assert retained["h"].shape == (2, 3, B, D)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(
                retained["h"][i, j], expected[f"h{i}{j}"], rtol=1e-5, atol=1e-6
            )
    np.testing.assert_allclose(g, ug, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_gives_the_branch_that_ran(maybe_jit, sign):
    def loss(x, s):
        def pos(x):
            return jhooks.retain_grad(jnp.sin(x), "c") * 3.0

        def neg(x):
            return jhooks.retain_grad(jnp.cos(x), "c") * 5.0

        return jnp.sum(lax.cond(s > 0, pos, neg, x) ** 2)

    _, retained = maybe_jit(jhooks.grad(loss))(x, jnp.float32(sign))
    y = jnp.sin(x) * 3.0 if sign > 0 else jnp.cos(x) * 5.0
    np.testing.assert_allclose(retained["c"], 2 * y * (3.0 if sign > 0 else 5.0), rtol=1e-5)


def test_nested_jit_and_checkpoint_as_is(maybe_jit):
    @jax.jit
    def inner(x):
        return jhooks.retain_grad(jnp.tanh(x), "j")

    @jax.checkpoint
    def remat(x):
        return jhooks.retain_grad(jnp.sin(x), "r")

    def loss(x):
        return jnp.sum(remat(inner(x)) ** 2)

    def at_base(x):
        t = jhooks.retain_grad(jnp.tanh(x), "j")
        return jnp.sum(jhooks.retain_grad(jnp.sin(t), "r") ** 2)

    g, retained = maybe_jit(jhooks.grad(loss))(x)
    eg, expected = jhooks.grad(at_base)(x)
    for name in ("j", "r"):
        np.testing.assert_allclose(retained[name], expected[name], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, eg, rtol=1e-5, atol=1e-6)
    # A second call (jit's caches warm) retains the same.
    _, again = jhooks.grad(loss)(x)
    np.testing.assert_allclose(again["j"], expected["j"], rtol=1e-5, atol=1e-6)
    # And plain jax.grad, after, is unchanged.
    np.testing.assert_allclose(jax.grad(loss)(x), eg, rtol=1e-5, atol=1e-6)


def test_the_retained_gradient_is_after_the_hooks(maybe_jit):
    def scanned(params, x):
        def body(h, wb):
            h = jhooks.register_hook(layer(h, *wb), lambda g: g * 2.0)
            h = jhooks.retain_grad(h, "h")
            h = jhooks.register_hook(h, lambda g: g + 1.0)
            return h, None

        return jnp.sum(lax.scan(body, x, params)[0] ** 2)

    def unrolled(params, x):
        h = x
        for i in range(L):
            h = jhooks.register_hook(layer(h, params[0][i], params[1][i]), lambda g: g * 2.0)
            h = jhooks.retain_grad(h, f"h{i}")
            h = jhooks.register_hook(h, lambda g: g + 1.0)
        return jnp.sum(h**2)

    g, retained = maybe_jit(jhooks.grad(scanned))(params, x)
    ug, expected = jhooks.grad(unrolled)(params, x)
    for i in range(L):
        np.testing.assert_allclose(retained["h"][i], expected[f"h{i}"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g[0], ug[0], rtol=1e-5, atol=1e-6)
    # Last layer: d(sum h^2)/dh = 2h, then the hooks in registration order: * 2, + 1.
    h_last = lax.scan(lambda h, wb: (layer(h, *wb), None), x, params)[0]
    np.testing.assert_allclose(retained["h"][-1], 2.0 * (2 * h_last) + 1.0, rtol=1e-5)


def test_while_loop_is_refused_naming_the_value(maybe_jit):
    def loss(x):
        def body(h):
            return jhooks.retain_grad(jnp.sin(h), "w")

        return jnp.sum(lax.while_loop(lambda h: jnp.sum(h) > 100.0, body, x))

    with pytest.raises(ValueError, match=r"retain_grad\('w'\) was called inside a lax.while_loop"):
        maybe_jit(jhooks.grad(loss))(x)


def test_a_name_used_twice_in_loops_is_refused():
    def loss(x):
        def body(h, _):
            return jhooks.retain_grad(jnp.sin(h), "h"), None

        h = lax.scan(body, x, None, length=2)[0]
        return jnp.sum(lax.scan(body, h, None, length=2)[0])

    with pytest.raises(ValueError, match="'h' is used twice"):
        jhooks.grad(loss)(x)


def test_plain_jax_grad_is_unchanged(maybe_jit):
    def plain(params, x):
        h = lax.scan(lambda h, wb: (layer(h, *wb), None), x, params)[0]
        return jnp.sum(h**2)

    expected = jax.grad(plain)(params, x)
    # Two programs, rounded apart in float32 (1.3e-7 of gradients of order 0.5 seen).
    got = maybe_jit(jax.grad(scanned_loss))(params, x)
    for a, e in zip(got, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    # After a jhooks.grad call too (the functions it traced are not reused).
    maybe_jit(jhooks.grad(scanned_loss))(params, x)
    got = maybe_jit(jax.grad(scanned_loss))(params, x)
    for a, e in zip(got, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def test_inside_run_with_cache_and_run_with_hooks(maybe_jit):
    def f(x):
        def body(c, _):
            h = jhooks.hook_point(jnp.sin(c), "p")
            return jhooks.retain_grad(h * 2.0, "h"), None

        return jnp.sum(lax.scan(body, x, None, length=2)[0] ** 2)

    _, expected = jhooks.grad(f)(x)
    assert expected["h"].shape == (2, B, D)
    for loss in (
        lambda x: jhooks.run_with_cache(f, x)[0],
        lambda x: jhooks.run_with_cache(f, x, incl_bwd=True)[0],
        lambda x: jhooks.run_with_hooks(f, x, bwd_hooks=[("p", lambda g, name: g)]),
    ):
        _, retained = maybe_jit(jhooks.grad(loss))(x)
        np.testing.assert_allclose(retained["h"], expected["h"], rtol=1e-5, atol=1e-6)


def test_cond_retaining_in_one_branch_only_is_refused():
    def loss(x, s):
        branch = lambda x: jhooks.retain_grad(jnp.sin(x), "c")  # noqa: E731
        return jnp.sum(lax.cond(s > 0, branch, lambda x: x, x))

    with pytest.raises(ValueError, match=r"retain_grad\('c'\) is called in only some branches"):
        jhooks.grad(loss)(x, jnp.float32(1.0))


def test_vmap_around_the_scan_is_per_example(maybe_jit):
    def f(x):
        def body(c, _):
            return jhooks.retain_grad(jnp.sin(c) * 2.0, "h"), None

        return jnp.sum(lax.scan(body, x, None, length=2)[0] ** 2)

    _, retained = maybe_jit(jhooks.grad(lambda xs: jnp.sum(jax.vmap(f)(xs))))(x)
    assert retained["h"].shape == (2, B, D)  # the scan axis, then the batch axis
    for i in range(B):
        _, one = jhooks.grad(f)(x[i])
        np.testing.assert_allclose(retained["h"][:, i], one["h"], rtol=1e-5, atol=1e-6)

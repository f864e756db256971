"""`jhooks.loop_index()` in a hook inside a `lax.scan`, the run differentiated inside
another run (issue 37): `jax.grad`'s partial evaluation of a scan hoists loop-invariant
equations out of the body, and `loop_index_p` once had no operands, so it was moved
out of its loop ("traced inside 1 loops but runs inside 0 here"). Each case is checked
against the same computation written by hand, the iteration fed to the scan as `xs`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

W = jnp.array([[0.3, -0.5], [0.8, 0.2], [-0.4, 0.6]], jnp.float32)  # 3 layers
X = jnp.array([0.7, -1.1], jnp.float32)


def layer(c, w, point):
    return jnp.tanh(point(c * w, "act")) + w


def model(x, body_wrap=lambda f: f):
    body = body_wrap(lambda c, w: (layer(c, w, jhooks.hook_point), None))
    return jax.lax.scan(body, x, W)[0]


def scale_by_layer(value, name):
    (i,) = jhooks.loop_index()
    return value * (1.0 + i.astype(value.dtype)) ** 2


def hooked(x, body_wrap=lambda f: f):
    out = jhooks.run_with_hooks(
        lambda x: model(x, body_wrap), x, fwd_hooks=[("act", scale_by_layer)]
    )
    return jnp.sum(out**2)


def by_hand(x):
    def body(c, wi):
        w, i = wi
        scaled = lambda v, name: v * (1.0 + i.astype(v.dtype)) ** 2  # noqa: E731
        return layer(c, w, scaled), None

    out = jax.lax.scan(body, x, (W, jnp.arange(3)))[0]
    return jnp.sum(out**2)


def outer_run(fn):
    """`fn` called inside a run of its own: the run the hook's run is nested in."""
    return lambda x: jhooks.run_with_hooks(fn, x)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_the_repro_grad_inside_an_outer_run(maybe_jit):
    close(maybe_jit(outer_run(jax.grad(hooked)))(X), jax.grad(by_hand)(X))
    close(maybe_jit(jax.grad(hooked))(X), jax.grad(by_hand)(X))  # no outer run


def test_grad_of_grad_and_value_and_grad(maybe_jit):
    hessian = maybe_jit(outer_run(jax.hessian(hooked)))(X)
    close(hessian, jax.hessian(by_hand)(X))
    value, grad = maybe_jit(outer_run(jax.value_and_grad(hooked)))(X)
    close(value, by_hand(X))
    close(grad, jax.grad(by_hand)(X))


def test_vmap_of_grad_and_grad_under_vmap(maybe_jit):
    xs = jnp.stack([X, -X, 2 * X])
    expected = jax.vmap(jax.grad(by_hand))(xs)
    close(maybe_jit(outer_run(jax.vmap(jax.grad(hooked))))(xs), expected)
    summed = lambda xs: jnp.sum(jax.vmap(hooked)(xs))  # noqa: E731
    close(maybe_jit(outer_run(jax.grad(summed)))(xs), expected)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.everything_saveable])
def test_checkpointed_body(maybe_jit, policy):
    def remat(f):
        return jax.checkpoint(f, policy=policy)

    grad = jax.grad(lambda x: hooked(x, remat))
    close(maybe_jit(outer_run(grad))(X), jax.grad(by_hand)(X))


def test_jit_inside_the_scan_body(maybe_jit):
    close(maybe_jit(outer_run(jax.grad(lambda x: hooked(x, jax.jit))))(X), jax.grad(by_hand)(X))


def test_cond_inside_the_scan(maybe_jit):
    def branchy(x):
        def body(c, w):
            def hot(c):
                return layer(c, w, jhooks.hook_point)

            return jax.lax.cond(w[0] > -1.0, hot, lambda c: c, c), None

        return jax.lax.scan(body, x, W)[0]

    def run(x):
        out = jhooks.run_with_hooks(branchy, x, fwd_hooks=[("act", scale_by_layer)])
        return jnp.sum(out**2)

    close(maybe_jit(outer_run(jax.grad(run)))(X), jax.grad(by_hand)(X))


def test_fori_loop_and_nested_scans(maybe_jit):
    def fori(x):
        return jax.lax.fori_loop(0, 3, lambda k, c: layer(c, W[k], jhooks.hook_point), x)

    def run(x):
        return jnp.sum(jhooks.run_with_hooks(fori, x, fwd_hooks=[("act", scale_by_layer)]) ** 2)

    close(maybe_jit(outer_run(jax.grad(run)))(X), jax.grad(by_hand)(X))

    def both(value, name):
        i, j = jhooks.loop_index()
        return value * (1 + i + 10 * j).astype(value.dtype)

    def nested(x):
        def inner(c, w):
            return layer(c, w, jhooks.hook_point), None

        return jax.lax.scan(lambda c, ws: jax.lax.scan(inner, c, ws), x, jnp.stack([W, -W]))[0]

    def nested_by_hand(x):
        def inner(c, wij):
            w, i, j = wij
            f = lambda v, name: v * (1 + i + 10 * j).astype(v.dtype)  # noqa: E731
            return layer(c, w, f), None

        def outer(c, wsi):
            ws, i = wsi
            return jax.lax.scan(inner, c, (ws, jnp.full(3, i), jnp.arange(3)))

        out = jax.lax.scan(outer, x, (jnp.stack([W, -W]), jnp.arange(2)))[0]
        return jnp.sum(out**2)

    def run_nested(x):
        return jnp.sum(jhooks.run_with_hooks(nested, x, fwd_hooks=[("act", both)]) ** 2)

    close(maybe_jit(outer_run(jax.grad(run_nested)))(X), jax.grad(nested_by_hand)(X))


def test_the_primitive_stays_in_the_scan_of_grad():
    """The mechanism itself: in `jax.grad`'s jaxpr, `loop_index_p` is inside the scan."""
    from jhooks._staging import loop_index_p

    def f(x):
        def body(c, w):
            return c * w * jhooks.loop_index()[0].astype(c.dtype), None

        return jnp.sum(jax.lax.scan(body, x, W)[0])

    seen = []

    def staged(x):
        jaxpr = jax.make_jaxpr(jax.grad(f))(x)
        seen.append([e.primitive for e in jaxpr.eqns])
        return jax.grad(f)(x)

    close(jhooks.run_with_hooks(staged, X), jax.grad(by_hand_index)(X))
    assert seen and loop_index_p not in seen[-1]


def by_hand_index(x):
    def body(c, wi):
        w, i = wi
        return c * w * i.astype(c.dtype), None

    return jnp.sum(jax.lax.scan(body, x, (W, jnp.arange(3)))[0])


def test_in_model_code_on_a_loop_invariant_point_and_a_scan_without_xs(maybe_jit):
    V = jnp.array([1.0, 2.0], jnp.float32)

    def by_hand_v(x):
        def body(c, wi):
            w, i = wi
            return jnp.tanh(c * w * V * (1 + i).astype(V.dtype)), None

        return jnp.sum(jax.lax.scan(body, x, (W, jnp.arange(3)))[0])

    def in_code(x):  # the index read in the model's own code, on a value the loop does not vary
        def body(c, w):
            (i,) = jhooks.loop_index()
            return jnp.tanh(c * w * V * (1 + i).astype(V.dtype)), None

        return jnp.sum(jax.lax.scan(body, x, W)[0])

    def on_constant(x):  # a hook on a point whose value is the same in every iteration
        def body(c, w):
            return jnp.tanh(c * w * jhooks.hook_point(V * 1.0, "v")), None

        return jnp.sum(jax.lax.scan(body, x, W)[0])

    def by_layer(value, name):
        (i,) = jhooks.loop_index()
        return value * (1 + i).astype(value.dtype)

    expected = jax.grad(by_hand_v)(X)
    grad_code = jax.grad(lambda x: jhooks.run_with_hooks(in_code, x))
    close(maybe_jit(outer_run(grad_code))(X), expected)
    grad_constant = jax.grad(
        lambda x: jhooks.run_with_hooks(on_constant, x, fwd_hooks=[("v", by_layer)])
    )
    close(maybe_jit(outer_run(grad_constant))(X), expected)

    def no_xs(x):  # a carry only: the body's one argument
        def body(c, _):
            (i,) = jhooks.loop_index()
            return c * (1 + i).astype(c.dtype), None

        return jnp.sum(jax.lax.scan(body, x, None, length=3)[0])

    grad_no_xs = jax.grad(lambda x: jhooks.run_with_hooks(no_xs, x))
    close(maybe_jit(outer_run(grad_no_xs))(X), jnp.full(2, 6.0))  # 1 * 2 * 3


def test_while_loop_forward_mode_and_linearize(maybe_jit):
    def looped(x):
        def body(s):
            c, k = s
            return jnp.sin(jhooks.hook_point(c * 0.9, "act")), k + 1

        return jnp.sum(jax.lax.while_loop(lambda s: s[1] < 3, body, (x, 0))[0])

    def by_layer(value, name):
        (i,) = jhooks.loop_index()
        return value * (1 + i).astype(value.dtype)

    def run(x):
        return jhooks.run_with_hooks(looped, x, fwd_hooks=[("act", by_layer)])

    def unrolled(x):
        c = x
        for i in range(3):
            c = jnp.sin(c * 0.9 * (1 + i))
        return jnp.sum(c)

    close(maybe_jit(outer_run(jax.jacfwd(run)))(X), jax.jacfwd(unrolled)(X))
    ones = jnp.ones(2, jnp.float32)

    def linearized(x):
        return jax.linearize(run, x)[1](ones)

    close(maybe_jit(outer_run(linearized))(X), jax.jvp(unrolled, (X,), (ones,))[1])


def test_module_hook_differentiated_inside_a_run(maybe_jit):
    """A persistent module hook reading the index, the model differentiated inside a run."""
    import equinox as eqx

    class Block(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jnp.tanh(x * self.w)

    class Scanned(eqx.Module):
        blocks: Block

        def __call__(self, x):
            stacked, static = eqx.partition(self.blocks, eqx.is_array)
            body = lambda x, layer: (eqx.combine(layer, static)(x), None)  # noqa: E731
            return jax.lax.scan(body, x, stacked)[0]

    model = jhooks.hookable(Scanned(Block(W)))

    def by_layer(module, args, out):
        (i,) = jhooks.loop_index()
        return out * (1.0 + i.astype(out.dtype)) ** 2

    handle = jhooks.register_forward_hook(model.blocks, by_layer)
    try:

        def loss(ws, x):
            return jnp.sum(eqx.tree_at(lambda m: m.blocks.w, model, ws)(x) ** 2)

        def by_hand(ws, x):
            for i in range(3):
                x = jnp.tanh(x * ws[i]) * (1.0 + i) ** 2
            return jnp.sum(x**2)

        got = maybe_jit(lambda ws, x: jhooks.run_with_hooks(jax.grad(loss), ws, x))(W, X)
        close(got, jax.grad(by_hand)(W, X))
    finally:
        handle.remove()

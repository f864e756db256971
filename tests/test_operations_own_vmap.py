"""Operations under a `jax.vmap` of the model's own code: the vmap's axis first.

A jaxpr does not say which axis of a batched value is the vmap's: JAX's batching rule for
a `Linear`'s `dot_general` puts the positions last. A hook at such an operation sees the
value with the vmap's axis first, as a module's point there is stacked and as
`jhooks.ops` lists it, in a loop under that vmap too; where jhooks did not see the
batching give the value (an equation made inside a batching rule, one under a second vmap),
a hook there is refused by name. The oracle is the edit written into the model's code by
hand, at the same place.
"""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import batching

import jhooks

T = 4


class Positions(eqx.Module):
    """A layer mapped over positions by the model's own vmap."""

    lin: eqx.nn.Linear

    def __call__(self, x):
        return jnp.tanh(jax.vmap(self.lin)(x))


class Model(eqx.Module):
    """Any model around a module: operations of the root's own code have no module
    path, and a vmap there cannot be told from the user's (runs refuse hooks there)."""

    inner: eqx.Module

    def __call__(self, x):
        return self.inner(x)


def model_and_x(d_in, d_out, seed=0):
    model = jhooks.hookable(Model(Positions(eqx.nn.Linear(d_in, d_out, key=jax.random.key(seed)))))
    x = np.random.default_rng(seed).normal(size=(T, d_in)).astype(np.float32)
    return model, jnp.asarray(x)


def by_hand(model, x, edit):
    """The model with `edit` applied to the product `x @ W.T` (positions first), before
    the bias, written by hand."""
    lin = model.inner.lin
    return jnp.tanh(edit(x @ lin.weight.T) + lin.bias)


@pytest.mark.parametrize("d_out", [T, 6])  # square, where the axes cannot be told by shape
def test_an_operation_under_the_models_vmap_is_seen_with_its_axis_first(maybe_jit, d_out):
    model, x = model_and_x(3 if d_out != T else T, d_out)
    shapes = {op.address: op.shape for op in jhooks.ops(model, x)}
    assert shapes["inner.lin/dot_general"] == (T, d_out)  # (positions, features)

    def zero_position_0(v, hook):
        assert v.shape == (T, d_out)
        return v.at[0].set(0.0)

    out = maybe_jit(
        lambda m, x: jhooks.run_with_hooks(
            m, x, fwd_hooks=[("inner.lin/dot_general", zero_position_0)]
        )
    )(model, x)
    expected = by_hand(model, x, lambda p: p.at[0].set(0.0))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    # The other reading, a feature zeroed, is far from it: the test tells them apart.
    other = by_hand(model, x, lambda p: p.at[:, 0].set(0.0))
    assert np.abs(np.asarray(other) - np.asarray(expected)).max() > 0.1

    _, cache = maybe_jit(
        lambda m, x: jhooks.run_with_cache(m, x, names_filter="inner.lin/dot_general")
    )(model, x)
    np.testing.assert_allclose(
        cache["inner.lin/dot_general"], x @ model.inner.lin.weight.T, rtol=1e-6, atol=1e-6
    )


def test_a_gradient_at_an_operation_under_the_models_vmap_has_its_axis_first(maybe_jit):
    model, x = model_and_x(3, 6)
    seen = {}

    def grad_hook(g, hook):
        seen["shape"] = g.shape
        if not isinstance(g, jax.core.Tracer):  # eagerly: its values too
            seen["g"] = g
        return g.at[1].set(0.0)  # the gradient at position 1 only

    def loss(m, x):
        return jhooks.run_with_hooks(
            lambda x: m(x).sum(), x, bwd_hooks=[("inner.lin/dot_general", grad_hook)]
        )

    grad = maybe_jit(jax.grad(loss, argnums=1))(model, x)
    lin = model.inner.lin
    pre = x @ lin.weight.T + lin.bias
    dpre = 1.0 - np.tanh(np.asarray(pre)) ** 2  # d tanh, positions first
    assert seen["shape"] == (T, 6)
    if maybe_jit is not jax.jit:
        np.testing.assert_allclose(seen["g"], dpre, rtol=1e-6, atol=1e-6)
    dpre[1] = 0.0
    np.testing.assert_allclose(grad, dpre @ np.asarray(lin.weight), rtol=1e-5, atol=1e-6)


class Moved(eqx.Module):
    """Equinox's MultiheadAttention's habit: a vmap over axis 1, out to axis 1."""

    w: jax.Array

    def __call__(self, x):  # x: (T, H, D)
        def one(h):  # h: (T, D), one head
            return jax.nn.softmax(h @ self.w @ h.T, axis=-1) @ h

        return jax.vmap(one, in_axes=1, out_axes=1)(x)


def test_a_vmap_over_axis_1_is_seen_with_its_axis_first(maybe_jit):
    heads, d = 3, 2
    w = jnp.asarray(np.random.default_rng(2).normal(size=(d, d)).astype(np.float32))
    model = jhooks.hookable(Model(Moved(w)))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(T, heads, d)).astype(np.float32))
    shapes = {op.address: op.shape for op in jhooks.ops(model, x)}
    assert shapes["inner/softmax"] == (heads, T, T)

    def zero_head_1(p, hook):
        return p.at[1].set(0.0)

    out = maybe_jit(
        lambda m, x: jhooks.run_with_hooks(m, x, fwd_hooks=[("inner/softmax", zero_head_1)])
    )(model, x)
    xs = np.asarray(x)
    expected = np.empty_like(xs)
    for h in range(heads):
        one = xs[:, h]
        p = np.asarray(jax.nn.softmax(one @ np.asarray(w) @ one.T, axis=-1))
        expected[:, h] = (np.zeros_like(p) if h == 1 else p) @ one
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_a_value_the_vmap_did_not_batch_is_seen_as_it_is(maybe_jit):
    class Scaled(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jax.vmap(lambda r: r * jnp.exp(self.w))(x)  # exp(w): one for all rows

    w = jnp.asarray([0.1, 0.2, 0.3], jnp.float32)
    model = jhooks.hookable(Model(Scaled(w)))
    x = jnp.arange(T * 3, dtype=jnp.float32).reshape(T, 3)
    assert {op.address: op.shape for op in jhooks.ops(model, x)}["inner/exp"] == (3,)
    out = maybe_jit(
        lambda m, x: jhooks.run_with_hooks(
            m, x, fwd_hooks=[("inner/exp", lambda v, h: v.at[0].set(0.0))]
        )
    )(model, x)
    scale = np.exp(np.asarray(w))
    scale[0] = 0.0  # the patch, on the one value every row shares
    np.testing.assert_allclose(out, np.asarray(x) * scale, rtol=1e-6)


def body(c, w):  # at module level: JAX caches its trace by its identity
    return jnp.tanh(w @ c), None


class InLoop(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        ws = jnp.stack([self.w, 2.0 * self.w])
        return jax.vmap(lambda r: jax.lax.scan(body, r, ws)[0])(x)


def test_an_operation_in_a_loop_under_the_models_vmap_has_its_axis_first(maybe_jit):
    w = jnp.asarray(np.random.default_rng(6).normal(size=(3, 3)).astype(np.float32))
    model = jhooks.hookable(Model(InLoop(w)))
    x = jnp.asarray(np.random.default_rng(7).normal(size=(T, 3)).astype(np.float32))
    plain = np.asarray(model(x))  # the loop's body traced plainly first, kept in JAX's caches
    assert {op.address: op.shape for op in jhooks.ops(model, x)}["inner/tanh"] == (T, 3)
    seen = []

    def zero_example_0(v, hook):
        seen.append(v.shape)
        return v.at[0].set(0.0)  # each iteration: example 0's carry

    out = maybe_jit(
        lambda m, x: jhooks.run_with_hooks(m, x, fwd_hooks=[("inner/tanh", zero_example_0)])
    )(model, x)
    expected = plain.copy()
    expected[0] = 0.0  # by hand: example 0's last iteration zeroed, the others untouched
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    assert set(seen) == {(T, 3)}


class Twice(eqx.Module):
    w: jax.Array

    def __call__(self, x):  # x: (A, B, D), mapped over A and B
        return jax.vmap(jax.vmap(lambda r: jnp.tanh(self.w @ r)))(x)


@pytest.mark.parametrize(
    "model, x, address",
    [
        (
            Positions(eqx.nn.Linear(3, 5, key=jax.random.key(0))),
            jnp.ones((T, 3)),
            "inner.lin/transpose",
        ),
        (Twice(jnp.eye(3)), jnp.ones((2, T, 3)), "inner/tanh"),
    ],
    ids=["made-inside-a-batching-rule", "under-two-vmaps"],
)
def test_where_jhooks_did_not_see_the_vmaps_axis_the_hook_is_refused(maybe_jit, model, x, address):
    model = jhooks.hookable(Model(model))
    assert address in {op.address for op in jhooks.ops(model, x)}

    def patch(v, hook):
        return v.at[0].set(0.0)

    with pytest.raises(ValueError) as raised:
        maybe_jit(lambda m, x: jhooks.run_with_hooks(m, x, fwd_hooks=[(address, patch)]))(model, x)
    message = str(raised.value)
    assert f".patch selects operation {address!r}" in message
    assert "cannot tell which axis is the vmap's" in message
    assert "jhooks.hook_point" in message
    # A cache there would show the same value: refused too, naming the filter.
    with pytest.raises(ValueError, match=f"names_filter selects operation {address!r}"):
        maybe_jit(lambda m, x: jhooks.run_with_cache(m, x, names_filter=address))(model, x)


def test_a_hook_point_in_the_vmapped_function_sees_the_vmaps_axis_first(maybe_jit):
    # What the refusal points to: a hook point inside the model's vmap.
    class Pointed(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jax.vmap(lambda r: jhooks.hook_point(self.w @ r, "z"))(x)

    w = jnp.asarray(np.random.default_rng(4).normal(size=(5, 3)).astype(np.float32))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(T, 3)).astype(np.float32))
    seen = []

    def zero_0(v, hook):
        seen.append(v.shape)
        return v.at[0].set(0.0)

    out = maybe_jit(lambda m, x: jhooks.run_with_hooks(m, x, fwd_hooks=[("z", zero_0)]))(
        jhooks.hookable(Pointed(w)), x
    )
    assert seen == [(T, 5)]
    np.testing.assert_allclose(out, (x @ w.T).at[0].set(0.0), rtol=1e-6, atol=1e-6)


def test_jax_is_left_as_it_was_after_a_trace_that_failed_and_in_other_threads():
    originals = {n: getattr(batching.BatchTrace, n) for n in ("process_primitive", "process_call")}
    model, x = model_and_x(3, 5)

    def raises(v, hook):
        raise RuntimeError("the hook fails")

    with pytest.raises(RuntimeError, match="the hook fails"):
        jhooks.run_with_hooks(model, x, fwd_hooks=[("inner.lin/dot_general", raises)])
    assert {n: getattr(batching.BatchTrace, n) for n in originals} == originals

    # Threads tracing their own vmaps while runs record theirs: each gets its own values.
    errors, results = [], {}

    def work(i):
        try:
            m, xi = model_and_x(3, 5, seed=i)
            for _ in range(3):
                out = jhooks.run_with_hooks(
                    m, xi, fwd_hooks=[("inner.lin/dot_general", lambda v, h: v.at[0].set(0.0))]
                )
                plain = jax.vmap(lambda r: r * 2.0)(xi)
            results[i] = (out, by_hand(m, xi, lambda p: p.at[0].set(0.0)), plain, xi * 2.0)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for out, expected, plain, doubled in results.values():
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(plain, doubled)
    assert {n: getattr(batching.BatchTrace, n) for n in originals} == originals


def test_the_recorded_axes_leave_no_tracer_under_checking_leaks(maybe_jit):
    # The record holds the trace's variables only while it traces the model.
    model, x = model_and_x(3, 6)
    hooks = [("inner.lin/dot_general", lambda v, hook: v.at[0].set(0.0))]
    with jax.checking_leaks():
        out = maybe_jit(lambda m, x: jhooks.run_with_hooks(m, x, fwd_hooks=hooks))(model, x)
    np.testing.assert_allclose(out, by_hand(model, x, lambda p: p.at[0].set(0.0)), atol=1e-6)

"""`loop_index()` in `lax.while_loop` and traced-bound `fori_loop`, bounded caches
(`run_with_cache(max_steps=)`), and `loop_index()` from persistent module hooks under
`lax.scan` and `nnx.scan` (no run active).

Each loop is checked against the same computation unrolled in Python.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jhooks

W = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)) / 2
X0 = jnp.asarray([0.5, -1.0, 0.25, 2.0], jnp.float32)
WS = jnp.asarray(np.random.default_rng(1).normal(size=(3, 4, 4)).astype(np.float32)) / 2


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def layer(x):
    return jhooks.hook_point(jnp.tanh(x @ W), "layer")


def traced_fori(x, n):
    return jax.lax.fori_loop(0, n, lambda i, x: layer(x), x)


def counted_while(x, n):
    """A `while_loop` whose carry has no counter of its own: it stops on the value."""

    def body(c):
        x, left = c
        return layer(x), left - 1.0

    return jax.lax.while_loop(lambda c: c[1] > 0.0, body, (x, n.astype(jnp.float32)))[0]


def unrolled(x, n, patch_at):
    outs = []
    for i in range(n):
        x = jnp.tanh(x @ W)
        x = x * -2.0 if i in patch_at else x
        outs.append(x)
    return x, outs


def patch_steps_1_and_3(v, name):
    (i,) = jhooks.loop_index()
    return jnp.where((i == 1) | (i == 3), v * -2.0, v)


@pytest.mark.parametrize("loop", [traced_fori, counted_while], ids=["fori", "while"])
def test_loop_index_in_a_while_loop_is_the_step(loop, maybe_jit):
    run = maybe_jit(
        lambda x, n: jhooks.run_with_hooks(loop, x, n, fwd_hooks=[("layer", patch_steps_1_and_3)])
    )
    expected, _ = unrolled(X0, 5, {1, 3})
    close(run(X0, jnp.int32(5)), expected)
    close(run(X0, jnp.int32(2)), unrolled(X0, 2, {1})[0])  # same program, fewer steps


def test_loop_index_in_a_while_loop_inside_a_scan(maybe_jit):
    seen = []

    def hook(v, name):
        outer, inner = jhooks.loop_index()
        seen.append(1)
        return v + (10 * outer + inner).astype(v.dtype)

    def f(x, n):
        return jax.lax.scan(lambda x, _: (traced_fori(x, n), None), x, None, length=2)[0]

    run = maybe_jit(lambda x, n: jhooks.run_with_hooks(f, x, n, fwd_hooks=[("layer", hook)]))
    x = X0
    for outer in range(2):
        for inner in range(3):
            x = jnp.tanh(x @ W) + 10.0 * outer + inner
    close(run(X0, jnp.int32(3)), x, 1e-5)
    assert seen


def test_bounded_cache_of_a_while_loop(maybe_jit):
    run = maybe_jit(lambda x, n: jhooks.run_with_cache(counted_while, x, n, max_steps=6))
    out, cache = run(X0, jnp.int32(4))
    _, rows = unrolled(X0, 4, set())
    assert set(cache) == {"layer", "layer_steps", "layer_valid"}
    assert cache["layer"].shape == (6, 4)
    close(cache["layer"][:4], np.stack(rows))
    close(cache["layer"][4:], np.zeros((2, 4)))
    assert int(cache["layer_steps"]) == 4
    np.testing.assert_array_equal(cache["layer_valid"], [True] * 4 + [False] * 2)
    close(out, rows[-1])
    # More steps than the bound: the first rows are kept, and the count says so.
    out, cache = run(X0, jnp.int32(8))
    _, rows = unrolled(X0, 8, set())
    close(cache["layer"], np.stack(rows[:6]))
    assert int(cache["layer_steps"]) == 8
    assert bool(cache["layer_valid"].all())
    close(out, rows[-1])


def test_bounded_cache_of_a_while_loop_inside_a_nested_jit(maybe_jit):
    inner = jax.jit(counted_while)
    run = maybe_jit(lambda x, n: jhooks.run_with_cache(lambda x, n: inner(x, n), x, n, max_steps=4))
    _, cache = run(X0, jnp.int32(3))
    close(cache["layer"][:3], np.stack(unrolled(X0, 3, set())[1]))
    np.testing.assert_array_equal(cache["layer_valid"], [True, True, True, False])


def test_bounded_cache_with_hooks_sees_the_patched_values(maybe_jit):
    def f(x, n):
        return jhooks.run_with_cache(traced_fori, x, n, max_steps=5)

    run = maybe_jit(
        lambda x, n: jhooks.run_with_hooks(f, x, n, fwd_hooks=[("layer", patch_steps_1_and_3)])
    )
    _, cache = run(X0, jnp.int32(5))
    close(cache["layer"], np.stack(unrolled(X0, 5, {1, 3})[1]))


def test_while_loop_cache_needs_a_bound_and_has_no_gradient():
    with pytest.raises(
        ValueError,
        match=r"run_with_cache: hook point 'layer' is inside a lax.while_loop .* give the run "
        r"a bound: run_with_cache\(..., max_steps=N\)",
    ):
        jhooks.run_with_cache(counted_while, X0, jnp.int32(3))
    with pytest.raises(
        ValueError,
        match=r"hook point 'layer' is inside a lax.while_loop .* incl_bwd=True asks for its "
        r"gradient: JAX has no reverse-mode derivative of a while loop",
    ):
        jhooks.run_with_cache(
            lambda x, n: counted_while(x, n).sum(), X0, jnp.int32(3), max_steps=4, incl_bwd=True
        )
    with pytest.raises(TypeError, match=r"max_steps takes a positive Python int, got 0"):
        jhooks.run_with_cache(counted_while, X0, jnp.int32(3), max_steps=0)


def test_a_point_in_a_while_loops_condition_is_refused():
    def f(x):
        return jax.lax.while_loop(lambda x: jhooks.hook_point(x, "c").sum() < 10.0, layer, x)

    with pytest.raises(ValueError, match=r"hook point 'c' is inside a lax.while_loop .*condition"):
        jhooks.run_with_cache(f, X0, max_steps=3)


# -- persistent module hooks: the outermost hookable call feeds loop_index ---------------


class Block(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


class Scanned(eqx.Module):
    blocks: Block

    def __call__(self, x):
        stacked, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x, layer):
            return eqx.combine(layer, static)(x), None

        return jax.lax.scan(body, x, stacked)[0]


def unrolled_layers(x, ws, patched):
    for i, w in enumerate(ws):
        x = jnp.tanh(x @ w)
        x = x + 1.0 if i == patched else x
    return x


def add_one_at_layer_1(module, args, out):
    (i,) = jhooks.loop_index()
    return jnp.where(i == 1, out + 1.0, out)


def test_module_hook_reads_loop_index_under_lax_scan(maybe_jit):
    model = jhooks.hookable(Scanned(Block(WS)))
    call = maybe_jit(lambda m, x: m(x))
    plain = call(model, X0)
    handle = jhooks.register_forward_pre_hook(model, lambda m, args: None)  # a root hook too
    jhooks.register_forward_hook(model.blocks, add_one_at_layer_1)
    close(call(model, X0), unrolled_layers(X0, WS, 1), 1e-5)
    close(call(model, X0), unrolled_layers(X0, WS, 1), 1e-5)  # remembered: staged at once
    handle.remove()
    close(plain, unrolled_layers(X0, WS, None), 1e-5)


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.bn(self.lin(x)))


class NNXStack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NNXBlock(rngs)

        self.blocks = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


def test_module_hook_with_loop_index_is_differentiated_as_the_unrolled_model(maybe_jit):
    model = jhooks.hookable(Scanned(Block(WS)))
    jhooks.register_forward_hook(model.blocks, add_one_at_layer_1)
    grad = maybe_jit(jax.grad(lambda ws, x: model_with(ws)(x).sum() ** 2))

    def model_with(ws):
        return eqx.tree_at(lambda m: m.blocks.w, model, ws)

    expected = jax.grad(lambda ws, x: unrolled_layers(x, ws, 1).sum() ** 2)(WS, X0)
    close(grad(WS, X0), expected, 1e-5)


def test_module_hook_reads_loop_index_under_nnx_scan(maybe_jit):
    # The output is checked by hand (plus 1 at layer 1); a model whose hook reads the
    # index and changes nothing must leave the batch statistics of a model with no
    # hook (it runs staged, on a copy of the model rebuilt in the trace).
    model, reader, twin = (jhooks.hookable(NNXStack(nnx.Rngs(0))) for _ in range(3))
    jhooks.register_forward_hook(model.blocks, add_one_at_layer_1)
    indices = []
    jhooks.register_forward_hook(
        reader.blocks, lambda m, a, out: indices.append(jhooks.loop_index())
    )
    xs = jax.random.normal(jax.random.key(1), (5, 4))
    call = nnx.jit(lambda m, x: m(x)) if maybe_jit is jax.jit else (lambda m, x: m(x))
    got = call(model, xs)
    kernel, bias = twin.blocks.lin.kernel[...], twin.blocks.lin.bias[...]
    scale, shift = twin.blocks.bn.scale[...], twin.blocks.bn.bias[...]
    expected = xs
    for i in range(3):  # each layer by hand, batch norm in train mode
        h = expected @ kernel[i] + bias[i]
        normed = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
        expected = jnp.tanh(normed * scale[i] + shift[i])
        expected = expected + 1.0 if i == 1 else expected
    close(got, expected, 1e-5)
    close(call(reader, xs), call(twin, xs))
    assert len(indices[-1]) == 1
    close(reader.blocks.bn.mean[...], twin.blocks.bn.mean[...])
    close(reader.blocks.bn.var[...], twin.blocks.bn.var[...])
    assert float(jnp.abs(twin.blocks.bn.mean[...]).max()) > 0  # they moved


def test_loop_index_around_the_outermost_hookable_call_is_refused():
    block = jhooks.hookable(Block(WS[0]))
    jhooks.register_forward_hook(block, add_one_at_layer_1)
    with pytest.raises(
        ValueError,
        match=r"called inside a loop with no run active.*a loop around that call is not counted",
    ):
        jax.lax.scan(lambda x, _: (block(x), None), X0, None, length=2)

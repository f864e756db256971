"""Hookable blocks stacked for `lax.scan`: `jax.tree.map(jnp.stack)` over hookable
blocks, layers made by `eqx.filter_vmap` and `nnx.vmap`, and the rule that keeps it
sound: registries holding no hook compare equal, one holding hooks (or whose name a
trace read) is itself, so no jit cache serves one block's trace to another block. And
no model's names depend on another model's `hookable` call. Checked against a PyTorch
twin of the unstacked model, with PyTorch forward hooks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from stacks import Looped as Unrolled  # a Python loop over a list of blocks
from stacks import Scanned  # lax.scan over stacked blocks

import jhooks

D, L = 4, 3
NAMES = ["", "layers", "layers.up", "layers.down"]  # of a model scanning stacked blocks
X = jnp.asarray(np.random.default_rng(0).normal(size=(D,)).astype(np.float32))
COMPILERS = {"eager": lambda f: f, "jax.jit": jax.jit, "eqx.filter_jit": eqx.filter_jit}


@pytest.fixture(params=list(COMPILERS))
def compile_(request):
    """Runs a test body eagerly, under `jax.jit` and under `eqx.filter_jit`."""
    return COMPILERS[request.param]


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up, self.down = eqx.nn.Linear(D, D, key=k1), eqx.nn.Linear(D, D, key=k2)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class HookableBlock(Block, jhooks.Module):
    pass


def stack(*blocks):
    return jax.tree.map(lambda *a: jnp.stack(a), *blocks)


def layers_of(stacked):
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(L)]


def torch_run(blocks, x, scale=None):
    """The unstacked model in PyTorch; `scale = {layer: s}` scales that layer's `up`
    output by a forward hook. Returns the output and each layer's `up` output."""
    h, ups = torch.tensor(np.asarray(x)), []
    for i, block in enumerate(blocks):
        up, down = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        with torch.no_grad():
            for ours, theirs in ((block.up, up), (block.down, down)):
                theirs.weight.copy_(torch.tensor(np.asarray(ours.weight)))
                theirs.bias.copy_(torch.tensor(np.asarray(ours.bias)))
        if scale and i in scale:
            up.register_forward_hook(lambda m, a, out, s=scale[i]: out * s)
        u = up(h)
        ups.append(u.detach().numpy())
        h = h + down(torch.tanh(u))
    return h.detach().numpy(), np.stack(ups)


def models():
    keys = jax.random.split(jax.random.PRNGKey(0), L)
    unrolled = jhooks.hookable(Unrolled([Block(k) for k in keys]))
    return unrolled, jhooks.hookable(Scanned(stack(*unrolled.layers)))


def halve_layer_1(value, name):
    (layer,) = jhooks.loop_index()
    return jnp.where(layer == 1, 0.5 * value, value)


def halve_output_at_layer_1(module, args, out):
    return halve_layer_1(out, None)


def test_stacked_hookable_blocks_scan_as_the_unstacked_model(compile_):
    unrolled, scanned = models()
    assert [n for n, _ in jhooks.named_modules(scanned)] == NAMES
    assert jhooks.module_path(unrolled.layers[0].up) == "layers.0.up"  # not renamed
    plain, ups = torch_run(unrolled.layers, X)
    halved, _ = torch_run(unrolled.layers, X, {1: 0.5})
    close(compile_(lambda x: scanned(x))(X), plain)
    # The cache: per layer, stacked; the unstacked model's per-layer entries.
    _, cache = compile_(lambda x: jhooks.run_with_cache(scanned, x, names_filter="layers.up"))(X)
    _, each = compile_(lambda x: jhooks.run_with_cache(unrolled, x))(X)
    close(cache["layers.up"], ups)
    close(cache["layers.up"], jnp.stack([each[f"layers.{i}.up"] for i in range(L)]))
    # Hooks by name: one layer picked by loop_index, as the unstacked model's own name.
    out = compile_(
        lambda x: jhooks.run_with_hooks(scanned, x, fwd_hooks=[("layers.up", halve_layer_1)])
    )(X)
    close(out, halved)
    twin = lambda x: jhooks.run_with_hooks(  # noqa: E731
        unrolled, x, fwd_hooks=[("layers.1.up", lambda v, name: 0.5 * v)]
    )
    close(compile_(twin)(X), halved)
    # Persistent module hooks: on the stacked model's block, not on the original's.
    with scanned.layers.up.register_forward_hook(halve_output_at_layer_1):
        close(compile_(lambda x: scanned(x))(X), halved)
        close(compile_(lambda x: unrolled(x))(X), plain)
    with unrolled.layers[1].up.register_forward_hook(lambda m, args, out: 0.5 * out):
        close(compile_(lambda x: unrolled(x))(X), halved)
        close(compile_(lambda x: scanned(x))(X), plain)


def test_a_jitted_function_runs_each_blocks_own_hooks(settled_hook_state, compile_):
    if compile_ is COMPILERS["eager"]:
        compile_ = jax.jit  # eager has no cache to get wrong; run the two jits
    unrolled, _ = models()
    b0, b1 = unrolled.layers[:2]
    traces = []

    @compile_
    def f(block, x):
        traces.append(None)
        return block(x)

    plain0, plain1 = b0(X), b1(X)
    close(f(b0, X), torch_run([b0], X)[0])
    close(f(b1, X), torch_run([b1], X)[0])
    assert len(traces) == 1  # no hooks: nothing tells the blocks apart, one trace
    with b0.register_forward_hook(lambda m, a, out: 0.0 * out):
        with b1.register_forward_hook(lambda m, a, out: out + 100.0):
            for _ in range(2):
                close(f(b0, X), 0.0 * plain0)
                close(f(b1, X), plain1 + 100.0)
    assert len(traces) == 3  # one trace per block holding hooks, reused on the next round

    # The same hook (same code) on both, reading which module it is.
    def by_name(module, args, out):
        return out * (1.0 + float(jhooks.module_path(module) == "layers.1"))

    handles = [b.register_forward_hook(by_name) for b in (b0, b1)]
    for _ in range(2):
        close(f(b0, X), plain0)
        close(f(b1, X), 2.0 * plain1)
    for h in handles:
        h.remove()
    # A global hook reading it: each block's registry is pinned once read.
    with jhooks.register_module_forward_hook(by_name):
        for _ in range(2):
            close(f(b0, X), plain0)
            close(f(b1, X), 2.0 * plain1)
    # A run started inside the jitted function names each block's own points.
    g = compile_(lambda block, x: jhooks.run_with_cache(block, x)[1])
    for i, block in enumerate((b0, b1, b0)):
        i = i % 2
        cache = g(block, X)
        assert sorted(cache) == [f"layers.{i}", f"layers.{i}.down", f"layers.{i}.up"]
        close(cache[f"layers.{i}.up"], block.up(X))
    # A pinned block is itself from then on: stacking it is refused, naming why.
    with pytest.raises(ValueError, match=r"its name was read inside a jitted function"):
        stack(b0, b1)


@pytest.mark.parametrize("made", ["hookable after", "hookable class"])
def test_layers_made_by_filter_vmap_take_hooks(maybe_jit, made):
    keys = jax.random.split(jax.random.PRNGKey(1), L)
    if made == "hookable class":  # a registry made inside the vmap's trace
        model = jhooks.hookable(Scanned(eqx.filter_vmap(HookableBlock)(keys)))
    else:
        model = jhooks.hookable(Scanned(eqx.filter_vmap(Block)(keys)))
    assert [n for n, _ in jhooks.named_modules(model)] == NAMES
    layers = layers_of(model.layers)
    halved, ups = torch_run(layers, X, {1: 0.5})
    with model.layers.up.register_forward_hook(halve_output_at_layer_1):
        close(maybe_jit(lambda x: model(x))(X), halved)
        _, cache = maybe_jit(lambda x: jhooks.run_with_cache(model, x, names_filter="layers.up"))(X)
        close(cache["layers.up"], ups)


def test_layers_made_by_nnx_vmap_take_hooks(maybe_jit):
    from flax import nnx

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.up(x))

    class NnxScanned(nnx.Module):
        def __init__(self, blocks):
            self.layers = blocks

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return block(x)

            return body(x, self.layers)

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):  # each layer made hookable inside the vmap
        return jhooks.hookable(NnxBlock(rngs))

    vmapped = jhooks.hookable(NnxScanned(create(nnx.Rngs(0))))
    # Hookable blocks stacked with jax.tree.map, in a model of their own.
    separate = nnx.List([jhooks.hookable(NnxBlock(nnx.Rngs(i))) for i in range(L)])
    original = jhooks.hookable(NnxScanned(separate))
    stacked = jhooks.hookable(NnxScanned(stack(*original.layers)))
    assert jhooks.module_path(original.layers[1].up) == "layers.1.up"  # not renamed
    for model in (vmapped, stacked):
        assert [n for n, _ in jhooks.named_modules(model)] == ["", "layers", "layers.up"]
        kernels, biases = model.layers.up.kernel[...], model.layers.up.bias[...]
        expected = X
        for i in range(L):  # each layer by hand, its up output halved at layer 1
            u = (expected @ kernels[i] + biases[i]) * (0.5 if i == 1 else 1.0)
            expected = expected + jnp.tanh(u)
        call = nnx.jit(lambda m, x: m(x)) if maybe_jit is jax.jit else (lambda m, x: m(x))
        with model.layers.up.register_forward_hook(halve_output_at_layer_1):
            close(call(model, X), expected)


class One(eqx.Module):
    block: Block

    def __call__(self, x):
        return self.block(x)


class Outer(eqx.Module):
    inner: Unrolled

    def __call__(self, x):
        return self.inner(x)


def test_no_models_names_depend_on_another_models_hookable_call(maybe_jit):
    unrolled, _ = models()

    def names(model):
        return [(n, jhooks.module_path(m)) for n, m in jhooks.named_modules(model)]

    before = names(unrolled)
    assert before[1] == ("layers.0", "layers.0")
    # Copies made hookable after the original, each built from its blocks.
    one = jhooks.hookable(One(unrolled.layers[1]))
    alone = jhooks.hookable(unrolled.layers[2])
    scanned = jhooks.hookable(Scanned(stack(*unrolled.layers)))
    reordered = jhooks.hookable(Unrolled(unrolled.layers[::-1]))
    outer = jhooks.hookable(Outer(unrolled))
    assert names(unrolled) == before
    assert names(one) == [(n, n) for n in ("", "block", "block.up", "block.down")]
    assert names(alone) == [(n, n) for n in ("", "up", "down")]
    assert jhooks.module_path(scanned.layers.up) == "layers.up"
    assert jhooks.module_path(reordered.layers[0].up) == "layers.0.up"
    assert jhooks.module_path(outer.inner.layers[0].up) == "inner.layers.0.up"
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(unrolled, x))(X)
    assert sorted(cache) == sorted(n for n, _ in before if n)
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(one, x))(X)
    assert sorted(cache) == ["block", "block.down", "block.up"]
    close(cache["block"], torch_run([unrolled.layers[1]], X)[0])
    # The copy made hookable before the original: each names its own.
    plain = Unrolled([Block(k) for k in jax.random.split(jax.random.PRNGKey(2), L)])
    first = jhooks.hookable(Scanned(stack(*plain.layers)))
    second = jhooks.hookable(plain)
    assert [p for _, p in names(first)] == NAMES
    assert [p for _, p in names(second)] == [n for n, _ in before]
    # A hook on the original's block is on none of the copies.
    plain = torch_run(unrolled.layers, X)[0]
    with unrolled.layers[0].register_forward_hook(lambda m, a, out: 0.0 * out):
        close(maybe_jit(lambda x: reordered(x))(X), torch_run(unrolled.layers[::-1], X)[0])
        close(maybe_jit(lambda x: outer(x))(X), plain)
        close(maybe_jit(lambda x: scanned(x))(X), plain)


class StacksInCall(eqx.Module):
    layers: list

    def __call__(self, x):
        return Scanned(stack(*self.layers))(x)


def test_stacking_in_the_call_is_refused_where_it_would_mix_modules_up(maybe_jit):
    # The stacked block is a copy of the first (JAX keeps the first tree's structure):
    # fine with no hooks and no run, refused where its hooks or names would be the
    # first block's on every layer, with the registry saying why.
    unrolled, _ = models()
    model = jhooks.hookable(StacksInCall(unrolled.layers))
    close(maybe_jit(lambda x: model(x))(X), torch_run(unrolled.layers, X)[0])
    with pytest.raises(ValueError, match=r"'layers.1' \(holding hooks\): a module that holds"):
        with model.layers[1].register_forward_hook(lambda m, a, out: out):
            maybe_jit(lambda x: model(x))(X)
    with pytest.raises(ValueError, match=r"\(inside a run, which names each module\)"):
        maybe_jit(lambda x: jhooks.run_with_cache(model, x))(X)

"""Runs compile once per hook structure: the values hooks close over are arguments."""

import functools
import gc
import math
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

LAYERS, HEADS, D_HEAD, SEQ = 12, 8, 2, 3
D = HEADS * D_HEAD
TRACES = []  # one entry per trace of `model`


def _params(seed=0, layers=LAYERS):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(layers, D, D)).astype(np.float32) / math.sqrt(D)
    o = rng.normal(size=(layers, D, D)).astype(np.float32) / math.sqrt(D)
    return {"w": jnp.asarray(w), "o": jnp.asarray(o)}


X = jnp.asarray(np.random.default_rng(1).normal(size=(SEQ, D)).astype(np.float32))


def model(params, x, patch=None):
    """`patch=(layer, head, value)` sets one head's z by hand, for the expected values."""
    TRACES.append(1)
    for i in range(params["w"].shape[0]):
        z = jnp.tanh(x @ params["w"][i]).reshape(SEQ, HEADS, D_HEAD)
        if patch is not None and patch[0] == i:
            z = z.at[:, patch[1]].set(patch[2])
        z = jhooks.hook_point(z, f"blocks.{i}.attn.hook_z")
        x = jhooks.hook_point(x + z.reshape(SEQ, D) @ params["o"][i], f"blocks.{i}.hook_resid_post")
    return jnp.sum(x**2)


WRAPS = {"plain": lambda f: f, "jax.jit": jax.jit, "eqx.filter_jit": eqx.filter_jit}


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def z_name(layer):
    return f"blocks.{layer}.attn.hook_z"


def patch(z, name, head, source):
    return z.at[:, head].set(source[:, head])


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_head_sweep_compiles_once_per_point_name(wrap):
    fn = WRAPS[wrap](model)
    # 3 layers x 8 heads: 24 hooks a sweep, 4 programs at most (one per point name, and
    # one for the first value) rather than one per hook; more layers test nothing more.
    layers = 3
    params = _params(layers=layers)
    source = jnp.full((SEQ, HEADS, D_HEAD), 0.5, jnp.float32)

    def sweep(make_hook):
        out = np.zeros((layers, HEADS), np.float32)
        for layer in range(layers):
            for head in range(HEADS):
                hook = make_hook(head)
                out[layer, head] = jhooks.run_with_hooks(
                    fn, params, X, fwd_hooks=[(z_name(layer), hook)]
                )
        return out

    def by_partial(h):
        return functools.partial(patch, head=h, source=source)

    def by_lambda(h):
        return lambda z, name: z.at[:, h].set(source[:, h])

    jax.clear_caches()  # the wrappers share `model`'s programs: count from nothing
    for make_hook in (by_partial, by_lambda):
        TRACES.clear()
        first = sweep(make_hook)
        # One program per point name, and one for the first value (a Python number
        # until it is seen to change).
        compiled = len(TRACES)
        assert compiled <= layers + 1
        second = sweep(make_hook)
        assert len(TRACES) == compiled  # and nothing more
        close(first, second)
        for layer, head in [(0, 0), (layers // 2, 3), (layers - 1, 7)]:
            close(first[layer, head], model(params, X, (layer, head, source[:, head])))


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_the_same_program_serves_calls_inside_a_trace(maybe_jit, wrap):
    fn = WRAPS[wrap](model)
    params = _params()

    def one(head):
        hook = functools.partial(patch, head=head, source=jnp.zeros((SEQ, HEADS, D_HEAD)))
        return jhooks.run_with_hooks(fn, params, X, fwd_hooks=[(z_name(2), hook)])

    effects = maybe_jit(jax.vmap(one))(jnp.arange(HEADS))
    for head in (0, 6):
        close(effects[head], model(params, X, (2, head, 0.0)))


HEAD = 0  # read by `zero_global_head` as a global


def zero_global_head(z, name):
    return z.at[:, HEAD].set(0.0)


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_globals_and_dicts_updated_in_place_are_read_on_every_call(wrap):
    global HEAD
    fn = WRAPS[wrap](model)
    params = _params(layers=5)
    expected = [model(params, X, (1, head, 0.0)) for head in range(3)]
    TRACES.clear()
    for HEAD in range(3):  # noqa: B007 - the loop variable is the global the hook reads
        out = jhooks.run_with_hooks(fn, params, X, fwd_hooks=[(z_name(1), zero_global_head)])
        close(out, expected[HEAD])
    HEAD = 0
    assert len(TRACES) <= 2  # the first value, then the number traced (fewer if compiled)

    clean = {"z": jnp.zeros((SEQ, HEADS, D_HEAD))}

    def add_clean(z, name):
        return z + clean["z"]

    for value in (1.0, -2.0, 0.25):
        clean.update(z=jnp.full((SEQ, HEADS, D_HEAD), value))
        out = jhooks.run_with_hooks(fn, params, X, fwd_hooks=[(z_name(4), add_clean)])
        by_hand = jhooks.run_with_hooks(
            model, params, X, fwd_hooks=[(z_name(4), lambda z, n, v=value: z + v)]
        )
        close(out, by_hand)
    n = len(TRACES)
    assert n <= 2 + 1 + 2  # per hook code; the numbers of the by-hand one change once


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_cache_through_a_jitted_fn_is_full_every_call(maybe_jit, wrap):
    fn = WRAPS[wrap](model)
    params = _params()
    names = {z_name(i) for i in range(LAYERS)}
    names |= {f"blocks.{i}.hook_resid_post" for i in range(LAYERS)}
    for _ in range(2):
        out, cache = maybe_jit(lambda p, x: jhooks.run_with_cache(fn, p, x))(params, X)
        assert set(cache) == names
        close(out, model(params, X))


def test_bad_names_raise_on_every_call():
    fn = jax.jit(model)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"no hook point named 'blocks.0.attn.hook_zz'"):
            jhooks.run_with_hooks(
                fn, _params(), X, fwd_hooks=[("blocks.0.attn.hook_zz", lambda z, n: None)]
            )


def test_static_values_and_the_error_for_traced_ones(maybe_jit):
    params = _params()

    def first_heads(z, name, n):
        return z.at[:, :n].set(0.0)  # a slice bound must be concrete

    def run(params, n):
        hook = functools.partial(first_heads, n=n)
        return jhooks.run_with_hooks(model, params, X, fwd_hooks=[(z_name(0), hook)])

    # A number a hook uses as a shape (a slice bound) makes another structure: one
    # program per value, found again for a value seen before.
    for n in (2, 3, 2, 4):
        out = maybe_jit(lambda p, n=n: run(p, n))(params)
        close(out, model(params, X, (0, slice(None, n), 0.0)))
    TRACES.clear()
    for n in (2, 3, 2):
        out = maybe_jit(lambda p, n=n: run(p, jhooks.static(n)))(params)
        close(out, model(params, X, (0, slice(None, n), 0.0)))
    if maybe_jit is not jax.jit:
        assert len(TRACES) == 3  # the programs of 2 and 3 again; the 3 by hand
    # A hook runs as Python on the real objects: it may read an array's value.
    count = jnp.asarray(3)

    def first_count(z, name):
        return z.at[:, : int(count)].set(0.0)

    def counted(p):
        return jhooks.run_with_hooks(model, p, X, fwd_hooks=[(z_name(0), first_count)])

    close(maybe_jit(counted)(params), model(params, X, (0, slice(None, 3), 0.0)))
    # A hook's numbers follow Python: math.copysign tells 0.0 from -0.0.
    signs = [
        jhooks.run_with_hooks(
            model,
            params,
            X,
            fwd_hooks=[(z_name(0), lambda z, _, s=jhooks.static(s): z * math.copysign(1.0, s))],  # noqa: B008
        )
        for s in (0.0, -0.0)
    ]
    close(signs[0], model(params, X))
    z0 = jnp.tanh(X @ params["w"][0]).reshape(SEQ, HEADS, D_HEAD)
    close(signs[1], model(params, X, (0, slice(None), -z0)))
    assert jhooks.static(2) == 2 and isinstance(jhooks.static(2.5), float)
    with pytest.raises(TypeError, match="jhooks.static takes a Python number or a tuple"):
        jhooks.static(jnp.ones(2))


def test_scalars_stay_weakly_typed(maybe_jit):
    def f(x, i):
        return jhooks.hook_point(x, "x"), jhooks.hook_point(i, "i")

    hooks = [("x", lambda v, n, s=2.0: v * s), ("i", lambda v, n, k=3: v + k)]
    x, i = maybe_jit(lambda x, i: jhooks.run_with_hooks(f, x, i, fwd_hooks=hooks))(
        jnp.ones(2, jnp.bfloat16), jnp.int8(1)
    )
    assert (x.dtype, i.dtype) == (jnp.bfloat16, jnp.int8)
    close(x.astype(jnp.float32), jnp.full(2, 2.0))
    assert int(i) == 4


def test_models_and_functions_are_not_kept_alive():
    class Net(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jhooks.hook_point(x @ self.w, "h").sum()

    net = jhooks.hookable(Net(jnp.ones((D, D))))
    params = _params()

    def fn(x):
        return model(params, x)

    refs = [weakref.ref(net), weakref.ref(fn)]
    jhooks.run_with_hooks(net, X, fwd_hooks=[("h", lambda v, n: v * 2.0)])
    jhooks.run_with_cache(net, X)
    jhooks.run_with_hooks(fn, X, fwd_hooks=[(z_name(0), lambda v, n: v * 2.0)])
    jhooks.run_with_cache(jax.jit(fn), X, names_filter=z_name(1))
    del net, fn
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_transformerlens_hook_signature(maybe_jit):
    seen = []

    def tl_hook(value, hook):
        seen.append((hook.name, hook.layer(), hook == "blocks.3.attn.hook_z"))
        return value * 0.0

    params = _params()
    out = maybe_jit(lambda p: jhooks.run_with_hooks(model, p, X, fwd_hooks=[(z_name(3), tl_hook)]))(
        params
    )
    assert seen == [("blocks.3.attn.hook_z", 3, True)]
    close(out, model(params, X, (3, slice(None), 0.0)))


def test_stack_activation(maybe_jit):
    params = _params()
    _, cache = maybe_jit(lambda p: jhooks.run_with_cache(model, p, X))(params)
    stacked = jhooks.stack_activation(cache, "hook_resid_post")
    assert stacked.shape == (LAYERS, SEQ, D)
    close(stacked[4], cache["blocks.4.hook_resid_post"])
    z = jhooks.stack_activation(cache, "blocks.*.attn.hook_z", layer=3)
    assert z.shape == (3, SEQ, HEADS, D_HEAD)
    close(jhooks.stack_activation(cache, "attn.hook_z"), jhooks.stack_activation(cache, "hook_z"))
    with pytest.raises(ValueError, match=r"no cached .*hook_resid_pre.* mean 'hook_resid_post'"):
        jhooks.stack_activation(cache, "hook_resid_pre")
    del cache["blocks.2.hook_resid_post"]
    with pytest.raises(ValueError, match=r"but not for layers \[2\]"):
        jhooks.stack_activation(cache, "hook_resid_post")
    with pytest.raises(ValueError, match=r"matches both 'a.0.x.h' and 'a.0.y.h' in layer 0"):
        jhooks.stack_activation({"a.0.x.h": X, "a.0.y.h": X}, "h")


def test_cache_without_output_and_in_another_dtype(maybe_jit):
    params = _params()
    name = "blocks.2.hook_resid_post"
    _, full = jhooks.run_with_cache(model, params, X, names_filter=name)
    out, cache = maybe_jit(
        lambda p: jhooks.run_with_cache(model, p, X, names_filter=name, return_output=False)
    )(params)
    assert out is None
    close(cache[name], full[name])
    _, half = maybe_jit(lambda p: jhooks.run_with_cache(model, p, X, dtype=jnp.bfloat16))(params)
    assert half[name].dtype == jnp.bfloat16
    close(half[name].astype(jnp.float32), np.asarray(full[name]).astype(jnp.bfloat16))

    def flops(**kw):
        fn = jax.jit(lambda p: jhooks.run_with_cache(model, p, X, names_filter=name, **kw))
        return fn.lower(params).compile().cost_analysis()["flops"]

    assert flops(return_output=False) < 0.4 * flops()
    with pytest.raises(TypeError, match="run_with_cache: dtype .* a floating dtype, got int32"):
        jhooks.run_with_cache(model, params, X, dtype=jnp.int32)


GRAD_SCALE = 1.0


def test_backward_hooks_read_values_afresh(maybe_jit):
    global GRAD_SCALE
    params = _params()

    def scaled(g, name):
        return g * GRAD_SCALE

    def grad_x(x):
        return jax.grad(
            lambda x: jhooks.run_with_hooks(model, params, x, bwd_hooks=[(z_name(11), scaled)])
        )(x)

    base = jax.grad(lambda x: model(params, x))(X)
    results = []
    for GRAD_SCALE in (1.0, 0.0, 2.0):  # noqa: B007
        results.append(maybe_jit(lambda x: grad_x(x))(X))  # a new jit: jax.jit bakes globals
    GRAD_SCALE = 1.0
    close(results[0], base)
    # The gradient is linear in the scale of the part that flows through the last z.
    np.testing.assert_allclose(results[2] - results[0], results[0] - results[1], atol=1e-4)
    assert not np.allclose(results[1], base, atol=1e-3)


def test_functions_that_need_concrete_values_are_explained():
    def data_dependent(x):
        return x * 2 if float(jnp.sum(x)) > 0 else x  # Python control flow on a value

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        jhooks.run_with_cache(data_dependent, X)
    assert "compiles `fn` (once per structure, eager calls too)" in "".join(
        getattr(info.value, "__notes__", [])
    )


COUNT = 0


def test_functions_that_assign_globals_keep_their_module():
    def counted(params, x):
        global COUNT
        COUNT += 1
        return model(params, x)

    params = _params(layers=2)
    before = COUNT
    jhooks.run_with_hooks(counted, params, X, fwd_hooks=[(z_name(1), lambda z, n: z * 2.0)])
    assert COUNT == before + 1


def test_gradients_flow_to_values_hooks_close_over(maybe_jit):
    params = _params(layers=3)

    def steered(v):
        return jhooks.run_with_hooks(model, params, X, fwd_hooks=[(z_name(1), lambda z, n: z + v)])

    def by_hand(v):  # concrete v: differences of two runs
        return jhooks.run_with_hooks(model, params, X, fwd_hooks=[(z_name(1), lambda z, n: z + v)])

    v = jnp.full((SEQ, HEADS, D_HEAD), 0.1)
    value, grad = maybe_jit(jax.value_and_grad(steered))(v)
    eps = 1e-2
    direction = jnp.zeros_like(v).at[0, 0, 0].set(1.0)
    numeric = (by_hand(v + eps * direction) - by_hand(v - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(grad[0, 0, 0], numeric, rtol=2e-2)
    close(value, by_hand(v))


def test_jitted_functions_deeper_inside_retrace_in_each_program(maybe_jit):
    params = _params(layers=3)
    inner = jax.jit(model)

    def outer(params, x):
        return inner(params, x) * 1.0

    source = jnp.full((SEQ, HEADS, D_HEAD), 0.5)
    for name in (z_name(1), z_name(2), z_name(1)):  # new structures, then an old one
        for head in (0, 5):
            hook = functools.partial(patch, head=head, source=source)
            run = maybe_jit(lambda p, hook=hook, name=name: jhooks.run_with_hooks(
                outer, p, X, fwd_hooks=[(name, hook)]
            ))  # fmt: skip
            layer = int(name.split(".")[1])
            close(run(params), model(params, X, (layer, head, source[:, head])))

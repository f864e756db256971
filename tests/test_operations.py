"""Operation addresses (`blocks.0.attn/softmax`): listed by `jhooks.ops`, selected by runs.

Each model here has a hand-annotated twin: the same weights and code, with a
`hook_point` on the attention pattern (`...attn.hook_pattern`). Caching, patching and
differentiating the address must give what the twin's point gives: bitwise, as the
program is the same.
"""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

T, D, H, L = 5, 8, 2, 2


class Attn(eqx.Module):
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    annotate: bool = eqx.field(static=True)

    def __call__(self, x):
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        q, k, v = (a.reshape(T, H, D // H) for a in (q, k, v))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(D // H)
        pattern = jax.nn.softmax(scores, axis=-1)
        if self.annotate:
            pattern = jhooks.hook_point(pattern, "hook_pattern")
        z = jnp.einsum("hqk,khd->qhd", pattern, v)
        return jax.vmap(self.out)(z.reshape(T, D))


class Block(eqx.Module):
    attn: Attn
    mlp: eqx.nn.Linear

    def __init__(self, key, annotate=False):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = Attn(eqx.nn.Linear(D, 3 * D, key=k1), eqx.nn.Linear(D, D, key=k2), annotate)
        self.mlp = eqx.nn.Linear(D, D, key=k3)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + jax.vmap(self.mlp)(jax.nn.gelu(x))


class LoopGPT(eqx.Module):
    blocks: list

    def __init__(self, annotate=False):
        keys = jax.random.split(jax.random.key(0), L)
        self.blocks = [Block(k, annotate) for k in keys]

    def __call__(self, x):
        for block in self.blocks:
            x = eqx.filter_jit(block)(x)  # addresses inside a nested jit
        return x


class ScanGPT(eqx.Module):
    blocks: Block

    def __init__(self, annotate=False):
        keys = jax.random.split(jax.random.key(0), L)
        self.blocks = eqx.filter_vmap(lambda k: Block(k, annotate))(keys)

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        @jax.checkpoint  # addresses inside a checkpoint inside the scan
        def body(x, p):
            return eqx.combine(p, static)(x), None

        return jax.lax.scan(body, x, params)[0]


def loss(model, x):
    return jnp.sum(jnp.tanh(model(x)) ** 2)


def x_data(seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(T, D)).astype(np.float32))


@pytest.fixture(scope="module", params=["loop", "scan"])
def pair(request):
    """(model, twin with hook points on the pattern, layer names: `blocks.0` or `blocks`)."""
    cls = LoopGPT if request.param == "loop" else ScanGPT
    layers = [f"blocks.{i}" for i in range(L)] if request.param == "loop" else ["blocks"]
    return jhooks.hookable(cls()), jhooks.hookable(cls(annotate=True)), layers


def test_ops_lists_every_operation_with_its_shape_and_line():
    model = jhooks.hookable(LoopGPT())
    found = {op.address: op for op in jhooks.ops(model, x_data())}
    line = Attn.__call__.__code__.co_firstlineno + 4  # `pattern = jax.nn.softmax(...)`
    for i in range(L):
        op = found[f"blocks.{i}.attn/softmax"]
        assert op.shape == (H, T, T) and op.dtype == jnp.float32
        assert op.source.endswith(f"test_operations.py:{line}")
        # Per name, in program order: the two residual adds, the two einsums.
        assert {f"blocks.{i}/add", f"blocks.{i}/add:1", f"blocks.{i}/gelu"} <= set(found)
        assert found[f"blocks.{i}.attn/einsum:1"].shape == (T, H, D // H)
        assert f"blocks.{i}.attn/einsum:2" not in found
        assert found[f"blocks.{i}.mlp/dot_general"].source.endswith("_linear.py:97")
    # Under the scan, one iteration's shape; the same names without the layer index.
    scanned = {op.address: op for op in jhooks.ops(jhooks.hookable(ScanGPT()), x_data())}
    assert scanned["blocks.attn/softmax"].shape == (H, T, T)
    assert {a.replace("blocks.0", "blocks") for a in found if a.startswith("blocks.0")} == set(
        scanned
    )


def test_ops_leave_out_what_jhooks_and_hooks_compute():
    """Hook points and module hooks add no operation, and change no address."""
    plain, annotated = jhooks.hookable(LoopGPT()), jhooks.hookable(LoopGPT(annotate=True))
    before = [op.address for op in jhooks.ops(plain, x_data())]
    handle = annotated.blocks[0].attn.register_forward_hook(lambda m, a, out: out * 2.0 + 1.0)
    try:
        assert [op.address for op in jhooks.ops(annotated, x_data())] == before
    finally:
        handle.remove()


class EditedAttn(Attn):
    """An unrelated operation added before the softmax."""

    def __call__(self, x):
        x = x * 1.0 + 0.0
        return super().__call__(x)


def test_an_earlier_edit_keeps_the_address():
    model, old = jhooks.hookable(LoopGPT()), LoopGPT()
    new = EditedAttn(old.blocks[0].attn.qkv, old.blocks[0].attn.out, False)
    edited = jhooks.hookable(eqx.tree_at(lambda m: m.blocks[0].attn, old, new))
    before = {op.address for op in jhooks.ops(model, x_data()) if "blocks.0.attn/" in op.address}
    after = {op.address for op in jhooks.ops(edited, x_data()) if "blocks.0.attn/" in op.address}
    assert "blocks.0.attn/softmax" in after and before < after  # only new names: mul, add


def test_cache_and_gradient_equal_the_annotated_twin(pair, maybe_jit):
    model, twin, layers = pair
    x = x_data()
    run = maybe_jit(
        lambda m, x: jhooks.run_with_cache(
            loss,
            m,
            x,
            names_filter="blocks**.attn/softmax",  # `**`: any part of a path
            incl_bwd=True,  # a glob
        )
    )
    out, cache = run(model, x)
    twin_out, twin_cache = jax.jit(
        lambda m, x: jhooks.run_with_cache(
            loss, m, x, names_filter="blocks*.attn.hook_pattern", incl_bwd=True
        )
    )(twin, x)
    np.testing.assert_array_equal(out, twin_out)
    assert sorted(cache) == sorted(f"{n}.attn/softmax{g}" for n in layers for g in ("", "_grad"))
    for n in layers:
        value, grad = cache[f"{n}.attn/softmax"], cache[f"{n}.attn/softmax_grad"]
        # Under the scan, stacked along the layers as points are.
        assert value.shape == ((H, T, T) if len(layers) == L else (L, H, T, T))
        np.testing.assert_array_equal(value, twin_cache[f"{n}.attn.hook_pattern"])
        np.testing.assert_allclose(
            grad, twin_cache[f"{n}.attn.hook_pattern_grad"], rtol=1e-6, atol=1e-7
        )
    np.testing.assert_allclose(value.sum(-1), np.ones(value.shape[:-1]), rtol=1e-5)


def zero_row(p, name):
    return p.at[..., 1, 2, :].set(0.0)  # head 1, query 2 (every layer under a scan)


def test_patching_and_backward_hooks_equal_the_annotated_twin(pair, maybe_jit):
    model, twin, layers = pair
    x = x_data()
    address, point = f"{layers[-1]}.attn/softmax", f"{layers[-1]}.attn.hook_pattern"

    def scale(g, name):
        return g * 3.0

    def patched_grads(m, name):
        return jax.value_and_grad(
            lambda m: jhooks.run_with_hooks(
                loss, m, x, fwd_hooks=[(name, zero_row)], bwd_hooks=[(name, scale)]
            )
        )(m)

    value, grads = maybe_jit(lambda m: patched_grads(m, address))(model)
    twin_value, twin_grads = patched_grads(twin, point)
    plain_grads = jax.grad(loss)(model, x)
    changed = [not np.allclose(a, b) for a, b in zip(*map(jax.tree.leaves, (grads, plain_grads)))]
    assert any(changed)
    assert abs(float(value) - float(loss(model, x))) > 1e-4  # the patch changed the output
    np.testing.assert_allclose(value, twin_value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(twin_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_an_unknown_address_lists_the_closest(maybe_jit):
    model = jhooks.hookable(LoopGPT())
    with pytest.raises(ValueError) as err:
        maybe_jit(lambda m, x: jhooks.run_with_cache(m, x, names_filter="blocks.0.attn/softmx"))(
            model, x_data()
        )
    text = str(err.value)
    assert text.startswith(
        "run_with_cache (names_filter): no operation at address 'blocks.0.attn/softmx'. "
        "Did you mean 'blocks.0.attn/softmax'"
    )
    assert "The operations (jhooks.ops):" in text
    with pytest.raises(ValueError, match=r"no operation at address 'blocks\.\*\.attn/relu'"):
        jhooks.run_with_hooks(model, x_data(), fwd_hooks=[("blocks.*.attn/relu", zero_row)])


def test_names_without_a_slash_select_no_operation():
    """`None`, predicates and point names select points only: the cache is unchanged."""
    model = jhooks.hookable(LoopGPT())
    _, cache = jhooks.run_with_cache(model, x_data())
    assert cache and not any("/" in name for name in cache)
    _, cache = jhooks.run_with_cache(
        model, x_data(), names_filter=["blocks.0.attn/softmax", "blocks.0.attn"]
    )
    assert sorted(cache) == ["blocks.0.attn", "blocks.0.attn/softmax"]


# --------------------------------------------------------------------------- stock layers


class StockAttention(eqx.Module):
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return self.attn(x, x, x)


def test_stock_multihead_attention_pattern_equals_pytorch(maybe_jit):
    heads, d = 2, 8
    model = jhooks.hookable(
        StockAttention(eqx.nn.MultiheadAttention(heads, d, key=jax.random.key(3)))
    )
    x = x_data()
    jit = eqx.filter_jit if maybe_jit is jax.jit else maybe_jit  # Dropout holds a Python bool
    out, cache = jit(lambda m, x: jhooks.run_with_cache(m, x, names_filter="attn/softmax"))(
        model, x
    )
    pattern = cache["attn/softmax"]
    assert pattern.shape == (heads, T, T)  # every head, as the hook sees it too
    a = model.attn
    net = torch.nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
    with torch.no_grad():
        w = np.concatenate([np.asarray(p.weight) for p in (a.query_proj, a.key_proj, a.value_proj)])
        net.in_proj_weight.copy_(torch.from_numpy(w))
        net.out_proj.weight.copy_(torch.from_numpy(np.array(a.output_proj.weight)))
        xt = torch.from_numpy(np.array(x))[None]
        t_out, t_weights = net(xt, xt, xt, need_weights=True, average_attn_weights=False)
    np.testing.assert_allclose(pattern, t_weights[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, t_out[0].numpy(), rtol=1e-5, atol=1e-6)

    # Patching one head edits that head only.
    def zero_head_1(p, name):
        assert p.shape == (heads, T, T)
        return p.at[1].set(0.0)

    patched = jit(
        lambda m, x: jhooks.run_with_hooks(m, x, fwd_hooks=[("attn/softmax", zero_head_1)])
    )(model, x)
    hd = d // heads
    v = np.asarray(jax.vmap(a.value_proj)(x)).reshape(T, heads, hd)
    z = np.einsum("hqk,khd->qhd", np.asarray(pattern), v)
    z[:, 1] = 0.0
    expected = np.asarray(jax.vmap(a.output_proj)(jnp.asarray(z.reshape(T, d))))
    np.testing.assert_allclose(patched, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- custom rules


@jax.custom_jvp
def my_softmax(s):
    e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
    return e / e.sum(-1, keepdims=True)


@my_softmax.defjvp
def _my_softmax_jvp(primals, tangents):
    (s,), (t,) = primals, tangents
    y = my_softmax(s)
    return y, y * (t - (y * t).sum(-1, keepdims=True))


@jax.custom_vjp
def clip_grad(x):
    return x


clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))


class CustomMix(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return clip_grad(my_softmax(x @ self.w)) @ x


def test_custom_derivative_rules_are_kept(maybe_jit):
    model = jhooks.hookable(CustomMix(jax.random.normal(jax.random.key(2), (D, T))))
    x = x_data()
    names = ["/my_softmax", "/clip_grad"]
    assert set(names) <= {op.address for op in jhooks.ops(model, x)}

    def patched_loss(m):
        hooks = [(n, lambda v, name: v * 1.0) for n in names]
        return jhooks.run_with_hooks(loss, m, x, fwd_hooks=hooks)

    g = maybe_jit(jax.grad(patched_loss))(model)
    g0 = jax.jit(jax.grad(loss))(model, x)
    np.testing.assert_array_equal(g.w, g0.w)  # the program's own gradient: rules kept
    # The custom_vjp's rule ran: the cotangent it passes on is clipped...
    _, cache = maybe_jit(
        lambda m: jhooks.run_with_cache(loss, m, x, names_filter=names, incl_bwd=True)
    )(model)
    assert float(jnp.abs(cache["/my_softmax_grad"]).max()) == pytest.approx(1e-3)
    # ...where the gradient it receives is not.
    assert float(jnp.abs(cache["/clip_grad_grad"]).max()) > 1e-2
    p = my_softmax(x @ model.w)
    expected = jnp.clip(jax.grad(lambda p: jnp.sum(jnp.tanh(p @ x) ** 2))(p), -1e-3, 1e-3)
    np.testing.assert_allclose(cache["/my_softmax_grad"], expected, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------- programs

_METADATA = re.compile(r", metadata=\{[^}]*\}")


def optimized_hlo(fn, *args):
    """The optimized program's computations, without metadata (source lines, names)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    start = re.search(r"^(%|ENTRY)", text, re.MULTILINE)
    assert start is not None
    lines = _METADATA.sub("", text[start.start() :]).splitlines()
    body = "\n".join(line for line in lines if not line.endswith("{"))  # headers: arg names
    names: dict[str, str] = {}  # instruction names, numbered by first use
    return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m[0], f"%{len(names)}"), body)


def test_programs_without_and_with_a_selected_operation():
    """No operation selected: the program of the model without jhooks. One selected:
    the program of the twin whose point sits at that place."""
    plain, model = LoopGPT(), jhooks.hookable(LoopGPT())
    twin = jhooks.hookable(LoopGPT(annotate=True))
    x = x_data()
    assert optimized_hlo(loss, model, x) == optimized_hlo(loss, plain, x)
    hooked = optimized_hlo(
        lambda m, x: jhooks.run_with_hooks(loss, m, x, fwd_hooks=[("blocks.1", lambda v, n: v)]),
        model,
        x,
    )
    assert hooked == optimized_hlo(loss, plain, x)

    def cache(names):
        return lambda m, x: jhooks.run_with_cache(loss, m, x, names_filter=names)

    selected = optimized_hlo(cache("blocks.0.attn/softmax"), model, x)
    assert selected == optimized_hlo(cache("blocks.0.attn.hook_pattern"), twin, x)
    assert selected != optimized_hlo(cache([]), model, x)


_COLLECTIVE = re.compile(
    r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\("
)


def collectives(fn, *args):
    return sorted(_COLLECTIVE.findall(optimized_hlo(fn, *args)))


def test_a_cached_operation_adds_no_collective_under_sharded_jit():
    """Eight devices, the batch split over them: caching an address compiles to the
    collectives of the plain step, as caching the twin's point does."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    xs = jax.device_put(
        jnp.stack([x_data(seed) for seed in range(8)]), NamedSharding(mesh, P("data"))
    )
    model, twin = jhooks.hookable(LoopGPT()), jhooks.hookable(LoopGPT(annotate=True))

    def step(names):
        def batch_loss(m, xs):
            return jnp.mean(jax.vmap(lambda x: loss(m, x))(xs))

        def run(m, xs):
            value, grads = jax.value_and_grad(
                lambda m: jhooks.run_with_cache(batch_loss, m, xs, names_filter=names)[0]
            )(m)
            _, cache = jhooks.run_with_cache(batch_loss, m, xs, names_filter=names)
            return value, grads, cache

        return run

    plain = collectives(step([]), model, xs)
    assert plain  # the gradient's all-reduce over the batch
    cached = collectives(step("blocks.0.attn/softmax"), model, xs)
    assert cached == collectives(step("blocks.0.attn.hook_pattern"), twin, xs)
    assert cached == plain


def test_loop_index_in_a_hook_on_an_address_under_scan():
    """A hook on an address inside the scan over layers reads its layer, as one on the
    twin's point does, also when both are hooked in one run."""
    twin = jhooks.hookable(ScanGPT(annotate=True))
    x = x_data()

    def zero_layer_1(p, name):
        (layer,) = jhooks.loop_index()
        return jnp.where(layer == 1, 0.0, p)

    by_point = jhooks.run_with_hooks(
        twin, x, fwd_hooks=[("blocks.attn.hook_pattern", zero_layer_1)]
    )
    by_address = jhooks.run_with_hooks(twin, x, fwd_hooks=[("blocks.attn/softmax", zero_layer_1)])
    both = jhooks.run_with_hooks(
        twin,
        x,
        fwd_hooks=[("blocks.attn.hook_pattern", zero_layer_1), ("blocks.attn/div", lambda v, n: v)],
    )
    np.testing.assert_array_equal(by_address, by_point)
    np.testing.assert_array_equal(both, by_point)
    assert not np.allclose(by_point, twin(x))


class Branchy(eqx.Module):
    """A module whose operations sit in a `lax.cond` and a `lax.while_loop`."""

    def __call__(self, x, n):
        y = jax.lax.cond(x.sum() > 0, lambda x: jnp.exp(x), lambda x: jnp.exp(-x), x)
        return jax.lax.fori_loop(0, n, lambda i, y: jnp.sin(y), y)  # n traced: a while


def test_forward_hooks_on_addresses_in_cond_and_while_loop(maybe_jit):
    model = jhooks.hookable(Branchy())
    x, n = x_data(), jnp.asarray(3)
    assert {"/exp", "/exp:1", "/sin"} <= {op.address for op in jhooks.ops(model, x, n)}
    run = maybe_jit(
        lambda x, n: jhooks.run_with_hooks(
            model,
            x,
            n,
            fwd_hooks=[("/exp*", lambda v, name: v + 1.0), ("/sin", lambda v, name: 2 * v)],
        )
    )
    y = jnp.exp(x) + 1.0 if float(x.sum()) > 0 else jnp.exp(-x) + 1.0
    for _ in range(3):
        y = 2 * jnp.sin(y)
    np.testing.assert_allclose(run(x, n), y, rtol=1e-6)
    with pytest.raises(ValueError, match=r"'/sin' is inside a lax\.while_loop"):
        jhooks.run_with_cache(model, x, n, names_filter="/sin")


class _Rope(eqx.Module):
    def __call__(self, x):
        return jnp.concatenate([x, -x], axis=-1)


class _HasRope(eqx.Module):
    """A model with a submodule at the path `rope`."""

    rope: _Rope = _Rope()

    def __call__(self, x):
        return self.rope(x)


class _Scoped(eqx.Module):
    """A model whose own code names a scope after module paths: `rope`, which another
    model has as a submodule, and `mlp`, its own sibling's path."""

    mlp: _Rope = _Rope()

    def __call__(self, x):
        with jax.named_scope("rope"):
            y = jnp.concatenate([x, x], axis=-1)
        with jax.named_scope("mlp"):
            y = jnp.sin(y)
        return self.mlp(y)


def test_a_scope_of_the_users_is_not_a_module_whatever_ran_before(maybe_jit):
    """A module's operations are addressed by the scopes module calls entered, not by the
    names of scopes: the model's own `jax.named_scope("rope")` stays outside every module,
    before and after another model with a module at `rope` ran (tunix's Gemma 3 RoPE)."""
    x = jnp.arange(3.0)
    scoped = jhooks.hookable(_Scoped())
    expected = ["/concatenate", "/sin", "mlp/neg", "mlp/concatenate"]
    assert [op.address for op in jhooks.ops(scoped, x)] == expected
    assert [op.address for op in jhooks.ops(jhooks.hookable(_HasRope()), x)] == [
        "rope/neg",
        "rope/concatenate",
    ]
    assert [op.address for op in jhooks.ops(scoped, x)] == expected
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(scoped, x, names_filter="/sin"))(x)
    np.testing.assert_allclose(cache["/sin"], np.sin(np.concatenate([x, x])))

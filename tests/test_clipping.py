"""`jhooks.clipped_grad` against per-example gradients (`jax.vmap(eqx.filter_grad)`) + clipping.

Each case checks the norms and the clipped sums to 1e-5 relative under `eqx.filter_jit`,
and that no per-example gradient warning fires for stock layers. The exactness cases (an
MLP, a CNN, a transformer: every stock layer's rule) and the `in_axes` cases run eagerly
too; the cases of one rule each run jitted only, as the eager path runs the same rules.
"""

from __future__ import annotations

import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clipping_reference import RTOL, reference
from clipping_reference import assert_matches as reference_matches

import jhooks


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    return eqx.filter_jit if request.param else (lambda f: f)


# --------------------------------------------------------------------------- models


class MLP(eqx.Module):
    layers: list

    def __init__(self, key, sizes=(6, 16, 16, 3)):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i == 0 else jax.nn.relu(x))
        return x


class CNN(eqx.Module):
    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.c1 = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.c2 = eqx.nn.Conv2d(4, 6, 3, stride=2, key=k2)
        self.fc = eqx.nn.Linear(6 * 3 * 3, 5, key=k3)

    def __call__(self, x):
        h = jax.nn.relu(self.c1(x))
        h = jax.nn.relu(self.c2(h))
        return self.fc(h.reshape(-1))


class Transformer(eqx.Module):
    emb: eqx.nn.Embedding
    pos: jax.Array
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key, vocab=11, d=8, t=5, heads=2):
        ks = jax.random.split(key, 6)
        self.emb = eqx.nn.Embedding(vocab, d, key=ks[0])
        self.pos = jax.random.normal(ks[1], (t, d))
        self.ln1 = eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=ks[2])
        self.ln2 = eqx.nn.LayerNorm(d)
        self.fc1 = eqx.nn.Linear(d, 2 * d, key=ks[3])
        self.fc2 = eqx.nn.Linear(2 * d, d, key=ks[4])
        self.head = eqx.nn.Linear(d, 3, key=ks[5])

    def __call__(self, ids):
        h = jax.vmap(self.emb)(ids) + self.pos
        x = jax.vmap(self.ln1)(h)
        h = h + self.attn(x, x, x)
        x = jax.vmap(self.ln2)(h)
        h = h + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))
        return self.head(jnp.mean(h, axis=0))


def xent(model, x, y):
    return -jax.nn.log_softmax(model(x))[y]


def assert_matches(loss, model, batch, max_norm, maybe_jit, in_axes=(None, 0, 0), rtol=RTOL):
    return reference_matches(
        loss, model, batch, max_norm, maybe_jit, in_axes, rtol=rtol, ghost=False
    )


KEY = jax.random.key(1)


def mlp_case():
    return MLP(KEY), (jax.random.normal(KEY, (7, 6)), jnp.arange(7) % 3)


def cnn_case():
    return CNN(KEY), (jax.random.normal(KEY, (7, 1, 8, 8)), jnp.arange(7) % 5)


def transformer_case():
    return Transformer(KEY), (jax.random.randint(KEY, (7, 5), 0, 11), jnp.arange(7) % 3)


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("case", [mlp_case, cnn_case, transformer_case], ids=lambda c: c.__name__)
@pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clipping", "no-clipping"])
def test_matches_per_example_gradients(case, max_norm, maybe_jit):
    model, batch = case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stock layers: no per-example fallback
        assert_matches(xent, model, batch, max_norm, maybe_jit)


def test_clipped_norms_are_at_most_max_norm():
    model, batch = mlp_case()
    _, norms = jhooks.clipped_grad(xent, 0.5)(model, *batch)
    w = np.minimum(1, 0.5 / np.asarray(norms))
    assert np.all(np.asarray(norms) * w <= 0.5 * (1 + 1e-6)) and np.any(w < 1)


def test_float32_in_float32_out():
    model, batch = transformer_case()
    grads, norms = eqx.filter_jit(jhooks.clipped_grad(xent, 1.0))(model, *batch)
    assert norms.dtype == jnp.float32 and norms.shape == (7,)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_float64():
    with jax.enable_x64(True):
        model = jax.tree.map(
            lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, MLP(KEY)
        )
        batch = (jax.random.normal(KEY, (7, 6), jnp.float64), jnp.arange(7) % 3)
        grads, norms = assert_matches(xent, model, batch, 0.1, eqx.filter_jit, rtol=1e-10)
        assert norms.dtype == jnp.float64


# --------------------------------------------------------------------------- in_axes


def test_no_labels(maybe_jit):
    model, (xs, _) = mlp_case()
    assert_matches(lambda m, x: jnp.sum(m(x) ** 2), model, (xs,), 0.3, maybe_jit, (None, 0))


def test_batch_on_another_axis_and_shared_argument(maybe_jit):
    model, (xs, _) = mlp_case()
    target = jnp.linspace(-1.0, 1.0, 3)

    def loss(m, x, t):
        return jnp.sum((m(x) - t) ** 2)

    assert_matches(loss, model, (xs.T, target), 0.3, maybe_jit, (None, 1, None))


def test_dict_batch(maybe_jit):
    model, (xs, ys) = mlp_case()

    def loss(m, batch):
        return xent(m, batch["x"], batch["y"])

    assert_matches(loss, model, ({"x": xs, "y": ys},), 0.3, maybe_jit, (None, {"x": 0, "y": 0}))


def test_python_value_argument_stays_static(maybe_jit):
    model, (xs, ys) = mlp_case()

    def loss(m, x, y, temperature, mode):
        assert isinstance(temperature, float) and mode == "mean"  # not traced
        return -jax.nn.log_softmax(m(x) / temperature)[y]

    assert_matches(loss, model, (xs, ys, 2.0, "mean"), 0.3, maybe_jit, (None, 0, 0, None, None))


def test_per_example_random_keys(maybe_jit):
    class Drop(eqx.Module):
        mlp: MLP
        dropout: eqx.nn.Dropout

        def __call__(self, x, key):
            return self.mlp(self.dropout(x, key=key))

    model = Drop(MLP(KEY), eqx.nn.Dropout(0.5))
    xs, ys = mlp_case()[1]
    keys = jax.random.split(jax.random.key(3), xs.shape[0])

    def loss(m, x, y, key):
        return -jax.nn.log_softmax(m(x, key))[y]

    assert_matches(loss, model, (xs, ys, keys), 0.3, maybe_jit, (None, 0, 0, 0))


# --------------------------------------------------------------------------- model shapes


class WithStatic(eqx.Module):
    lin: eqx.nn.Linear
    activation: object = eqx.field(static=True)
    scale: float = 2.0  # a non-array leaf: not a parameter
    counts: jax.Array = eqx.field(default_factory=lambda: jnp.arange(3))  # an int array

    def __call__(self, x):
        return self.activation(self.lin(x)) * self.scale + jnp.sum(self.counts).astype(jnp.float32)


def test_non_array_fields():
    model = WithStatic(eqx.nn.Linear(6, 3, key=KEY), jax.nn.tanh)
    batch = (jax.random.normal(KEY, (5, 6)), jnp.arange(5) % 3)
    grads, _ = assert_matches(xent, model, batch, 0.2, eqx.filter_jit)
    assert grads.counts is None and grads.scale is None and grads.activation is jax.nn.tanh


class Twice(eqx.Module):
    lin: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, xs):
        h = jax.nn.tanh(self.lin(xs[0]))  # one vector ...
        h = jax.nn.tanh(self.lin(h))  # ... the same layer again on its own output ...
        seq = jax.vmap(self.lin)(xs)  # ... and at every position of a sequence
        return self.head(h + jnp.sum(jax.nn.tanh(seq), axis=0))


@pytest.mark.parametrize("length", [3, 40], ids=["gram", "direct"])
def test_layer_used_several_times(length):
    # 2 + 3 positions: Σ_{t,s} (a_t·a_s)(g_t·g_s); 2 + 40 (42² > 8·8): ‖aᵀg‖².
    k1, k2 = jax.random.split(KEY)
    model = Twice(eqx.nn.Linear(8, 8, key=k1), eqx.nn.Linear(8, 3, key=k2))
    batch = (jax.random.normal(KEY, (6, length, 8)), jnp.arange(6) % 3)
    assert_matches(xent, model, batch, 0.2, eqx.filter_jit)


@pytest.mark.parametrize("length", [3, 30], ids=["gram", "direct"])
def test_embedding_repeated_tokens(length):
    # A vocabulary of 4 rows: tokens repeat, and the index rule must add their gradients.
    class Bag(eqx.Module):
        emb: eqx.nn.Embedding
        head: eqx.nn.Linear

        def __call__(self, ids):
            return self.head(jnp.mean(jnp.tanh(jax.vmap(self.emb)(ids)), axis=0))

    k1, k2 = jax.random.split(KEY)
    model = Bag(eqx.nn.Embedding(4, 3, key=k1), eqx.nn.Linear(3, 2, key=k2))
    batch = (jax.random.randint(KEY, (5, length), 0, 4), jnp.arange(5) % 2)
    assert_matches(xent, model, batch, 0.1, eqx.filter_jit)


@pytest.mark.parametrize("conv", [1, 3])
def test_conv1d_conv3d(conv):
    layer_cls = {1: eqx.nn.Conv1d, 3: eqx.nn.Conv3d}[conv]
    layer = layer_cls(2, 3, 2, stride=1, dilation=1, padding=1, key=KEY)
    shape = (2,) + (4,) * conv

    def loss(m, x):
        return jnp.sum(jnp.tanh(m(x)) ** 2)

    assert_matches(
        loss, layer, (jax.random.normal(KEY, (5, *shape)),), 0.3, eqx.filter_jit, (None, 0)
    )


class ScalarLookup(eqx.Module):
    emb: eqx.nn.Embedding
    conv: eqx.nn.Conv2d

    def __call__(self, ids, image):
        h = self.emb(ids[0]) + 2 * self.emb(ids[1])  # traced scalar indices: dynamic_slice
        c = self.conv(image)
        return jnp.sum(jnp.tanh(h)) + jnp.sum(c**2) * jnp.sum(h)


def test_embedding_scalar_index_and_dilated_strided_conv():
    conv = eqx.nn.Conv2d(2, 3, 3, padding="SAME", dilation=2, stride=(1, 2), key=KEY)
    model = ScalarLookup(eqx.nn.Embedding(5, 3, key=KEY), conv)
    batch = (jax.random.randint(KEY, (4, 3), 0, 5), jax.random.normal(KEY, (4, 2, 7, 7)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches(lambda m, i, x: m(i, x), model, batch, 0.5, eqx.filter_jit)


def test_zero_gradient_example_gets_weight_one():
    model, (xs, ys) = mlp_case()

    def loss(m, x, y):
        return jnp.where(y == 0, 0.0, xent(m, x, y))

    grads, norms = jhooks.clipped_grad(loss, 0.1)(model, xs, ys)
    assert np.all(np.asarray(norms)[np.asarray(ys) == 0] == 0)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert_matches(loss, model, (xs, ys), 0.1, lambda f: f)


def test_hookable_model_with_module_hooks():
    # jhooks' own module hooks are part of the traced loss, so they are clipped through.
    model, batch = mlp_case()
    net = jhooks.hookable(model)
    net.layers[1].register_forward_hook(lambda module, args, out: 2 * out)
    net.layers[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches(xent, net, batch, 0.3, eqx.filter_jit)


def test_stopped_parameter_use_is_not_a_use():
    class Stopped(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):  # the weight again, as a constant (a target network, say)
            return self.lin(x) + jax.lax.stop_gradient(self.lin.weight) @ jnp.tanh(x)

    model = Stopped(eqx.nn.Linear(6, 6, key=KEY))
    batch = mlp_case()[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches(xent, model, batch, 0.3, eqx.filter_jit)


# --------------------------------------------------------------------------- fallback


def test_tied_embedding_is_exact_without_fallback():
    # A lookup and a matrix product of one weight: the cross term is a Gram product.
    class Tied(eqx.Module):
        emb: eqx.nn.Embedding

        def __call__(self, ids):
            h = jnp.mean(jax.vmap(self.emb)(ids), axis=0)
            return self.emb.weight @ h  # the embedding again, as the output layer

    model = Tied(eqx.nn.Embedding(5, 3, key=KEY))
    batch = (jax.random.randint(KEY, (4, 6), 0, 5), jnp.arange(4) % 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches(xent, model, batch, 0.2, eqx.filter_jit)


def test_elementwise_function_of_a_weight_in_a_product_falls_back_with_a_warning():
    # exp(W) @ x: the product is a site of exp(W), not of W (a grouped convolution, which
    # this test used, has a ghost rule now: tests/test_clipping_rules.py).
    class ExpWeight(eqx.Module):
        weight: jax.Array

        def __call__(self, x):
            return jnp.exp(self.weight) @ x

    layer = ExpWeight(0.1 * jax.random.normal(KEY, (4, 6)))
    xs = jax.random.normal(KEY, (3, 6))
    with pytest.warns(UserWarning, match=r"\.weight \(used by dot_general through exp\)"):
        assert_matches(lambda m, x: jnp.sum(m(x) ** 2), layer, (xs,), 1.0, lambda f: f, (None, 0))


# --------------------------------------------------------------------------- errors


def test_loss_must_return_a_scalar():
    model, batch = mlp_case()
    with pytest.raises(ValueError, match=r"must return a scalar \(shape \(\)\).*got float32\[3\]"):
        jhooks.clipped_grad(lambda m, x, y: m(x), 1.0)(model, *batch)


@pytest.mark.parametrize("bad", [0, -1.0])
def test_max_norm_must_be_positive(bad):
    with pytest.raises(ValueError, match=r"max_norm must be a number > 0; got"):
        jhooks.clipped_grad(xent, bad)


def test_max_norm_must_be_a_number():
    with pytest.raises(TypeError, match=r"max_norm must be a number > 0; got 'big'"):
        jhooks.clipped_grad(xent, "big")


def test_in_axes_must_batch_something():
    model, batch = mlp_case()
    with pytest.raises(ValueError, match=r"batches no argument; expected an integer axis"):
        jhooks.clipped_grad(xent, 1.0, in_axes=(None, None, None))(model, *batch)


def test_in_axes_model_entry_must_be_none():
    model, batch = mlp_case()
    with pytest.raises(ValueError, match=r"in_axes\[0\] must be None: the model is shared"):
        jhooks.clipped_grad(xent, 1.0, in_axes=(0, 0, 0))(model, *batch)


def test_in_axes_length_must_match_arguments():
    model, batch = mlp_case()
    with pytest.raises(ValueError, match=r"has 2 entries but the function was called with 3"):
        jhooks.clipped_grad(xent, 1.0, in_axes=(None, 0))(model, *batch)


def test_traced_max_norm():
    model, batch = mlp_case()

    @jax.jit
    def run(max_norm, model, xs, ys):
        return jhooks.clipped_grad(xent, max_norm)(model, xs, ys)

    grads, norms = run(jnp.float32(0.1), model, *batch)
    ref_grads, ref_norms = reference(xent, 0.1)(model, *batch)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-7)


def test_docstring_example_runs():
    doc = jhooks.clipped_grad.__doc__
    assert doc is not None
    code = doc.split("```python\n")[1].split("```")[0]
    exec(compile(textwrap.dedent(code), "clipped_grad docstring", "exec"), {})


@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_benchmark_harness_runs(tmp_path, case):
    from benchmarks import clipping as bench

    out = tmp_path / "clipping.json"
    argv = ["--quick", "--cases", case, "--batches", "4", "--reps", "1", "--min-time", "0.001"]
    saved = bench.main([*argv, "--out", str(out)])
    (result,) = saved["cases"].values()
    routes = {"clipped_grad_1pass", "clipped_grad_2pass", "norms_only"}  # the GPT shape's
    expected = set(bench.VARIANTS) - (set() if case == "gpt" else routes)
    assert set(result["time_s"]) == expected | {"opacus_ghost_best"}
    assert all(m["total"] > 0 for m in result["memory"].values())
    assert len(result["targets"]) == 4 and out.exists()
    assert result["fallback_warnings"] == [] and result["targets"]["no fallback warning"]


def test_no_per_example_gradient_is_held():
    # The point of ghost clipping, read off XLA's compiled memory: 64 per-example gradients
    # of a 2x256 MLP would be 64 x 132k floats; clipped_grad stays near the plain gradient.
    model = MLP(KEY, sizes=(256, 256, 256))
    xs, ys = jax.random.normal(KEY, (64, 256)), jnp.arange(64) % 10
    params, static = eqx.partition(model, eqx.is_array)

    def compiled_bytes(fn):
        run = jax.jit(lambda p, x, y: fn(eqx.combine(p, static), x, y))
        stats = run.lower(params, xs, ys).compile().memory_analysis()
        return stats.temp_size_in_bytes + stats.output_size_in_bytes

    def plain(m, x, y):
        return eqx.filter_grad(lambda m: jnp.sum(jax.vmap(xent, (None, 0, 0))(m, x, y)))(m)

    per_example = 64 * sum(p.size for p in jax.tree.leaves(params)) * 4
    clipped = compiled_bytes(jhooks.clipped_grad(xent, 1.0))
    assert clipped <= 1.5 * compiled_bytes(plain) < per_example / 10
    assert compiled_bytes(reference(xent, 1.0)) > 4 * clipped  # it holds some of them

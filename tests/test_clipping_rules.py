"""`jhooks.clipped_grad` on the cases issue 27 found: zero and cancelling per-example
gradients (Opacus' own ghost-clipping test model), a nested `jax.jit` closing over
constants, and the uses that had no ghost rule (concatenate, elementwise functions,
slices, grouped convolutions). Each against `jax.vmap(eqx.filter_grad)` + clipping, run
eagerly and under `eqx.filter_jit`, with warnings as errors (no per-example fallback)."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clipping_reference import RTOL, assert_matches, reference
from hypothesis import given, settings
from hypothesis import strategies as st

import jhooks

KEY1 = jax.random.key(1)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    return eqx.filter_jit if request.param else (lambda f: f)


# --------------------------------------------------------------------------- zero norms


class OpacusSample(eqx.Module):
    """Opacus' ghost-clipping test model (`SampleModule` in its
    grad_sample_module_fast_gradient_clipping_test.py), on 5 positions of 2 features."""

    fc1: eqx.nn.Linear
    ln: eqx.nn.LayerNorm
    fc3: eqx.nn.Linear
    fc4: eqx.nn.Linear
    fc5: eqx.nn.Linear

    def __call__(self, x):
        h = jax.vmap(self.ln)(jax.nn.relu(jax.vmap(self.fc1)(x)))
        h = jax.vmap(self.fc5)(jax.vmap(self.fc4)(jax.vmap(self.fc3)(h)))[:, 0]
        return jax.nn.softmax(h)  # over the positions, as Opacus' F.softmax(x) does


def soft_xent(model, x, y):
    """torch's CrossEntropyLoss with class-probability targets, of one example."""
    return -jnp.sum(y * jax.nn.log_softmax(model(x)))


def opacus_case(seed):
    """The model and batch in torch and in Equinox, with the same weights; two examples'
    targets zeroed (an exactly zero gradient)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    sizes = [(2, 2), (2, 1024), (1024, 1024), (1024, 1)]
    layers = [torch.nn.Linear(a, b) for a, b in sizes]
    xs, ys = torch.randn(10, 5, 2), torch.randint(0, 2, (10, 5)).float()
    ys[[1, 6]] = 0

    def linear(t):
        lin = eqx.nn.Linear(t.in_features, t.out_features, key=jax.random.key(0))
        lin = eqx.tree_at(lambda m: m.weight, lin, jnp.asarray(t.weight.detach().numpy()))
        return eqx.tree_at(lambda m: m.bias, lin, jnp.asarray(t.bias.detach().numpy()))

    fc1, fc3, fc4, fc5 = map(linear, layers)
    model = OpacusSample(fc1, eqx.nn.LayerNorm(2), fc3, fc4, fc5)
    return model, (jnp.asarray(xs.numpy()), jnp.asarray(ys.numpy())), (layers, xs, ys)


def assert_cancelling_close(grads, norms, ref_grads, ref_norms, max_norm):
    """Float32 results whose sums cancel: a Gram sum's rounding is relative to its terms,
    not to the (cancelled) norm, so a small norm carries an absolute error of about
    sqrt(float32 epsilon) times the terms' (1e-3 of the largest norm or of `max_norm`: a
    norm that small is not clipped); a gradient entry's, relative to the largest."""
    assert np.all(np.isfinite(norms)), norms
    atol = 1e-3 * max(float(np.max(ref_norms)), max_norm)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL, atol=atol)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale)


# Seed 4: the seed 1 gave a NaN eagerly only; seed 4 on every route, jitted too.
@pytest.mark.parametrize("passes", [1, 2])
def test_opacus_model_zero_and_cancelling_norms(passes, maybe_jit):
    # Two examples' gradients are exactly zero, and the others' Gram sums cancel: the
    # LayerNorm of two features is (-1, 1) or (1, -1) at every position, and the softmax's
    # gradient sums to zero over the positions. A squared norm that rounds below zero
    # clips as zero (it was a NaN norm, and a NaN gradient everywhere).
    model, batch, _ = opacus_case(4)
    fn = maybe_jit(jhooks.clipped_grad(soft_xent, 1.0, passes=passes))
    grads, norms = fn(model, *batch)
    assert np.all(np.asarray(norms)[[1, 6]] == 0)
    ref_grads, ref_norms = eqx.filter_jit(reference(soft_xent, 1.0))(model, *batch)
    assert_cancelling_close(grads, norms, ref_grads, ref_norms, 1.0)


def test_opacus_model_against_opacus():
    # Opacus' per-sample gradients (GradSampleModule) of the same model and batch, clipped.
    opacus = pytest.importorskip("opacus")
    torch = pytest.importorskip("torch")
    model, batch, (layers, xs, ys) = opacus_case(4)
    fc1, fc3, fc4, fc5 = layers
    net = torch.nn.Sequential(fc1, torch.nn.ReLU(), torch.nn.LayerNorm(2), fc3, fc4, fc5)
    gsm = opacus.GradSampleModule(net, loss_reduction="sum")
    out = torch.softmax(gsm(xs.requires_grad_()).flatten(1), dim=1)
    torch.nn.functional.cross_entropy(out, ys, reduction="sum").backward()
    per = [p.grad_sample.detach().numpy() for p in gsm.parameters()]
    norms = np.sqrt(sum(np.sum(g.reshape(10, -1) ** 2, 1) for g in per))
    w = np.minimum(1, 1.0 / np.where(norms > 0, norms, 1))
    clipped = [np.tensordot(w, g, 1) for g in per]
    grads, got = eqx.filter_jit(jhooks.clipped_grad(soft_xent, 1.0))(model, *batch)
    ours = [grads.fc1.weight, grads.fc1.bias, grads.ln.weight, grads.ln.bias]
    ours += [x for lin in (grads.fc3, grads.fc4, grads.fc5) for x in (lin.weight, lin.bias)]
    assert_cancelling_close(ours, got, clipped, norms, 1.0)


class PositionsMLP(eqx.Module):
    """Linear layers at every position, an optional LayerNorm, a score per position."""

    layers: list
    ln: eqx.nn.LayerNorm | None

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = jax.vmap(layer)(x)
            if i == 0 and self.ln is not None:
                x = jax.vmap(self.ln)(jax.nn.relu(x))
        return jax.nn.softmax(x[:, 0])


# Jitted only (each example compiles anew; eagerly, one example took 20 s on 2 shared
# cores): the eager route of the same rules is the Opacus model's test above.
@settings(max_examples=5, deadline=None)
@given(
    widths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    features=st.integers(1, 3),
    positions=st.integers(1, 5),
    layer_norm=st.booleans(),  # on at least two features: of one, a constant
    zeroed=st.lists(st.booleans(), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    max_norm=st.sampled_from([1e-2, 1.0]),
)
def test_random_models_with_zeroed_examples(
    widths, features, positions, layer_norm, zeroed, seed, max_norm
):
    # An example whose targets are all zero has an exactly zero gradient; the others'
    # sums may cancel (a softmax over the positions): every norm finite, each as vmap's.
    keys = jax.random.split(jax.random.key(seed), len(widths) + 3)
    sizes = [features, *widths, 1]
    layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]
    ln = eqx.nn.LayerNorm(sizes[1]) if layer_norm and sizes[1] > 1 else None
    model = PositionsMLP(layers, ln)
    size = len(zeroed)
    xs = jax.random.normal(keys[-1], (size, positions, features))
    ys = jax.random.bernoulli(keys[-2], 0.5, (size, positions)).astype(jnp.float32)
    ys = jnp.where(jnp.asarray(zeroed)[:, None], 0.0, ys)
    grads, norms = eqx.filter_jit(jhooks.clipped_grad(soft_xent, max_norm))(model, xs, ys)
    assert np.all(np.asarray(norms)[np.asarray(zeroed)] == 0)
    ref_grads, ref_norms = eqx.filter_jit(reference(soft_xent, max_norm))(model, xs, ys)
    assert_cancelling_close(grads, norms, ref_grads, ref_norms, max_norm)


# --------------------------------------------------------------------------- nested jit


TABLE = jnp.arange(3.0)  # made outside the jitted functions below: a constant of theirs


@jax.jit
def rotate(x):
    return x * jnp.tile(TABLE, x.shape[0] // 3)


class JittedForward(eqx.Module):
    """A forward that is a nested `jit` (`eqx.filter_jit` method) closing over a constant
    table (as ESM2's rotary embedding does)."""

    lin: eqx.nn.Linear
    out: eqx.nn.Linear

    @eqx.filter_jit
    def __call__(self, x):
        h = jax.nn.tanh(self.lin(rotate(x) + jnp.cos(TABLE)))
        return self.out(h * TABLE[1:].sum())


def test_nested_jit_closing_over_constants(maybe_jit):
    # The closed call's constants were dropped when its body was read (a TypeError).
    model = JittedForward(
        eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.Linear(4, 2, key=jax.random.key(1))
    )
    xs = jax.random.normal(jax.random.key(2), (5, 3))
    ys = jnp.arange(5) % 2

    def loss(m, x, y):
        return -jax.nn.log_softmax(m(x))[y]

    assert_matches(loss, model, (xs, ys), 0.5, maybe_jit)


# --------------------------------------------------------------------------- rules


class TinyViT(eqx.Module):
    """Patches, a class token and register tokens joined to them (`concatenate`), a
    positional embedding, one attention block, a head on the class token."""

    patch: eqx.nn.Conv2d
    cls: jax.Array
    registers: jax.Array
    pos: jax.Array
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key, d=8):
        ks = jax.random.split(key, 6)
        self.patch = eqx.nn.Conv2d(3, d, 2, stride=2, key=ks[0])
        self.cls = jax.random.normal(ks[1], (1, d))
        self.registers = jax.random.normal(ks[2], (2, d))
        self.pos = jax.random.normal(ks[3], (7, d))
        self.attn = eqx.nn.MultiheadAttention(2, d, key=ks[4])
        self.head = eqx.nn.Linear(d, 3, key=ks[5])

    def __call__(self, image):
        p = self.patch(image)  # (d, 2, 2)
        tokens = p.reshape(p.shape[0], -1).T  # (4, d)
        h = jnp.concatenate([self.cls, self.registers, tokens]) + self.pos
        h = h + self.attn(h, h, h)
        return self.head(h[0])


class TinyMamba(eqx.Module):
    """A selective scan with Mamba's decay `exp(dt * -exp(A_log))` and skip `D`."""

    proj: eqx.nn.Linear
    dt_bias: jax.Array
    A_log: jax.Array
    D: jax.Array
    out: eqx.nn.Linear

    def __init__(self, key, d=4, heads=3):
        ks = jax.random.split(key, 4)
        self.proj = eqx.nn.Linear(d, 2 * heads, key=ks[0])
        self.dt_bias = jax.random.normal(ks[1], (heads,))
        self.A_log = jax.random.normal(ks[2], (heads,))
        self.D = jnp.ones(heads)
        self.out = eqx.nn.Linear(heads, 2, key=ks[3])

    def __call__(self, xs):
        x, dt = jnp.split(jax.vmap(self.proj)(xs), 2, axis=-1)
        dt = jax.nn.softplus(dt + self.dt_bias)
        decay = jnp.exp(dt * -jnp.exp(self.A_log))

        def step(h, inputs):
            x_t, a_t = inputs
            h = a_t * h + x_t
            return h, h + self.D * x_t

        _, ys = jax.lax.scan(step, jnp.zeros_like(x[0]), (x, decay))
        return self.out(jnp.mean(ys, axis=0))


class SlicedDepthwise(eqx.Module):
    """A depthwise convolution written with static slices of its kernel, then a head."""

    kernel: jax.Array
    head: eqx.nn.Linear

    def __call__(self, x):  # (channels, length)
        k = self.kernel.shape[1]
        length = x.shape[1] - k + 1
        y = sum(self.kernel[:, j : j + 1] * x[:, j : j + length] for j in range(k))
        return self.head(jnp.tanh(y).mean(axis=1))


def xent(model, x, y):
    return -jax.nn.log_softmax(model(x))[y]


def test_class_and_register_tokens_joined_by_concatenate(maybe_jit):
    model = TinyViT(jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (4, 3, 4, 4))
    assert_matches(xent, model, (xs, jnp.arange(4) % 3), 0.5, maybe_jit)


def test_mamba_decay_an_elementwise_function_of_a_parameter(maybe_jit):
    model = TinyMamba(jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (4, 5, 4))
    assert_matches(xent, model, (xs, jnp.arange(4) % 2), 0.2, maybe_jit)


def test_depthwise_kernel_used_through_slices(maybe_jit):
    model = SlicedDepthwise(
        jax.random.normal(jax.random.key(0), (3, 2)), eqx.nn.Linear(3, 2, key=jax.random.key(1))
    )
    xs = jax.random.normal(jax.random.key(2), (4, 3, 6))
    assert_matches(xent, model, (xs, jnp.arange(4) % 2), 0.2, maybe_jit)


@pytest.mark.parametrize(
    ("groups", "channels", "length", "passes"),
    [(2, (4, 6), 5, 1), (4, (4, 4), 5, 2), (3, (6, 3), 40, 1), (3, (6, 3), 40, 2)],
    ids=["grouped", "depthwise-2pass", "grouped-direct", "grouped-direct-2pass"],
)
def test_grouped_convolution_ghost_rule(groups, channels, length, passes, maybe_jit):
    # One convolution per group, each a slice of the kernel: a ghost norm per group, summed
    # (a Gram sum over few positions, the kernel's gradient formed over many).
    conv = eqx.nn.Conv1d(*channels, 3, groups=groups, padding=1, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (3, channels[0], length))

    def loss(m, x):
        return jnp.sum(jnp.tanh(m(x)) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn = maybe_jit(jhooks.clipped_grad(loss, 0.5, in_axes=(None, 0), passes=passes))
        grads, norms = fn(conv, xs)
    ref_grads, ref_norms = eqx.filter_jit(reference(loss, 0.5, (None, 0)))(conv, xs)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(want))))


# --------------------------------------------------------------------------- in_axes


class TokenModel(eqx.Module):
    emb: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __call__(self, ids):
        return jax.vmap(self.head)(jnp.tanh(jax.vmap(self.emb)(ids)))


def next_token_loss(model, ids):
    """A language model's `(model, x)` loss: the targets are the input shifted."""
    logits = jax.nn.log_softmax(model(ids[:-1]))
    return -jnp.mean(jnp.take_along_axis(logits, ids[1:, None], 1))


# Jitted only: the inference reads the arguments' shapes before any tracing, the same code
# eagerly; test_clipping.py runs the `in_axes` cases (a Python value, (model, x)) and the
# embedding's and linear's rules eagerly (this twin took 53 s eagerly at load 12).
def test_in_axes_inferred_from_the_call():
    # Not given: None for the model, 0 for every other argument, (model, x) or (model, x, y).
    maybe_jit = eqx.filter_jit
    model = TokenModel(eqx.nn.Embedding(7, 4, key=jax.random.key(0)), eqx.nn.Linear(4, 7, key=KEY1))
    ids = jax.random.randint(jax.random.key(2), (5, 6), 0, 7)
    xs = jax.random.normal(jax.random.key(3), (5, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inferred = maybe_jit(jhooks.clipped_grad(next_token_loss, 0.3))(model, ids)
        pairs = maybe_jit(jhooks.clipped_grad(xent, 0.3))(model.head, xs, ids[:, 0])
        python_value = jhooks.clipped_grad(lambda m, x, t: next_token_loss(m, x) * t, 0.3)
        scaled = maybe_jit(python_value)(model, ids, 2.0)  # a Python value stays static
    for (grads, norms), loss, batch, axes in [
        (inferred, next_token_loss, (model, ids), (None, 0)),
        (pairs, xent, (model.head, xs, ids[:, 0]), (None, 0, 0)),
    ]:
        ref_grads, ref_norms = eqx.filter_jit(reference(loss, 0.3, axes))(*batch)
        np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(jnp.max(want)))
    np.testing.assert_allclose(scaled[1], 2 * inferred[1], rtol=RTOL)


def test_in_axes_inferred_refuses_a_call_without_a_batch():
    model = eqx.nn.Linear(3, 2, key=KEY1)
    with pytest.raises(ValueError, match=r"in_axes=\(None,\) batches no argument"):
        jhooks.clipped_grad(lambda m: jnp.sum(m.weight), 1.0)(model)

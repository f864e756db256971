"""Flax Linen and Haiku models by name: module calls are scopes of runs (`jhooks/_linen_haiku`).

Oracles: Linen's own `capture_intermediates` for every module output; otherwise each model's
twin written by hand in plain JAX from the same parameter dict, which records its
intermediates by the names jhooks gives and applies an edit where asked. Gradients at a
point: `jax.grad` of the twin with an additive zero there.
"""

import math
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clipping_reference import assert_matches, reference

import jhooks

# dm-haiku 0.0.16, the newest, reads `jax.core.DropVar` on import and calls
# `jax.core.get_opaque_trace_state` in every transformed call: both deprecated in JAX 0.10.
HAIKU_WARNING = r"jax\.core\.(DropVar|get_opaque_trace_state) is deprecated"
pytestmark = pytest.mark.filterwarnings(f"ignore:{HAIKU_WARNING}:DeprecationWarning")
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", HAIKU_WARNING, DeprecationWarning)
    import haiku as hk

D, HEADS, VOCAB, T = 8, 2, 11, 5
TOKENS = jnp.asarray([3, 1, 4, 1, 5])


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# A small Linen transformer, as Linen users write one: `setup` and `nn.compact` modules,
# a tied embedding (`attend`, a method other than `__call__` called on a module), and a
# module whose `__call__` calls a method of its own.


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(D, name=n)(x).reshape(T, HEADS, D // HEADS) for n in ("q", "k", "v"))
        w = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(D // HEADS), axis=-1)
        return nn.Dense(D, name="out")(jnp.einsum("hqk,khd->qhd", w, v).reshape(T, D))


class MLP(nn.Module):
    def setup(self):
        self.fc = nn.Dense(2 * D)
        self.proj = nn.Dense(D)

    def __call__(self, x):
        return self.project(jax.nn.gelu(self.fc(x)))

    def project(self, h):  # called by `__call__` on the module itself: no point of its own
        return self.proj(h)


class Block(nn.Module):
    def setup(self):
        self.ln1 = nn.LayerNorm()
        self.attn = Attention()
        self.ln2 = nn.LayerNorm()
        self.mlp = MLP()

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D, name="embed")
        x = embed(tokens)
        for i in range(2):
            x = Block(name=f"block_{i}")(x)
        return embed.attend(nn.LayerNorm(name="ln_f")(x))


MODEL = Transformer()
VARIABLES = MODEL.init(jax.random.key(0), TOKENS)


def _layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]


def linen_twin(params, tokens, edit=lambda name, value: value):
    """The transformer by hand: `(logits, intermediates by jhooks' name)`, `edit(name, v)`
    applied to each named value (module outputs, and `block_i.attn/softmax`)."""
    seen = {}

    def at(name, value):
        value = edit(name, value)
        seen[name] = value
        return value

    def dense(p, x, name):
        return at(name, x @ p["kernel"] + p["bias"])

    x = at("embed", params["embed"]["embedding"][tokens])
    for i in range(2):
        b, n = params[f"block_{i}"], f"block_{i}"
        h = at(f"{n}.ln1", _layer_norm(b["ln1"], x))
        a = b["attn"]
        q, k, v = (
            dense(a[c], h, f"{n}.attn.{c}").reshape(T, HEADS, D // HEADS) for c in ("q", "k", "v")
        )
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(D // HEADS)
        w = at(f"{n}.attn/softmax", jax.nn.softmax(scores, axis=-1))
        o = dense(a["out"], jnp.einsum("hqk,khd->qhd", w, v).reshape(T, D), f"{n}.attn.out")
        x = x + at(f"{n}.attn", o)
        h = at(f"{n}.ln2", _layer_norm(b["ln2"], x))
        m = b["mlp"]
        y = dense(m["proj"], jax.nn.gelu(dense(m["fc"], h, f"{n}.mlp.fc")), f"{n}.mlp.proj")
        x = at(n, x + at(f"{n}.mlp", y))
    x = at("ln_f", _layer_norm(params["ln_f"], x))
    return at("embed:1", x @ params["embed"]["embedding"].T), seen


def test_linen_twin_is_the_model():
    logits, _ = linen_twin(VARIABLES["params"], TOKENS)
    close(logits, MODEL.apply(VARIABLES, TOKENS))


def _intermediates(tree, prefix=()):
    """Linen's `capture_intermediates`, by dotted module path (the root's left out)."""
    out = {}
    for key, value in tree.items():
        if key == "__call__":
            if prefix:
                out[".".join(prefix)] = value
        else:
            out.update(_intermediates(value, (*prefix, key)))
    return out


def test_linen_cache_is_capture_intermediates(maybe_jit):
    out, cache = maybe_jit(lambda v, t: jhooks.run_with_cache(MODEL.apply, v, t))(VARIABLES, TOKENS)
    _, state = MODEL.apply(VARIABLES, TOKENS, capture_intermediates=True, mutable=["intermediates"])
    linen = _intermediates(state["intermediates"])
    # Linen sows each call of a module under its `__call__` (a tuple, one per call); the
    # tied embedding's `attend` is not `__call__`: jhooks names it as the second call.
    assert set(cache) == set(linen) | {"embed:1"}
    for name, values in linen.items():
        (value,) = values
        close(cache[name], value)
    close(cache["embed:1"], out)
    assert "block_0.mlp:1" not in cache  # `project` is part of `mlp`'s call
    _, twin = linen_twin(VARIABLES["params"], TOKENS)
    assert set(cache) == {n for n in twin if "/" not in n}
    for name, value in cache.items():
        close(value, twin[name])


def test_linen_module_input_and_address(maybe_jit):
    names = ["block_1.attn:in", "block_0.attn/softmax", "block_1.mlp.fc"]
    _, cache = maybe_jit(lambda v, t: jhooks.run_with_cache(MODEL.apply, v, t, names_filter=names))(
        VARIABLES, TOKENS
    )
    _, twin = linen_twin(VARIABLES["params"], TOKENS)
    assert list(cache) == ["block_0.attn/softmax", "block_1.attn:in", "block_1.mlp.fc"]
    close(cache["block_1.attn:in"], twin["block_1.ln1"])
    close(cache["block_0.attn/softmax"], twin["block_0.attn/softmax"])
    close(cache["block_1.mlp.fc"], twin["block_1.mlp.fc"])
    addresses = {op.address for op in jhooks.ops(MODEL.apply, VARIABLES, TOKENS)}
    assert {"block_0.attn/softmax", "block_1.attn.q/dot_general", "embed/gather"} <= addresses


def _halve_and_drop_head_1(name, value):
    """The twin's edit for the hooks `halve` at `block_0.attn` and `drop_head_1` at
    `block_1.attn/softmax`."""
    if name == "block_0.attn":
        return value * 0.5
    if name == "block_1.attn/softmax":
        return value.at[1].set(0.0)
    return value


def test_linen_patches_equal_the_edited_twin(maybe_jit):
    def halve(value, name):
        return value * 0.5

    def drop_head_1(w, name):
        return w.at[1].set(0.0)

    hooks = [("block_0.attn", halve), ("block_1.attn/softmax", drop_head_1)]
    out = maybe_jit(lambda v, t: jhooks.run_with_hooks(MODEL.apply, v, t, fwd_hooks=hooks))(
        VARIABLES, TOKENS
    )

    expected, _ = linen_twin(VARIABLES["params"], TOKENS, _halve_and_drop_head_1)
    plain, _ = linen_twin(VARIABLES["params"], TOKENS)
    assert not np.allclose(expected, plain, atol=1e-3)  # the edits change the output
    close(out, expected)


def test_linen_gradient_at_an_address(maybe_jit):
    def loss(v, t):
        return MODEL.apply(v, t)[-1, 2]

    names = ["block_1.attn/softmax", "block_0.mlp"]
    out, cache = maybe_jit(
        lambda v, t: jhooks.run_with_cache(loss, v, t, names_filter=names, incl_bwd=True)
    )(VARIABLES, TOKENS)

    def twin_loss(zeros):
        def edit(name, value):
            return value + zeros[name] if name in zeros else value

        return linen_twin(VARIABLES["params"], TOKENS, edit)[0][-1, 2]

    _, seen = linen_twin(VARIABLES["params"], TOKENS)
    grads = jax.grad(twin_loss)({n: jnp.zeros_like(seen[n]) for n in names})
    close(out, twin_loss({}))
    for name in names:
        close(cache[name + "_grad"], grads[name])
        assert np.abs(np.asarray(grads[name])).max() > 1e-4


def test_linen_under_the_users_vmap_a_hook_sees_one_example(maybe_jit):
    """`jax.vmap(model.apply, in_axes=(None, 0))` inside the run's function: a module's
    output and an address are hooked per example (the hand-edited twin mapped over the
    batch), and cached stacked, batch axis first."""
    tokens = jnp.stack([TOKENS, (TOKENS + 2) % VOCAB, (TOKENS * 3) % VOCAB, TOKENS[::-1]])
    shapes = []

    def halve(value, name):
        shapes.append(value.shape)
        return value * 0.5

    def drop_head_1(w, name):
        shapes.append(w.shape)
        return w.at[1].set(0.0)

    hooks = [("block_0.attn", halve), ("block_1.attn/softmax", drop_head_1)]
    batched = jax.vmap(MODEL.apply, in_axes=(None, 0))
    out = maybe_jit(lambda v, t: jhooks.run_with_hooks(batched, v, t, fwd_hooks=hooks))(
        VARIABLES, tokens
    )
    assert shapes == [(T, D), (HEADS, T, T)]

    twin = jax.vmap(lambda t: linen_twin(VARIABLES["params"], t, _halve_and_drop_head_1)[0])
    close(out, twin(tokens))
    names = ["block_0.attn", "block_1.attn/softmax"]
    _, cache = maybe_jit(lambda v, t: jhooks.run_with_cache(batched, v, t, names_filter=names))(
        VARIABLES, tokens
    )
    twin = jax.vmap(lambda t: linen_twin(VARIABLES["params"], t)[1])(tokens)
    for name in names:
        close(cache[name], twin[name])


# Linen's lifted transforms: nn.scan over layers (points stacked, as under lax.scan),
# nn.remat and nn.jit.


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(D, name="fc")(x)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            ScanLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        x, _ = layers(name="layers")(x, None)
        return x


def test_linen_scan_over_layers_is_stacked(maybe_jit):
    model = Scanned()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, D)).astype(np.float32))
    variables = model.init(jax.random.key(1), x)
    names = ["layers", "layers.fc", "layers/tanh", "layers.fc/dot_general"]
    out, cache = maybe_jit(
        lambda v, x: jhooks.run_with_cache(model.apply, v, x, names_filter=names)
    )(variables, x)
    p = variables["params"]["layers"]["fc"]
    fcs, tanhs, h = [], [], x
    for i in range(3):
        fcs.append(h @ p["kernel"][i] + p["bias"][i])
        h = jnp.tanh(fcs[-1])
        tanhs.append(h)
    close(out, h)
    assert set(cache) == set(names)
    close(cache["layers.fc"], jnp.stack(fcs))
    close(cache["layers.fc/dot_general"], jnp.stack([f - p["bias"][i] for i, f in enumerate(fcs)]))
    close(cache["layers/tanh"], jnp.stack(tanhs))
    # The scanned module's call is one per iteration: `(carry, None)` stacked.
    close(cache["layers"][0], jnp.stack(tanhs))


class Lifted(nn.Module):
    lift: str

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            dense = nn.remat(nn.Dense) if self.lift == "remat" else nn.jit(nn.Dense)
            x = jnp.sin(dense(D, name=f"d{i}")(x))
        return x.sum()


@pytest.mark.parametrize("lift", ["remat", "jit"])
def test_linen_remat_and_jit(maybe_jit, lift):
    model = Lifted(lift)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, D)).astype(np.float32))
    variables = model.init(jax.random.key(2), x)
    names = ["d0", "d1/dot_general"]
    out, cache = maybe_jit(
        lambda v, x: jhooks.run_with_cache(model.apply, v, x, names_filter=names, incl_bwd=True)
    )(variables, x)
    p = variables["params"]

    def twin(zeros):
        h0 = x @ p["d0"]["kernel"] + p["d0"]["bias"] + zeros[0]
        mm = jnp.sin(h0) @ p["d1"]["kernel"] + zeros[1]
        return jnp.sin(mm + p["d1"]["bias"]).sum(), (h0, mm)

    zeros = (jnp.zeros((3, D)), jnp.zeros((3, D)))
    (value, (h0, mm)), grads = jax.value_and_grad(twin, has_aux=True)(zeros)
    close(out, value)
    close(cache["d0"], h0)
    close(cache["d1/dot_general"], mm)
    close(cache["d0_grad"], grads[0])
    close(cache["d1/dot_general_grad"], grads[1])


# clipped_grad on a Linen MLP: the parameter dict is the model.


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jax.nn.relu(nn.Dense(16)(x)))[0]


def test_linen_clipped_grad(maybe_jit):
    model = LinenMLP()
    rng = np.random.default_rng(2)
    xs = jnp.asarray(rng.normal(size=(6, 4)).astype(np.float32))
    ys = jnp.asarray(rng.normal(size=(6,)).astype(np.float32))
    params = model.init(jax.random.key(3), xs[0])["params"]

    def loss(params, x, y):
        return (model.apply({"params": params}, x) - y) ** 2

    per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, xs, ys)
    expected_norms = jnp.sqrt(
        sum(jnp.sum(g.reshape(6, -1) ** 2, axis=1) for g in jax.tree.leaves(per_example))
    )
    max_norm = float(jnp.median(expected_norms))  # half the examples are clipped
    weights = jnp.minimum(1.0, max_norm / expected_norms)
    assert float(weights.min()) < 0.9 and float(weights.max()) == 1.0
    grads, norms = maybe_jit(jhooks.clipped_grad(loss, max_norm, in_axes=(None, 0, 0)))(
        params, xs, ys
    )
    close(norms, expected_norms)
    expected = jax.tree.map(lambda g: jnp.tensordot(weights, g, axes=1), per_example)
    jax.tree.map(close, grads, expected)


def test_haiku_clipped_grad(maybe_jit):
    """`clipped_grad` on a Haiku MLP, its parameter dict the model: the vmap(grad)
    reference clipped by hand, with no per-example fallback."""
    mlp = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([16, 1])(x)[0]))
    rng = np.random.default_rng(2)
    xs = jnp.asarray(rng.normal(size=(6, 4)).astype(np.float32))
    ys = jnp.asarray(rng.normal(size=(6,)).astype(np.float32))
    params = mlp.init(jax.random.key(3), xs[0])

    def loss(params, x, y):
        return (mlp.apply(params, x) - y) ** 2

    norms = reference(loss, 1.0)(params, xs, ys)[1]
    max_norm = float(np.median(norms))  # half the examples are clipped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_matches(loss, params, (xs, ys), max_norm, maybe_jit, ghost=False)
    # Haiku's own deprecation warnings only: no per-example fallback's.
    assert all(re.search(HAIKU_WARNING, str(w.message)) for w in caught), caught


def test_linen_and_haiku_modules_refuse_registration():
    with pytest.raises(TypeError, match=r"cannot register a hook on Dense: Flax Linen.*run_with"):
        jhooks.register_forward_hook(nn.Dense(3), lambda m, a, o: o)
    with pytest.raises(TypeError, match=r"hookable cannot make Transformer hookable: Flax Linen"):
        jhooks.hookable(MODEL)
    with pytest.raises(TypeError, match=r"cannot list the modules of Transformer: Flax Linen"):
        jhooks.named_modules(MODEL)
    with pytest.raises(TypeError, match=r"cannot list the parameters of Transformer: Flax Linen"):
        list(jhooks.named_parameters(MODEL))
    with pytest.raises(TypeError, match=r"cannot list the modules of Transformer: Flax Linen"):
        jhooks.register_module_hooks(MODEL, nn.Dense, forward=lambda m, a, o: o)
    with pytest.raises(TypeError, match=r"cannot register a hook on Dense: Flax Linen"):
        jhooks.register_parameter_hook(nn.Dense(3), "kernel", lambda g: g)
    with pytest.raises(TypeError, match=r"cannot find the path of Dense: Flax Linen"):
        jhooks.module_path(nn.Dense(3))

    def f(x):
        linear = hk.Linear(3)
        with pytest.raises(TypeError, match=r"cannot register a hook on Linear: Haiku.*mlp\.~"):
            jhooks.register_forward_hook(linear, lambda m, a, o: o)
        return linear(x)

    hk.transform(f).init(jax.random.key(0), jnp.ones((2, 3)))


# A Haiku transformer block stack, as Haiku users write one: a module made in its
# parent's constructor (`block_0/~/attn`), modules made in `__call__` (`block_0/mlp`).


class HkAttention(hk.Module):
    def __call__(self, x):
        q, k, v = (hk.Linear(D, name=n)(x) for n in ("q", "k", "v"))
        w = jax.nn.softmax(q @ k.T / math.sqrt(D), axis=-1)
        return hk.Linear(D, name="out")(w @ v)


class HkBlock(hk.Module):
    def __init__(self, name):
        super().__init__(name=name)
        self.attn = HkAttention(name="attn")

    def __call__(self, x):
        x = x + self.attn(x)
        return x + hk.nets.MLP([2 * D, D], name="mlp")(x)


def hk_forward(x):
    for i in range(2):
        x = HkBlock(name=f"block_{i}")(x)
    return hk.Linear(1, name="head")(x).sum()


HK = hk.transform(hk_forward)
HK_X = jnp.asarray(np.random.default_rng(3).normal(size=(T, D)).astype(np.float32))
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", HAIKU_WARNING, DeprecationWarning)
    HK_PARAMS = HK.init(jax.random.key(4), HK_X)


def haiku_twin(params, x, edit=lambda name, value: value):
    seen = {}

    def at(name, value):
        value = edit(name, value)
        seen[name] = value
        return value

    def linear(key, h):  # Haiku's parameter key; the module's name in jhooks, and its input
        h = at(key.replace("/", ".") + ":in", h)
        return at(key.replace("/", "."), h @ params[key]["w"] + params[key]["b"])

    for i in range(2):
        n = f"block_{i}"
        q, k, v = (linear(f"{n}/~/attn/{c}", x) for c in ("q", "k", "v"))
        w = at(f"{n}.~.attn/softmax", jax.nn.softmax(q @ k.T / math.sqrt(D), axis=-1))
        x = x + at(f"{n}.~.attn", linear(f"{n}/~/attn/out", w @ v))
        h = jax.nn.relu(linear(f"{n}/mlp/~/linear_0", x))
        x = at(n, x + at(f"{n}.mlp", linear(f"{n}/mlp/~/linear_1", h)))
    return linear("head", x).sum(), seen


def test_haiku_names_and_cache(maybe_jit):
    out, cache = maybe_jit(lambda p, x: jhooks.run_with_cache(HK.apply, p, None, x))(
        HK_PARAMS, HK_X
    )
    value, twin = haiku_twin(HK_PARAMS, HK_X)
    close(out, value)
    # Every module with parameters, by Haiku's own name with `/` as `.`.
    assert {key.replace("/", ".") for key in HK_PARAMS} <= set(cache)
    assert set(cache) == {n for n in twin if "/" not in n and ":in" not in n}
    for name, v in cache.items():
        close(v, twin[name])
    addresses = {op.address for op in jhooks.ops(HK.apply, HK_PARAMS, None, HK_X)}
    assert {"block_0.~.attn/softmax", "block_1.mlp.~.linear_0/dot_general"} <= addresses


def test_haiku_patch_and_gradient(maybe_jit):
    hooks = [
        ("block_0.mlp", lambda v, name: -v),
        ("block_1.~.attn/softmax", lambda w, name: w.at[:, 0].set(0.0)),
    ]
    out = maybe_jit(lambda p, x: jhooks.run_with_hooks(HK.apply, p, None, x, fwd_hooks=hooks))(
        HK_PARAMS, HK_X
    )

    def edit(name, value):
        if name == "block_0.mlp":
            return -value
        if name == "block_1.~.attn/softmax":
            return value.at[:, 0].set(0.0)
        return value

    expected, _ = haiku_twin(HK_PARAMS, HK_X, edit)
    assert abs(float(expected) - float(haiku_twin(HK_PARAMS, HK_X)[0])) > 1e-3
    close(out, expected)

    names = ["block_0.~.attn/softmax", "block_1.~.attn.q:in"]
    _, cache = maybe_jit(
        lambda p, x: jhooks.run_with_cache(HK.apply, p, None, x, names_filter=names, incl_bwd=True)
    )(HK_PARAMS, HK_X)
    _, seen = haiku_twin(HK_PARAMS, HK_X)

    def twin_loss(zeros):
        return haiku_twin(HK_PARAMS, HK_X, lambda n, v: v + zeros[n] if n in zeros else v)[0]

    # The input of `block_1/~/attn/q` is block 0's output; its gradient, through `q` alone.
    grads = jax.grad(twin_loss)({n: jnp.zeros_like(seen[n]) for n in names})
    close(cache["block_1.~.attn.q:in"], seen["block_0"])
    for name in names:
        close(cache[name + "_grad"], grads[name])
        assert np.abs(np.asarray(grads[name])).max() > 1e-4


def test_published_linen_gpt2_attention_equals_pytorch(maybe_jit):
    # Hugging Face's FlaxGPT2Model (a Linen model) against its PyTorch GPT2Model with the
    # same random weights: the attention pattern jhooks caches at the address of Linen's
    # softmax is PyTorch's `output_attentions`. Hugging Face's Flax code adds bool and
    # int32 arrays: JAX's standard promotion, not the suite's strict one.
    with jax.numpy_dtype_promotion("standard"):
        _gpt2_attention_equals_pytorch(maybe_jit)


def _gpt2_attention_equals_pytorch(maybe_jit):
    import torch
    import transformers
    from transformers.modeling_flax_pytorch_utils import load_flax_weights_in_pytorch_model

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16, attn_implementation="eager"
    )
    flax_model = transformers.FlaxGPT2Model(config, seed=0)
    writable = jax.tree.map(np.array, flax_model.params)  # PyTorch warns on read-only arrays
    torch_model = load_flax_weights_in_pytorch_model(
        transformers.GPT2Model(config).eval(), writable
    )
    ids = np.array([[1, 5, 7, 3, 9, 2], [4, 4, 8, 1, 0, 3]])
    names = ["h.0.attn/softmax", "h.1.attn/softmax", "h.1.attn"]
    out, cache = maybe_jit(
        lambda p, i: jhooks.run_with_cache(
            lambda p, i: flax_model(i, params=p).last_hidden_state, p, i, names_filter=names
        )
    )(flax_model.params, ids)
    with torch.no_grad():
        expected = torch_model(torch.tensor(ids), output_attentions=True)
    close(out, expected.last_hidden_state.numpy())
    for layer in range(2):
        pattern = cache[f"h.{layer}.attn/softmax"]
        assert pattern.shape == (2, 4, 6, 6)
        close(pattern, expected.attentions[layer].numpy())
    assert cache["h.1.attn"][0].shape == (2, 6, 32)  # the attention module's `(out,)`


def _hk_stacked(x):
    def layer(x):
        return jnp.tanh(hk.Linear(D, name="fc")(x))

    x = hk.layer_stack(3)(layer)(x)
    return hk.remat(lambda x: hk.Linear(D, name="r")(x))(x).sum()


def test_haiku_layer_stack_and_remat(maybe_jit):
    stacked = hk.transform(_hk_stacked)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", HAIKU_WARNING, DeprecationWarning)
        params = stacked.init(jax.random.key(5), HK_X)
    names = ["fc", "fc/dot_general", "r", "r/dot_general"]
    out, cache = maybe_jit(
        lambda p, x: jhooks.run_with_cache(
            stacked.apply, p, None, x, names_filter=names, incl_bwd=True
        )
    )(params, HK_X)
    fc = params["__layer_stack_no_per_layer/fc"]

    def twin(zeros):
        h, fcs = HK_X, []
        for i in range(3):
            fcs.append(h @ fc["w"][i] + fc["b"][i] + zeros[i])
            h = jnp.tanh(fcs[-1])
        r = h @ params["r"]["w"] + zeros[3]
        return (r + params["r"]["b"]).sum(), (jnp.stack(fcs), r)

    zeros = [jnp.zeros((T, D))] * 4
    (value, (fcs, r)), grads = jax.value_and_grad(twin, has_aux=True)(zeros)
    close(out, value)
    # Inside `hk.layer_stack`, a layer's module is named as in the stacked function (`fc`),
    # its values stacked along the layers, as under `lax.scan`.
    close(cache["fc"], fcs)
    close(cache["fc/dot_general"], fcs - fc["b"][:, None])
    close(cache["fc_grad"], jnp.stack(grads[:3]))
    close(cache["r"], r + params["r"]["b"])
    close(cache["r/dot_general_grad"], grads[3])


class Branchy(nn.Module):
    @nn.compact
    def __call__(self, x, flag):
        per_row = nn.vmap(
            nn.Dense, in_axes=0, variable_axes={"params": 0}, split_rngs={"params": True}
        )(D, name="rows")
        h = jhooks.hook_point(jnp.tanh(per_row(x)), "h")  # a point written in: under the root
        a, b = nn.Dense(D, name="a"), nn.Dense(D, name="b")
        if self.is_initializing():
            a(h), b(h)
        return nn.cond(flag, lambda m, h: a(h), lambda m, h: b(h), self, h).sum()


def test_linen_vmap_cond_and_hook_points(maybe_jit):
    model = Branchy()
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, D)).astype(np.float32))
    variables = model.init(jax.random.key(6), x, True)
    p = variables["params"]
    rows = jnp.einsum("rd,rde->re", x, p["rows"]["kernel"]) + p["rows"]["bias"]
    names = ["rows", "h", "rows/dot_general"]
    _, cache = maybe_jit(
        lambda v, x: jhooks.run_with_cache(model.apply, v, x, True, names_filter=names)
    )(variables, x)
    close(cache["rows"], rows)  # nn.vmap's batch axis first
    close(cache["h"], jnp.tanh(rows))
    assert cache["rows/dot_general"].shape == (3, D)
    # `a` is reached in one branch only: as inside lax.cond, caching it is refused.
    with pytest.raises(ValueError, match=r"hook point 'a' is reached in only some branches"):
        jhooks.run_with_cache(model.apply, variables, x, jnp.asarray(True), names_filter="a")


def test_haiku_glob_spans_the_marks():
    _, cache = jhooks.run_with_cache(HK.apply, HK_PARAMS, None, HK_X, names_filter="*.~.attn.*")
    expected = [f"block_{i}.~.attn.{c}" for i in range(2) for c in ("k", "out", "q", "v")]
    assert sorted(cache) == expected


def test_linen_model_inside_a_hookable_module_is_named_under_it(maybe_jit):
    import equinox as eqx

    mlp = LinenMLP()
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4,)).astype(np.float32))
    params = mlp.init(jax.random.key(7), x)["params"]

    class Head(eqx.Module):
        params: dict

        def __call__(self, x):
            return jhooks.hook_point(mlp.apply({"params": self.params}, x), "logit")

    class Outer(eqx.Module):
        head: Head

        def __call__(self, x):
            return self.head(jnp.sin(x))

    model = jhooks.hookable(Outer(Head(params)))
    out, cache = maybe_jit(lambda m, x: jhooks.run_with_cache(m, x))(model, x)
    # `nn.Dense(1)(relu(nn.Dense(16)(x)))` makes the outer layer first: it is `Dense_0`.
    pre = jnp.sin(x) @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]
    logits = jax.nn.relu(pre) @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
    assert set(cache) == {"head.Dense_1", "head.Dense_0", "head.logit", "head"}
    close(cache["head.Dense_1"], pre)
    close(cache["head.Dense_0"], logits)
    close(cache["head.logit"], logits[0])
    close(cache["head"], logits[0])
    close(out, logits[0])
    ops = {op.address for op in jhooks.ops(model, x)}
    assert {"head.Dense_0/dot_general", "head/relu", "head.Dense_1/add", "/sin"} <= ops


class Looped(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(D, name="d")
        if self.is_initializing():
            dense(x)
        x, _ = nn.while_loop(
            lambda m, c: c[1] < 3, lambda m, c: (jnp.tanh(dense(c[0])), c[1] + 1), self, (x, 0)
        )
        return x


def test_linen_while_loop_needs_max_steps(maybe_jit):
    model = Looped()
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, D)).astype(np.float32))
    variables = model.init(jax.random.key(8), x)
    with pytest.raises(ValueError, match=r"hook point 'd' is inside a lax.while_loop"):
        jhooks.run_with_cache(model.apply, variables, x, names_filter="d")
    _, cache = maybe_jit(
        lambda v, x: jhooks.run_with_cache(model.apply, v, x, names_filter="d", max_steps=5)
    )(variables, x)
    p, h, rows = variables["params"]["d"], x, []
    for _ in range(3):
        rows.append(h @ p["kernel"] + p["bias"])
        h = jnp.tanh(rows[-1])
    assert int(cache["d_steps"]) == 3
    np.testing.assert_array_equal(cache["d_valid"], [True] * 3 + [False] * 2)
    close(cache["d"][:3], jnp.stack(rows))


# Attribution on a Linen model, by module path and by address: AtP against the twin's
# (clean - corrupt) * d metric / d value at the corrupted run.


@pytest.mark.parametrize("method", ["atp", "ig"])
def test_linen_attribution_equals_the_twin(maybe_jit, method):
    corrupt = jnp.asarray([3, 1, 9, 1, 5])
    nodes = ["block_0.attn", "block_1.attn/softmax"]

    def metric(logits):
        return logits[-1, 2] - logits[-1, 7]

    scores = maybe_jit(
        lambda c, k: jhooks.attribution(
            metric,
            lambda t: MODEL.apply(VARIABLES, t),
            c,
            k,
            nodes=nodes,
            method=method,
            sum_axes=(),
            steps=4,
        )
    )(TOKENS, corrupt)

    params = VARIABLES["params"]
    _, clean_seen = linen_twin(params, TOKENS)
    _, corrupt_seen = linen_twin(params, corrupt)

    def twin_metric(values, tokens):
        def edit(name, value):
            return values[name] if name in values else value

        return metric(linen_twin(params, tokens, edit)[0])

    for name in nodes:
        delta = clean_seen[name] - corrupt_seen[name]
        if method == "atp":
            grad = jax.grad(twin_metric)({name: corrupt_seen[name]}, corrupt)[name]
        else:  # riemann_left over 4 points, one node moved at a time, as layer IG does
            grad = (
                sum(
                    jax.grad(twin_metric)({name: corrupt_seen[name] + (k / 4) * delta}, corrupt)[
                        name
                    ]
                    for k in range(4)
                )
                / 4
            )
        close(scores[name], delta * grad)
        assert np.abs(np.asarray(delta * grad)).max() > 1e-4


# Generation: a Linen decoder whose attention keeps its keys and values in Linen's
# `cache` collection, decoded by `jhooks.generate` with a step that applies it with
# `mutable=["cache"]`.

MAXLEN = 12


class CachedAttention(nn.Module):
    """One token at a time, its keys and values kept in the `cache` collection."""

    @nn.compact
    def __call__(self, x, position):
        q, k, v = (nn.Dense(D, name=n)(x) for n in ("q", "k", "v"))
        keys = self.variable("cache", "keys", jnp.zeros, (MAXLEN, D))
        values = self.variable("cache", "values", jnp.zeros, (MAXLEN, D))
        keys.value = keys.value.at[position].set(k)
        values.value = values.value.at[position].set(v)
        scores = jnp.where(jnp.arange(MAXLEN) <= position, keys.value @ q / math.sqrt(D), -1e9)
        w = jax.nn.softmax(scores)
        self.sow("intermediates", "pattern", w)  # for the twin: the pattern of each step
        return nn.Dense(D, name="out")(w @ values.value)


class Decoder(nn.Module):
    steer: tuple = ()  # the hand-edited twin: a vector added to the attention's output

    @nn.compact
    def __call__(self, token, position):
        embed = nn.Embed(VOCAB, D, name="embed")
        x = embed(token)
        a = CachedAttention(name="attn")(x, position)
        if self.steer:
            a = a + jnp.asarray(self.steer, jnp.float32)
        x = x + a
        x = x + nn.Dense(D, name="mlp")(jax.nn.gelu(x))
        return embed.attend(x)


DECODER = Decoder()
DECODER_VARIABLES = DECODER.init(jax.random.key(3), jnp.int32(0), 0)
DIRECTION = tuple(float(v) for v in np.random.default_rng(5).normal(size=D))


def decode_step(params, cache, token, position):
    variables = {"params": params, "cache": cache}
    logits, mutated = DECODER.apply(variables, token, position, mutable=["cache"])
    return logits, mutated["cache"]


def decoded_by_hand(prompt, new, steer=()):
    """Greedy decoding in a Python loop: (tokens, logits of the new ones, each step's
    pattern)."""
    model, cache = Decoder(steer), DECODER_VARIABLES["cache"]
    tokens, logits, patterns = list(prompt), [], []
    for position in range(len(prompt) + new - 1):
        variables = {"params": DECODER_VARIABLES["params"], "cache": cache}
        token = jnp.int32(tokens[position])
        out, mutated = model.apply(variables, token, position, mutable=["cache", "intermediates"])
        cache = mutated["cache"]
        patterns.append(mutated["intermediates"]["attn"]["pattern"][0])
        if position >= len(prompt) - 1:
            logits.append(out)
            tokens.append(int(jnp.argmax(out)))
    return np.array(tokens), np.stack(logits), np.stack(patterns)


def test_linen_generation_with_steering_and_a_cached_address(maybe_jit):
    """`jhooks.generate` on a Linen decoder: a forward hook on the attention's output
    steers every step, and the address `attn/softmax` is cached at every step, equal to
    the twin with the vector added by hand, decoded in a Python loop."""
    prompt = [3, 1, 4]

    def steer(a, name):
        return a + jnp.asarray(DIRECTION, jnp.float32)

    out = maybe_jit(
        lambda params, cache, p: jhooks.generate(
            decode_step,
            params,
            cache,
            p,
            max_new_tokens=6,
            fwd_hooks=[("attn", steer)],
            names_filter="attn/softmax",
        )
    )(DECODER_VARIABLES["params"], DECODER_VARIABLES["cache"], jnp.asarray(prompt, jnp.int32))
    tokens, logits, patterns = decoded_by_hand(prompt, 6, DIRECTION)
    np.testing.assert_array_equal(out.tokens, tokens)
    close(out.logits, logits)
    close(out.cache["attn/softmax"], patterns)
    assert not np.array_equal(decoded_by_hand(prompt, 6)[0], tokens)  # the steering acts

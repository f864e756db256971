"""Models as other people write them: a module called several times in one pass, a
module shared by two paths, module inputs as points, and Equinox's own
`MultiheadAttention` (which maps its attention over heads with a vmap of its own).
Checked against PyTorch twins."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from stacks import Looped, Scanned

import jhooks

D = 6


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def from_torch(t):
    return jnp.asarray(t.detach().numpy())


# A block that applies one module to q and to k (as a rotary embedding is), and one
# `Identity` object under two names (equimo's `self.ls1 = self.ls2 = Identity()`).


class Block(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    rope: eqx.nn.Linear
    ls1: eqx.nn.Identity
    ls2: eqx.nn.Identity

    def __init__(self, key):
        kq, kk, kr = jax.random.split(key, 3)
        self.q = eqx.nn.Linear(D, D, key=kq)
        self.k = eqx.nn.Linear(D, D, key=kk)
        self.rope = eqx.nn.Linear(D, D, key=kr)
        self.ls1 = self.ls2 = eqx.nn.Identity()

    def __call__(self, x):
        q, k = self.rope(self.q(x)), self.rope(self.k(x))
        return x + self.ls2(jnp.tanh(self.ls1(q) * k))


class TorchBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.q, self.k, self.rope = (torch.nn.Linear(D, D) for _ in range(3))
        self.ls1 = self.ls2 = torch.nn.Identity()
        with torch.no_grad():
            for name in ("q", "k", "rope"):
                getattr(self, name).weight.copy_(
                    torch.from_numpy(np.array(getattr(block, name).weight))
                )
                getattr(self, name).bias.copy_(
                    torch.from_numpy(np.array(getattr(block, name).bias))
                )

    def forward(self, x):
        q, k = self.rope(self.q(x)), self.rope(self.k(x))
        return x + self.ls2(torch.tanh(self.ls1(q) * k))


def block_and_twin():
    block = Block(jax.random.PRNGKey(0))
    x = np.random.default_rng(1).normal(size=(D,)).astype(np.float32)
    return jhooks.hookable(block), TorchBlock(block), x


def torch_calls(twin, x, module_name):
    """The (input, output) of each call of `twin.<module_name>` in one forward pass."""
    calls = []
    handle = getattr(twin, module_name).register_forward_hook(
        lambda m, args, out: calls.append((args[0].detach().numpy(), out.detach().numpy()))
    )
    twin(torch.from_numpy(x))
    handle.remove()
    return calls


def test_a_module_called_twice_has_a_point_per_call(maybe_jit):
    block, twin, x = block_and_twin()
    rope_calls, ls_calls = torch_calls(twin, x, "rope"), torch_calls(twin, x, "ls1")
    assert len(rope_calls) == len(ls_calls) == 2

    # No filter: every call is cached, the first under the module's name, the next
    # under `name:1`; a shared module under its first path (PyTorch's one name).
    out, cache = maybe_jit(lambda x: jhooks.run_with_cache(block, x))(x)
    assert sorted(cache) == ["k", "ls1", "ls1:1", "q", "rope", "rope:1"]
    for i, name in enumerate(["rope", "rope:1"]):
        close(cache[name], rope_calls[i][1])
    for i, name in enumerate(["ls1", "ls1:1"]):
        close(cache[name], ls_calls[i][1])
    close(out, twin(torch.from_numpy(x)).detach().numpy())

    # The module's own name selects every call; `name:1` one call; the other path of a
    # shared module selects its calls too.
    for names_filter, expected in [
        ("rope", ["rope", "rope:1"]),
        ("rope:1", ["rope:1"]),
        ("ls2", ["ls1", "ls1:1"]),
        ("ls2:1", ["ls1:1"]),
    ]:
        _, cache = maybe_jit(
            lambda x, f=names_filter: jhooks.run_with_cache(block, x, names_filter=f)
        )(x)
        assert sorted(cache) == expected


def test_module_hooks_run_once_per_call_as_in_pytorch(maybe_jit):
    block, twin, x = block_and_twin()
    seen, torch_seen = [], []

    def hook(module, args, out):
        seen.append(out.shape)
        return out * 2.0 + 1.0

    def torch_hook(module, args, out):
        torch_seen.append(tuple(out.shape))
        return out * 2.0 + 1.0

    handle = block.rope.register_forward_hook(hook)
    torch_handle = twin.rope.register_forward_hook(torch_hook)
    out = maybe_jit(lambda x: block(x))(x)
    expected = twin(torch.from_numpy(x)).detach().numpy()
    handle.remove()
    torch_handle.remove()
    assert seen == torch_seen == [(D,), (D,)]
    close(out, expected)


def test_run_hooks_patch_one_call_or_every_call(maybe_jit):
    block, twin, x = block_and_twin()

    def twin_with(patched_calls):
        count = []

        def hook(module, args, out):
            count.append(1)
            return out * 0.5 if len(count) - 1 in patched_calls else None

        handle = twin.rope.register_forward_hook(hook)
        out = twin(torch.from_numpy(x)).detach().numpy()
        handle.remove()
        return out

    for name, calls in [("rope", {0, 1}), ("rope:1", {1}), (lambda n: n == "rope:1", {1})]:
        out = maybe_jit(
            lambda x, name=name: jhooks.run_with_hooks(
                block, x, fwd_hooks=[(name, lambda v, n: v * 0.5)]
            )
        )(x)
        close(out, twin_with(calls))


def test_named_modules_lists_a_shared_module_under_every_path():
    block, twin, _ = block_and_twin()
    for remove_duplicate in (True, False):
        ours = [n for n, _ in jhooks.named_modules(block, remove_duplicate=remove_duplicate)]
        theirs = [n for n, _ in twin.named_modules(remove_duplicate=remove_duplicate)]
        assert sorted(ours) == sorted(theirs)
    assert [n for n, _ in jhooks.named_modules(block, remove_duplicate=False)].count("ls2") == 1
    assert jhooks.module_path(block.ls2) == "ls1"  # its first path, as PyTorch names it


# Module inputs


class Attention(eqx.Module):
    qkv: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, key, heads=2):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(D, 3 * D, key=k1)
        self.o_proj = eqx.nn.Linear(D, D, key=k2)
        self.heads = heads

    def project(self, x):
        t = x.shape[0]
        q, k, v = (a.reshape(t, self.heads, -1) for a in jnp.split(jax.vmap(self.qkv)(x), 3, -1))
        pattern = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(D // self.heads))
        return jnp.einsum("hqk,khd->qhd", pattern, v).reshape(t, D)


class Model(eqx.Module):
    attn: Attention

    def __call__(self, x):
        return jnp.sum(jnp.tanh(self.attn.o_proj(self.attn.project(x).reshape(-1)[:D])) ** 2)


def test_module_inputs_are_points_when_asked(maybe_jit):
    model = jhooks.hookable(Model(Attention(jax.random.PRNGKey(2))))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, D)).astype(np.float32))
    z = model.attn.project(x).reshape(-1)[:D]

    # Not there unless named: the default cache holds module outputs only (`Attention`
    # has no `__call__`: its `project` calls are points, tests/test_module_methods.py).
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(model, x))(x)
    assert sorted(cache) == ["attn.o_proj", "attn.project", "attn.qkv"]
    # Named: cached, with its gradient, as PyTorch's pre-hook and `retain_grad` see it.
    twin = torch.nn.Linear(D, D)
    with torch.no_grad():
        twin.weight.copy_(torch.from_numpy(np.array(model.attn.o_proj.weight)))
        twin.bias.copy_(torch.from_numpy(np.array(model.attn.o_proj.bias)))
    tz = torch.from_numpy(np.array(z)).requires_grad_()
    torch.sum(torch.tanh(twin(tz)) ** 2).backward()
    loss, cache = maybe_jit(
        lambda x: jhooks.run_with_cache(model, x, names_filter="*.o_proj:in", incl_bwd=True)
    )(x)
    assert sorted(cache) == ["attn.o_proj:in", "attn.o_proj:in_grad"]
    close(cache["attn.o_proj:in"], z)
    close(cache["attn.o_proj:in_grad"], tz.grad.numpy())

    # Patched: one head of z zeroed where it meets the output projection.
    def zero_head_1(z, name):
        return z.at[3:].set(0.0)

    out = maybe_jit(
        lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("attn.o_proj:in", zero_head_1)])
    )(x)
    with torch.no_grad():
        expected = torch.sum(torch.tanh(twin(tz * torch.tensor([1.0] * 3 + [0.0] * 3))) ** 2)
    close(out, expected.numpy())


def test_an_input_point_costs_nothing_unless_named():
    plain = Model(Attention(jax.random.PRNGKey(2)))
    model = jhooks.hookable(plain)
    x = jnp.ones((4, D), jnp.float32)

    def by_hand(x):  # the model with one point placed by hand
        z = plain.attn.project(x).reshape(-1)[:D]
        return jnp.sum(jnp.tanh(jhooks.hook_point(plain.attn.o_proj(z), "attn.o_proj")) ** 2)

    def program(fn, names_filter):
        run = jax.make_jaxpr(lambda x: jhooks.run_with_cache(fn, x, names_filter=names_filter))
        return str(run(x))

    assert program(model, "attn.o_proj") == program(by_hand, "attn.o_proj")
    assert program(model, ["attn.o_proj", "attn.o_proj:in"]) != program(by_hand, "attn.o_proj")


# Equinox's MultiheadAttention maps its attention over heads with a vmap of its own: a
# hook there sees all heads, `(heads, q, k)`, as the cache shows them.

E, HEADS, T = 8, 4, 5


def stock_attention_and_twin():
    mha = eqx.nn.MultiheadAttention(HEADS, E, key=jax.random.PRNGKey(4))
    twin = torch.nn.MultiheadAttention(E, HEADS, bias=False, batch_first=True)
    with torch.no_grad():
        in_proj = [np.array(p.weight) for p in (mha.query_proj, mha.key_proj, mha.value_proj)]
        twin.in_proj_weight.copy_(torch.from_numpy(np.concatenate(in_proj)))
        twin.out_proj.weight.copy_(torch.from_numpy(np.array(mha.output_proj.weight)))
    x = np.random.default_rng(5).normal(size=(T, E)).astype(np.float32)
    return jhooks.hookable(mha), twin, x


def test_stock_multihead_attention_pattern_is_per_head(maybe_jit):
    mha, twin, x = stock_attention_and_twin()
    tx = torch.from_numpy(x)[None]
    with torch.no_grad():
        expected_out, weights = twin(tx, tx, tx, need_weights=True, average_attn_weights=False)
    weights = weights[0].numpy()  # (heads, q, k)

    # The pattern is the output of the attention's dropout (the identity at inference).
    out, cache = maybe_jit(lambda x: jhooks.run_with_cache(mha, x, x, x, names_filter="dropout"))(x)
    assert cache["dropout"].shape == (HEADS, T, T)
    close(cache["dropout"], weights, rtol=0, atol=1e-6)
    close(out, expected_out[0].numpy(), atol=1e-5)

    # A hook sees the same value, so a patch of head 2 edits head 2 only.
    shapes = []

    def zero_head_2(pattern, name):
        shapes.append(pattern.shape)
        return pattern.at[2].set(0.0)

    out = maybe_jit(
        lambda x: jhooks.run_with_hooks(mha, x, x, x, fwd_hooks=[("dropout", zero_head_2)])
    )(x)
    assert shapes == [(HEADS, T, T)]
    patched = weights.copy()
    patched[2] = 0.0
    w_v = twin.in_proj_weight[2 * E :].detach().numpy()
    v = (x @ w_v.T).reshape(T, HEADS, E // HEADS)
    z = np.einsum("hqk,khd->qhd", patched, v).reshape(T, E)
    close(out, z @ twin.out_proj.weight.detach().numpy().T, atol=1e-5)


class AttentionBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return self.attn(x, x, x)


def test_under_the_models_own_vmap_modules_and_operations_have_its_axis_first(maybe_jit):
    # A module's point under the model's own vmap is stacked with the vmap's axis first, and
    # so is an operation's: a `Linear`'s `dot_general`, whose batching rule puts the
    # positions last, is seen (positions, features), as the module's output. (Until
    # issue 43 it was seen as the batching made it, (features, positions): on a square
    # layer `v.at[0]` then edited a feature where a position was meant.)
    model = jhooks.hookable(AttentionBlock(stock_attention_and_twin()[0]))
    x = stock_attention_and_twin()[2]
    shapes = {op.address: op.shape for op in jhooks.ops(model, x)}
    assert shapes["attn.query_proj/dot_general"] == (T, E)  # (positions, features)
    assert shapes["attn/softmax"] == (HEADS, T, T)  # the heads' vmap's axis first here
    names = ["attn.query_proj", "attn.query_proj/dot_general", "attn.dropout"]
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(model, x, names_filter=names))(x)
    assert cache["attn.query_proj"].shape == (T, E)  # the module's output: positions first
    assert cache["attn.query_proj/dot_general"].shape == (T, E)
    close(cache["attn.query_proj/dot_general"], cache["attn.query_proj"], rtol=0, atol=0)
    assert cache["attn.dropout"].shape == (HEADS, T, T)

    # A hook sees each point as the cache shows it.
    seen = {}

    def record(value, name):
        seen[name] = value.shape
        return value

    maybe_jit(lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[(n, record) for n in names]))(x)
    assert seen == {
        "attn.query_proj": (T, E),
        "attn.query_proj/dot_general": (T, E),
        "attn.dropout": (HEADS, T, T),
    }


def test_a_hook_that_would_see_one_example_of_a_vmap_is_refused():
    ws = jnp.asarray(np.random.default_rng(6).normal(size=(3, D, D)).astype(np.float32))

    def f(xs):  # a scan traced inside a vmap: its points are per example there
        def one(x):
            step = lambda x, w: (jhooks.hook_point(jnp.tanh(w @ x), "layer"), None)  # noqa: E731
            return jax.lax.scan(step, x, ws)[0]

        return jax.vmap(one)(xs)

    xs = jnp.ones((2, D), jnp.float32)

    def scale(value, name):
        return value * 2.0

    with pytest.raises(
        ValueError,
        match=r"run_with_hooks: hook test_a_hook_that_would_see_one_example_of_a_vmap_is_refused"
        r".<locals>.scale selects point 'layer', which is inside a jax.vmap in the function, "
        r"with a jitted function or loop traced inside that vmap",
    ):
        jhooks.run_with_hooks(f, xs, fwd_hooks=[("layer", scale)])
    # Caching it is fine: the cache shows it batched.
    _, cache = jhooks.run_with_cache(f, xs)
    assert cache["layer"].shape == (3, 2, D)


# A model built from another model's blocks has registries of its own.


def test_a_model_built_from_another_models_blocks_names_its_own_points(maybe_jit):
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    model = jhooks.hookable(Looped([Block(k) for k in keys]))
    x = jnp.asarray(np.random.default_rng(8).normal(size=(D,)).astype(np.float32))
    # The stacked copy is built on the first block's structure (its registry included).
    leaves = [jnp.stack(a) for a in zip(*(jax.tree.leaves(b) for b in model.layers))]
    scanned = jhooks.hookable(
        Scanned(jax.tree.unflatten(jax.tree.structure(model.layers[0]), leaves))
    )
    assert jhooks.module_path(model.layers[0]) == "layers.0"
    assert jhooks.module_path(scanned.layers) == "layers"
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(model, x, names_filter="layers.0"))(x)
    assert list(cache) == ["layers.0"]
    # The same numbers; a hook on the original's block is not on the copy.
    expected = maybe_jit(lambda x: scanned(x))(x)
    close(expected, model(x))
    handle = model.layers[0].register_forward_hook(lambda m, args, out: out * 0.0)
    close(maybe_jit(lambda x: scanned(x))(x), expected)
    close(maybe_jit(lambda x: model(x))(x), Looped(model.layers[1:])(jnp.zeros(D, jnp.float32)))
    handle.remove()


def test_nnx_module_called_twice_and_shared(maybe_jit):
    from flax import nnx

    class NnxBlock(nnx.Module):
        def __init__(self):
            self.rope = nnx.Linear(D, D, rngs=nnx.Rngs(0))
            self.ls1 = self.ls2 = nnx.Linear(D, D, rngs=nnx.Rngs(1))

        def __call__(self, x):
            q, k = self.rope(x), self.rope(2.0 * x)
            return self.ls2(self.ls1(q) * k)

    block = jhooks.hookable(NnxBlock())
    x = jnp.asarray(np.random.default_rng(9).normal(size=(D,)).astype(np.float32))
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(block, x))(x)
    assert sorted(cache) == ["ls1", "ls1:1", "rope", "rope:1"]
    close(cache["rope:1"], block.rope(2.0 * x))
    close(cache["ls1:1"], block.ls1(cache["ls1"] * cache["rope:1"]))
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(block, x, names_filter="ls2:1"))(x)
    assert list(cache) == ["ls1:1"]
    assert [n for n, _ in jhooks.named_modules(block)] == ["", "ls1", "rope"]
    assert [n for n, _ in jhooks.named_modules(block, remove_duplicate=False)] == [
        "",
        "ls1",
        "ls2",
        "rope",
    ]


# How calls are counted: the branches of one lax.cond are one call; a jitted function
# called twice is two calls; nested vmaps inside the function are all peeled.


class CondModel(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        y = jax.lax.cond(x[0] > 0, lambda x: self.lin(x), lambda x: 2.0 * self.lin(x), x)
        return self.lin(y)


def test_the_branches_of_a_cond_are_one_call(maybe_jit):
    model = jhooks.hookable(CondModel(eqx.nn.Linear(D, D, key=jax.random.PRNGKey(10))))
    for sign in (1.0, -1.0):
        x = sign * jnp.arange(1.0, D + 1.0, dtype=jnp.float32)
        out, cache = maybe_jit(lambda x: jhooks.run_with_cache(model, x))(x)
        assert sorted(cache) == ["lin", "lin:1"]
        close(cache["lin"], model.lin(x))  # the branch that ran
        y = model.lin(x) * (1.0 if sign > 0 else 2.0)
        close(cache["lin:1"], model.lin(y))
        close(out, model.lin(y))


def test_a_jitted_function_called_twice_is_two_calls(maybe_jit):
    double = jax.jit(lambda x: jhooks.hook_point(2.0 * x, "p"))
    x = jnp.arange(3.0, dtype=jnp.float32)
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(lambda x: double(double(x)), x))(x)
    close(cache["p"], 2.0 * x)
    close(cache["p:1"], 4.0 * x)
    out = maybe_jit(
        lambda x: jhooks.run_with_hooks(
            lambda x: double(double(x)), x, fwd_hooks=[("p:1", lambda v, n: v + 1.0)]
        )
    )(x)
    close(out, 4.0 * x + 1.0)


def test_a_hook_under_nested_user_vmaps_sees_one_example(maybe_jit):
    """The user's `jax.vmap(jax.vmap(model))` inside the run's function: the hook sees
    one example, as a hook registered on the module does; the cache stacks every
    example, the outer vmap's axis first."""
    lin = eqx.nn.Linear(D, 3, key=jax.random.PRNGKey(11))
    model = jhooks.hookable(Looped([lin]))
    xs = jnp.asarray(np.random.default_rng(12).normal(size=(2, 4, D)).astype(np.float32))

    def fn(xs):  # the model per position, per sequence
        return jax.vmap(jax.vmap(model))(xs)

    shapes = []

    def zero_one(value, name):
        shapes.append(value.shape)
        return value.at[1].set(0.0)

    def run(xs):
        return jhooks.run_with_hooks(fn, xs, fwd_hooks=[("layers.0", zero_one)])

    out = maybe_jit(run)(xs)
    assert shapes == [(3,)]
    plain = jax.vmap(jax.vmap(lin))(xs)
    close(out, plain.at[..., 1].set(0.0))
    _, cache = maybe_jit(lambda xs: jhooks.run_with_cache(fn, xs))(xs)
    close(cache["layers.0"], plain)


def test_nnx_vmap_made_layers_under_nnx_scan():
    from flax import nnx

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    class Scan(nnx.Module):
        def __init__(self):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return NnxBlock(rngs)

            self.blocks = make(nnx.Rngs(0))

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def step(x, block):
                return block(x)

            return step(x, self.blocks)

    model = jhooks.hookable(Scan())
    x = jnp.asarray([0.5, -1.0, 2.0, 0.1], jnp.float32)
    kernel, bias = model.blocks.lin.kernel[...], model.blocks.lin.bias[...]
    hs, h = [], x
    for i in range(3):
        hs.append(h @ kernel[i] + bias[i])
        h = jnp.tanh(hs[-1])
    for run in (jhooks.run_with_cache, nnx.jit(jhooks.run_with_cache)):
        out, cache = run(model, x)
        close(cache["blocks.lin"], jnp.stack(hs))
        close(out, h)
    out = nnx.jit(
        lambda m, x: jhooks.run_with_hooks(m, x, fwd_hooks=[("blocks.lin", lambda v, n: v * 0)])
    )(model, x)
    close(out, jnp.zeros(4, jnp.float32))


def test_an_unselected_point_under_a_vmap_costs_nothing():
    model = jhooks.hookable(Looped([eqx.nn.Identity()]))
    xs = jnp.ones((D, 4), jnp.float32)

    def fn(xs):  # mapped along axis 1: a point taken out of the vmap is transposed first
        mapped = jax.vmap(lambda x: jnp.tanh(model(x)), in_axes=1)(xs)
        return jhooks.hook_point(mapped, "out")

    def program(hooked):
        hooks = [(hooked, lambda v, n: None)]
        run = jax.make_jaxpr(lambda xs: jhooks.run_with_hooks(fn, xs, fwd_hooks=hooks))
        return str(run(xs))

    plain = str(jax.make_jaxpr(fn)(xs))
    assert program("out") == plain
    assert program("layers.0") != plain  # selected: the program holds its hook's call

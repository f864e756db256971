"""Hook points in loops: lax.scan, fori_loop, cond, checkpoint, nested jit; loop_index.

A scan-over-layers transformer is checked against its unrolled twin (same weights, a
Python loop over layers) and a PyTorch twin: cached values and gradients, patching one
layer with `loop_index()`, gradient x activation attribution.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

RTOL = 2e-5
ATOL = 2e-6
D_IN, D, H, T, V, L = 3, 8, 2, 5, 7, 4
DH = D // H


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# -- the transformer, in Equinox ---------------------------------------------------------


class Attention(eqx.Module):
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(D, 3 * D, key=k1)
        self.out = eqx.nn.Linear(D, D, key=k2)

    def __call__(self, x, prefix):
        q, k, v = (a.reshape(T, H, DH) for a in jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1))
        scores = jnp.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(DH))
        scores = jnp.where(np.tril(np.ones((T, T), bool)), scores, np.float32(-1e9))
        pattern = jhooks.hook_point(jax.nn.softmax(scores, axis=-1), prefix + ".hook_pattern")
        z = jhooks.hook_point(jnp.einsum("hts,shd->thd", pattern, v), prefix + ".hook_z")
        return jax.vmap(self.out)(z.reshape(T, D))


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(D, 4 * D, key=k1)
        self.fc2 = eqx.nn.Linear(4 * D, D, key=k2)

    def __call__(self, x, prefix):
        post = jax.nn.gelu(jax.vmap(self.fc1)(x), approximate=True)
        return jax.vmap(self.fc2)(jhooks.hook_point(post, prefix + ".hook_post"))


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: Attention
    ln2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn, self.mlp = Attention(k1), MLP(k2)

    def __call__(self, x, prefix):
        x = x + self.attn(jax.vmap(self.ln1)(x), prefix + ".attn")
        return x + self.mlp(jax.vmap(self.ln2)(x), prefix + ".mlp")


def _randomize(tree, key):
    """LayerNorms start at 1 and 0: random weights make the comparison meaningful."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    new = [
        x + 0.3 * jax.random.normal(k, x.shape, x.dtype) if eqx.is_inexact_array(x) else x
        for x, k in zip(leaves, keys)
    ]
    return jax.tree.unflatten(treedef, new)


class ScanModel(eqx.Module):
    """Layers stacked along a leading axis (made with filter_vmap), applied with lax.scan."""

    embed: eqx.nn.Linear
    blocks: Block
    ln_f: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(D_IN, D, key=k1)
        self.blocks = _randomize(eqx.filter_vmap(Block)(jax.random.split(k2, L)), k4)
        self.ln_f = eqx.nn.LayerNorm(D)
        self.unembed = eqx.nn.Linear(D, V, key=k3)

    def __call__(self, x):
        x = jax.vmap(self.embed)(x)
        params, static = eqx.partition(self.blocks, eqx.is_array)

        @jax.checkpoint
        def body(x, p):
            return eqx.combine(p, static)(x, "blocks"), None

        x, _ = jax.lax.scan(body, x, params)
        return jax.vmap(self.unembed)(jax.vmap(self.ln_f)(x))


class LoopModel(eqx.Module):
    """The same model with its layers in a list and a Python loop."""

    embed: eqx.nn.Linear
    blocks: list
    ln_f: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, scanned):
        params, static = eqx.partition(scanned.blocks, eqx.is_array)
        self.embed, self.ln_f, self.unembed = scanned.embed, scanned.ln_f, scanned.unembed
        self.blocks = [
            eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static) for i in range(L)
        ]

    def __call__(self, x):
        x = jax.vmap(self.embed)(x)
        for i, block in enumerate(self.blocks):
            x = block(x, f"blocks.{i}")
        return jax.vmap(self.unembed)(jax.vmap(self.ln_f)(x))


def loss_fn(model, x, targets):
    logp = jax.nn.log_softmax(model(x), axis=-1)
    return -jnp.mean(logp[jnp.arange(T), targets])


# -- its PyTorch twin --------------------------------------------------------------------


class TAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.hook_pattern, self.hook_z = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, x):
        q, k, v = (a.reshape(T, H, DH) for a in self.qkv(x).split(D, dim=-1))
        scores = torch.einsum("thd,shd->hts", q, k) / np.sqrt(DH)
        scores = scores.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), -1e9)
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1))
        z = self.hook_z(torch.einsum("hts,shd->thd", pattern, v))
        return self.out(z.reshape(T, D))


class TMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)
        self.act, self.hook_post = torch.nn.GELU(approximate="tanh"), torch.nn.Identity()

    def forward(self, x):
        return self.fc2(self.hook_post(self.act(self.fc1(x))))


class TBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.attn, self.mlp = TAttention(), TMLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(D_IN, D)
        self.blocks = torch.nn.ModuleList([TBlock() for _ in range(L)])
        self.ln_f, self.unembed = torch.nn.LayerNorm(D), torch.nn.Linear(D, V)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_f(x))


def torch_twin(unrolled):
    net = TModel()
    ours = dict(jhooks.named_parameters(unrolled))
    with torch.no_grad():
        for name, param in net.named_parameters():
            param.copy_(torch.from_numpy(np.array(ours[name])))
    return net


def torch_loss(net, x, targets):
    logp = torch.log_softmax(net(torch.from_numpy(x)), dim=-1)
    return -logp[torch.arange(T), torch.from_numpy(targets)].mean()


# Points of every layer: hook points, and outputs of hookable modules (named by path).
POINTS = ["attn.hook_pattern", "attn.hook_z", "attn", "attn.qkv", "mlp.hook_post", "mlp", ""]


def _name(point, layer=None):
    prefix = "blocks" if layer is None else f"blocks.{layer}"
    return prefix + ("." + point if point else "")


def torch_cache(net, x, targets):
    """Activations (forward hooks) and their gradients (retain_grad), by module name."""
    acts = {}

    def keep(name):
        def hook(module, args, output):
            output.retain_grad()
            acts[name] = output

        return hook

    handles = [
        net.get_submodule(_name(p, i)).register_forward_hook(keep(_name(p, i)))
        for p in POINTS
        for i in range(L)
    ]
    loss = torch_loss(net, x, targets)
    loss.backward()
    for h in handles:
        h.remove()
    return (
        loss.item(),
        {n: a.detach().numpy() for n, a in acts.items()},
        {n: a.grad.numpy() for n, a in acts.items()},
    )


@pytest.fixture(scope="module")
def models():
    plain = ScanModel(jax.random.PRNGKey(0))
    scanned, unrolled = jhooks.hookable(plain), jhooks.hookable(LoopModel(plain))
    return scanned, unrolled, torch_twin(unrolled)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(T, D_IN)).astype(np.float32), rng.integers(0, V, size=T)


def test_scan_cache_equals_unrolled_and_torch(models, maybe_jit):
    scanned, unrolled, net = models
    x, targets = _data()
    wanted = [_name(p) for p in POINTS]
    value, cache = maybe_jit(
        lambda m, x: jhooks.run_with_cache(
            loss_fn, m, x, targets, names_filter=wanted, incl_bwd=True
        )
    )(scanned, x)
    value_u, cache_u = maybe_jit(
        lambda m, x: jhooks.run_with_cache(loss_fn, m, x, targets, incl_bwd=True)
    )(unrolled, x)
    torch_value, acts, grads = torch_cache(net, x, targets)
    close(value, value_u)
    close(value, torch_value)
    assert sorted(cache) == sorted(wanted + [n + "_grad" for n in wanted])
    for p in POINTS:
        stacked, stacked_grad = cache[_name(p)], cache[_name(p) + "_grad"]
        assert stacked.shape == (L, *cache_u[_name(p, 0)].shape)
        for i in range(L):
            close(stacked[i], cache_u[_name(p, i)])
            close(stacked_grad[i], cache_u[_name(p, i) + "_grad"])
            close(stacked[i], acts[_name(p, i)])
            close(stacked_grad[i], grads[_name(p, i)])


def zero_head_in_layer(layer, head):
    def hook(z, name):
        (i,) = jhooks.loop_index()
        return jnp.where(i == layer, z.at[:, head].set(0.0), z)

    return hook


def test_loop_index_patches_one_layer_like_the_unrolled_model(models, maybe_jit):
    scanned, unrolled, net = models
    x, targets = _data(1)

    def patched(model, x, hooks):
        return jax.value_and_grad(
            lambda x: jhooks.run_with_hooks(loss_fn, model, x, targets, fwd_hooks=hooks)
        )(x)

    value, grad = maybe_jit(
        lambda m, x: patched(m, x, [("blocks.attn.hook_z", zero_head_in_layer(2, 1))])
    )(scanned, x)
    expected = maybe_jit(
        lambda m, x: patched(m, x, [("blocks.2.attn.hook_z", lambda z, n: z.at[:, 1].set(0.0))])
    )(unrolled, x)
    clean = loss_fn(unrolled, x, targets)
    assert abs(float(value) - float(clean)) > 1e-4  # the patch does something
    close(value, expected[0])
    close(grad, expected[1])

    # PyTorch: the same patch with a forward hook on layer 2's hook_z.
    def torch_patch(module, args, output):
        output = output.clone()
        output[:, 1] = 0.0
        return output

    handle = net.blocks[2].attn.hook_z.register_forward_hook(torch_patch)
    torch_value = torch_loss(net, x, targets).item()
    handle.remove()
    close(value, torch_value)

    # A cache inside the patched run sees the patched values, stacked.
    _, cache = jhooks.run_with_cache(
        lambda x: jhooks.run_with_hooks(
            loss_fn,
            scanned,
            x,
            targets,
            fwd_hooks=[("blocks.attn.hook_z", zero_head_in_layer(2, 1))],
        ),
        x,
        names_filter="blocks.attn.hook_z",
    )
    assert np.all(np.asarray(cache["blocks.attn.hook_z"][2, :, 1]) == 0.0)
    assert np.any(np.asarray(cache["blocks.attn.hook_z"][1, :, 1]) != 0.0)


def test_gradient_times_activation_attribution_equals_torch(models, maybe_jit):
    scanned, _, net = models
    x, targets = _data(2)

    def attribution(model, x):
        _, cache = jhooks.run_with_cache(
            loss_fn, model, x, targets, names_filter="blocks.mlp.hook_post", incl_bwd=True
        )
        post = cache["blocks.mlp.hook_post"]
        return jnp.sum(post * cache["blocks.mlp.hook_post_grad"], axis=-1)  # (layer, position)

    ours = maybe_jit(attribution)(scanned, x)
    _, acts, grads = torch_cache(net, x, targets)
    theirs = np.stack(
        [
            np.sum(acts[f"blocks.{i}.mlp.hook_post"] * grads[f"blocks.{i}.mlp.hook_post"], -1)
            for i in range(L)
        ]
    )
    close(ours, theirs, atol=1e-5)


# -- each kind of control flow, on a small function --------------------------------------

WS = jnp.asarray(np.random.default_rng(3).normal(size=(3, 4, 4)).astype(np.float32) / 2)
X0 = jnp.asarray(np.random.default_rng(4).normal(size=(4,)).astype(np.float32))


def layer(x, w, name="layer"):
    return jhooks.hook_point(jnp.tanh(w @ x), name)


def by_hand(ws, x, probes):
    """The unrolled computation with a probe on each layer: values and gradients."""
    hs = []
    for w, p in zip(ws, probes):
        x = jnp.tanh(w @ x) + p
        hs.append(x)
    return jnp.sum(x**2), jnp.stack(hs)


def expected_cache():
    (value, hs), grads = jax.value_and_grad(lambda p: by_hand(WS, X0, p), has_aux=True)(
        jnp.zeros((3, 4), jnp.float32)
    )
    return value, hs, grads


def check_stacked(f, maybe_jit, name="layer"):
    value, cache = maybe_jit(lambda ws, x: jhooks.run_with_cache(f, ws, x, incl_bwd=True))(WS, X0)
    expected, hs, grads = expected_cache()
    close(value, expected)
    close(cache[name], hs)
    close(cache[name + "_grad"], grads)


@pytest.mark.parametrize("wrap", ["scan", "fori_loop", "jit", "jit_checkpoint"])
def test_points_in_scan_fori_loop_and_nested_jit(maybe_jit, wrap):
    def body(x, w):
        return layer(x, w), None

    if wrap == "jit_checkpoint":
        body = jax.jit(jax.checkpoint(body))
    inner = jax.jit(lambda ws, x: jax.lax.scan(body, x, ws)[0])

    def f(ws, x):
        if wrap == "fori_loop":
            x = jax.lax.fori_loop(0, 3, lambda i, x: layer(x, ws[i]), x)
        elif wrap == "jit":
            x = inner(ws, x)
        else:
            x = jax.lax.scan(body, x, ws)[0]
        return jnp.sum(x**2)

    check_stacked(f, maybe_jit)
    check_stacked(f, maybe_jit)  # again, from jit's caches


def test_points_in_checkpointed_layers(maybe_jit):
    def f(ws, x):
        for i in range(3):
            x = jax.checkpoint(lambda x, w, i=i: layer(x, w, f"layer{i}"))(x, ws[i])
        return jnp.sum(x**2)

    value, cache = maybe_jit(lambda ws, x: jhooks.run_with_cache(f, ws, x, incl_bwd=True))(WS, X0)
    expected, hs, grads = expected_cache()
    close(value, expected)
    for i in range(3):
        close(cache[f"layer{i}"], hs[i])
        close(cache[f"layer{i}_grad"], grads[i])


def test_nested_scans_stack_two_axes(maybe_jit):
    ws = jnp.stack([WS, WS[::-1]])  # (2, 3, 4, 4): two groups of three layers

    def f(ws, x):
        def group(x, ws_g):
            return jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws_g)[0], None

        return jnp.sum(jax.lax.scan(group, x, ws)[0] ** 2)

    def patch(v, name):
        g, i = jhooks.loop_index()
        return jnp.where((g == 1) & (i == 0), -v, v)

    def patched(ws, x):
        return jhooks.run_with_hooks(f, ws, x, fwd_hooks=[("layer", patch)])

    value, cache = maybe_jit(lambda ws, x: jhooks.run_with_cache(patched, ws, x, incl_bwd=True))(
        ws, X0
    )
    flat = jnp.concatenate([WS, WS[::-1]])
    signs = np.float32([1, 1, 1, -1, 1, 1])

    def unrolled(probes):
        x, hs = X0, []
        for w, s, p in zip(flat, signs, probes):
            x = s * jnp.tanh(w @ x) + p
            hs.append(x)
        return jnp.sum(x**2), jnp.stack(hs)

    (expected, hs), grads = jax.value_and_grad(unrolled, has_aux=True)(jnp.zeros((6, 4)))
    assert cache["layer"].shape == (2, 3, 4)
    close(value, expected)
    close(cache["layer"].reshape(6, 4), hs)
    close(cache["layer_grad"].reshape(6, 4), grads)


def test_cond_gives_the_branch_that_ran(maybe_jit):
    def f(x, flag):
        def yes(x):
            return jhooks.hook_point(jnp.sin(x), "branch") * 2.0

        def no(x):
            return jhooks.hook_point(jnp.cos(x), "branch") * 3.0

        def body(x, w):
            return jax.lax.cond(flag, yes, no, w @ x), None

        return jnp.sum(jax.lax.scan(body, x, WS)[0] ** 2)

    for flag in (True, False):
        scale = 2.0 if flag else 3.0
        value, cache = maybe_jit(lambda x, flag: jhooks.run_with_cache(f, x, flag, incl_bwd=True))(
            X0, flag
        )

        def unrolled(probes, fn=(jnp.sin if flag else jnp.cos), scale=scale):
            x, hs = X0, []
            for w, p in zip(WS, probes):
                h = fn(w @ x) + p
                hs.append(h)
                x = h * scale
            return jnp.sum(x**2), jnp.stack(hs)

        (expected, hs), grads = jax.value_and_grad(unrolled, has_aux=True)(jnp.zeros((3, 4)))
        close(value, expected)
        close(cache["branch"], hs)
        close(cache["branch_grad"], grads)


def test_cond_branches_must_agree():
    def one_sided(x):
        return jax.lax.cond(x[0] > 0, lambda x: jhooks.hook_point(x, "only_here"), lambda x: x, x)

    with pytest.raises(
        ValueError, match=r"hook point 'only_here' is reached in only some branches"
    ):
        jhooks.run_with_cache(one_sided, X0)

    def shapes_differ(x):
        return jax.lax.cond(
            x[0] > 0,
            lambda x: jnp.sum(jhooks.hook_point(x, "p")),
            lambda x: jnp.sum(jhooks.hook_point(x[:2], "p")),
            x,
        )

    with pytest.raises(ValueError, match=r"hook point 'p' has different shapes or dtypes"):
        jhooks.run_with_cache(shapes_differ, X0)
    # A hook that writes runs on values, in the branch the call takes, as in PyTorch.
    seen = []
    for x in (X0, -X0):
        jhooks.run_with_hooks(shapes_differ, x, fwd_hooks=[("p", lambda v, n: seen.append(v))])
        assert not isinstance(seen[-1], jax.core.Tracer)
        np.testing.assert_allclose(seen[-1], x if x[0] > 0 else x[:2])
    assert len(seen) == 2 and bool(X0[0] > 0) != bool(-X0[0] > 0)


def test_while_loop_refuses_caching_without_a_bound_but_runs_hooks():
    def f(x, n):
        return jax.lax.fori_loop(0, n, lambda i, x: layer(x, WS[0]), x)  # traced bounds

    with pytest.raises(
        ValueError,
        match=r"run_with_cache: hook point 'layer' is inside a lax.while_loop \(or a "
        r"lax.fori_loop with traced bounds\)",
    ):
        jax.jit(lambda x, n: jhooks.run_with_cache(f, x, n))(X0, 3)
    # Other points are cached when the loop's point is left out.
    out, cache = jhooks.run_with_cache(
        lambda x, n: jhooks.hook_point(f(x, n), "out"), X0, 3, names_filter="out"
    )
    close(cache["out"], out)
    out = jhooks.run_with_hooks(f, X0, 2, fwd_hooks=[("layer", lambda v, n: v * 0.0)])
    close(out, np.zeros(4))
    # loop_index() there: tests/test_loop_steps.py.


def test_loop_index_outside_loops_and_runs():
    assert jhooks.loop_index() == ()
    seen = []

    def hook(v, name):
        seen.append(jhooks.loop_index())
        return v

    jhooks.run_with_hooks(lambda x: layer(x, WS[0]), X0, fwd_hooks=[("layer", hook)])
    assert seen == [()]
    with pytest.raises(ValueError, match=r"called inside a loop with no run active"):
        jax.lax.scan(lambda c, w: (jhooks.loop_index(), None), 0, WS)


def test_host_hooks_see_concrete_values_in_a_compiled_run():
    # Runs compile once per hook structure (eager calls too), so hooks are traced;
    # jhooks.host gives them the concrete values every call.
    seen = []
    jhooks.run_with_hooks(
        lambda x: layer(x, WS[0]),
        X0,
        fwd_hooks=[("layer", jhooks.host(lambda v, n: seen.append(float(v[0]))))],
    )
    jax.effects_barrier()
    close(seen[0], np.tanh(WS[0] @ X0)[0])


def test_points_cost_nothing_outside_a_run():
    def f(ws, x):
        def body(x, w):
            return jax.lax.cond(x[0] > 0, lambda x: layer(x, w), lambda x: -x, x), None

        return jnp.sum(jax.lax.scan(jax.checkpoint(body), x, ws)[0] ** 2)

    def bare(ws, x):
        def body(x, w):
            return jax.lax.cond(x[0] > 0, lambda x: jnp.tanh(w @ x), lambda x: -x, x), None

        return jnp.sum(jax.lax.scan(jax.checkpoint(body), x, ws)[0] ** 2)

    assert str(jax.make_jaxpr(f)(WS, X0)) == str(jax.make_jaxpr(bare)(WS, X0))
    assert str(jax.make_jaxpr(jax.grad(f))(WS, X0)) == str(jax.make_jaxpr(jax.grad(bare))(WS, X0))


def test_names_reached_twice_in_a_loop_body(maybe_jit):
    def twice(x):
        def body(x, w):
            return layer(layer(x, w), w), None

        return jax.lax.scan(body, x, WS)[0]

    # The second reach in each iteration is the point `layer:1`, stacked as `layer` is.
    out, cache = maybe_jit(lambda x: jhooks.run_with_cache(twice, x))(X0)
    assert sorted(cache) == ["layer", "layer:1"]
    firsts, seconds, x = [], [], X0
    for w in WS:
        firsts.append(jnp.tanh(w @ x))
        x = jnp.tanh(w @ firsts[-1])
        seconds.append(x)
    close(cache["layer"], jnp.stack(firsts))
    close(cache["layer:1"], jnp.stack(seconds))
    close(out, x)
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(twice, x, names_filter="layer:1"))(X0)
    close(cache["layer:1"], jnp.stack(seconds))


def test_cached_gradients_are_after_backward_hooks_in_a_loop(maybe_jit):
    def f(ws, x):
        return jnp.sum(jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0] ** 2)

    def hooked(ws, x):
        return jhooks.run_with_hooks(f, ws, x, bwd_hooks=[("layer", lambda g, n: 2.0 * g)])

    _, cache = maybe_jit(lambda ws, x: jhooks.run_with_cache(hooked, ws, x, incl_bwd=True))(WS, X0)
    _, hs, grads = expected_cache()
    close(cache["layer"], hs)
    # As retain_grad in PyTorch: each layer's gradient after its hook (and those below it).
    close(cache["layer_grad"], np.float32([[8.0], [4.0], [2.0]]) * grads)


def test_loop_index_in_a_jitted_function_passed_to_a_run():
    traces = []

    @jax.jit
    def g(ws, x):
        traces.append(1)
        return jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]

    def negate_layer_1(v, name):
        return jnp.where(jhooks.loop_index()[0] == 1, -v, v)

    x = X0
    for i, w in enumerate(WS):
        x = jnp.tanh(w @ x) * (-1.0 if i == 1 else 1.0)
    for _ in range(3):
        out = jhooks.run_with_hooks(g, WS, X0, fwd_hooks=[("layer", negate_layer_1)])
        close(out, x)
    # The first call finds that the run must be staged; later ones are staged at once
    # and get the jitted function's traced program back.
    assert len(traces) == 2
    close(jhooks.run_with_hooks(g, WS, X0), g(WS, X0))


def test_vmap_within_fn_puts_the_batch_axis_after_the_loop_axes(maybe_jit):
    xs = jnp.stack([X0, -X0, 2.0 * X0])  # a batch of 3

    def f(ws, xs):
        def scanned(x):
            return jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]

        return jnp.sum(jax.vmap(scanned)(xs) ** 2)

    value, cache = maybe_jit(lambda ws, xs: jhooks.run_with_cache(f, ws, xs, incl_bwd=True))(WS, xs)
    assert cache["layer"].shape == (3, 3, 4)  # (layer, batch, features)
    for b in range(3):
        (_, hs), grads = jax.value_and_grad(lambda p, b=b: by_hand(WS, xs[b], p), has_aux=True)(
            jnp.zeros((3, 4), jnp.float32)
        )
        close(cache["layer"][:, b], hs)
        close(cache["layer_grad"][:, b], grads)


def _memory(fn, *args):
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def test_cache_in_a_scan_costs_what_returning_it_by_hand_costs():
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(6, 256, 256)).astype(np.float32) / 16)
    x = jnp.asarray(rng.normal(size=(128, 256)).astype(np.float32))

    def deep(ws, x, probes=None):
        def body(x, w_p):
            w, p = w_p
            h = jnp.tanh(x @ w) + (0.0 if p is None else p)
            h = jhooks.hook_point(h, "h")
            return x + jhooks.hook_point(h @ w, "out"), h

        x, hs = jax.lax.scan(body, x, (ws, probes))
        return jnp.sum(x**2), hs

    def cached(ws, x, **kwargs):
        return jhooks.run_with_cache(lambda ws, x: deep(ws, x)[0], ws, x, **kwargs)

    by_hand = _memory(deep, ws, x)
    assert _memory(lambda ws, x: cached(ws, x, names_filter="h"), ws, x) <= by_hand
    assert _memory(cached, ws, x) > by_hand  # both points: twice the stacked activations

    def grad_by_hand(ws, x, probes):
        return jax.value_and_grad(lambda p: deep(ws, x, p), has_aux=True)(probes)

    probes = jnp.zeros((6, 128, 256), jnp.float32)
    with_grad = _memory(lambda ws, x: cached(ws, x, names_filter="h", incl_bwd=True), ws, x)
    assert with_grad <= _memory(grad_by_hand, ws, x, probes)

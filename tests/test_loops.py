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
            eqx.combine(jax.tree.map(lambda a: a[i], params), static) for i in range(L)
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
    return loss.item(), {n: a.detach().numpy() for n, a in acts.items()}, {
        n: a.grad.numpy() for n, a in acts.items()
    }


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
        lambda m, x: jhooks.run_with_cache(loss_fn, m, x, targets, names_filter=wanted, incl_bwd=True)
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
            loss_fn, scanned, x, targets, fwd_hooks=[("blocks.attn.hook_z", zero_head_in_layer(2, 1))]
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
    theirs = np.stack([np.sum(acts[f"blocks.{i}.mlp.hook_post"] * grads[f"blocks.{i}.mlp.hook_post"], -1) for i in range(L)])
    close(ours, theirs, atol=1e-5)

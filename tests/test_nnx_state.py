"""Stateful Flax NNX layers with hooks: `nnx.BatchNorm` against PyTorch, `nnx.Dropout`.

Hooks see and may replace what the layer computes, as PyTorch's do, and the state the
layer updates (batch statistics, RNG counts) reaches the model, eagerly and through
`nnx.jit`, as it does without hooks.
"""

import functools

import jax.numpy as jnp
import nnx_models
import numpy as np
import pytest
import torch
from flax import nnx
from nnx_models import batch, torch_named

import jhooks

# The NNX tests' comparison, at an absolute tolerance of 1e-5 here.
assert_close = functools.partial(nnx_models.assert_close, atol=1e-5)


@pytest.fixture(params=["eager", "nnx.jit"])
def maybe_nnx_jit(request):
    return nnx.jit if request.param == "nnx.jit" else (lambda f: f)


class Normed(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.fc = nnx.Linear(3, 4, rngs=rngs)
        # PyTorch's defaults: running = 0.9 running + 0.1 batch.
        self.bn = nnx.BatchNorm(4, momentum=0.9, epsilon=1e-5, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.fc(x))


def bn_hooks(bn):
    """The same hooks on NNX's and PyTorch's batch norm."""
    bn.register_forward_pre_hook(lambda m, args: args[0] * 2.0)
    bn.register_forward_hook(lambda m, args, out: out + args[0][:, :1])
    bn.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))


def test_batchnorm_hooks_and_statistics_match_torch(maybe_nnx_jit):
    model = jhooks.hookable(Normed())
    tm = torch.nn.Sequential()
    tm.add_module("fc", torch.nn.Linear(3, 4))
    tm.add_module("bn", torch.nn.BatchNorm1d(4, eps=1e-5, momentum=0.1))
    named = torch_named(model)
    with torch.no_grad():
        for name, p in tm.named_parameters():
            p.copy_(torch.tensor(named[name]))
    bn_hooks(model.bn)
    bn_hooks(tm.bn)

    @maybe_nnx_jit
    def step(model, x):
        def loss(model):
            out = model(x)
            return jnp.sum(out**2), out

        (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return out, grads

    n = 6
    for seed in (1, 2):  # two steps: the second updates what the first wrote
        var, torch_var = np.asarray(model.bn.var[...]), tm.bn.running_var.numpy().copy()
        x = batch((n, 3), seed)
        out, grads = step(model, x)
        tm.zero_grad()
        xt = torch.tensor(np.asarray(x))
        out_t = tm(xt)
        (out_t**2).sum().backward()
        assert_close(out, out_t)
        grads = torch_named(grads)
        for name, p in tm.named_parameters():
            assert_close(grads[name].reshape(p.shape), p.grad)
        # Statistics of the input the pre-hook gave (as PyTorch), not of the output.
        assert_close(model.bn.mean[...], tm.bn.running_mean)
        # PyTorch keeps the unbiased variance of each batch, NNX the biased one.
        unbiased = (tm.bn.running_var.numpy() - 0.9 * torch_var) / 0.1
        assert_close(model.bn.var[...], 0.9 * var + 0.1 * unbiased * (n - 1) / n)


class Dropped(nnx.Module):
    def __init__(self):
        self.fc = nnx.Linear(3, 8, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.drop(self.fc(x))


def test_dropout_hooks_see_each_mask_and_the_rng_advances(maybe_nnx_jit):
    model = jhooks.hookable(Dropped())
    x = batch((4, 3))
    seen, grads_in = [], []
    model.drop.register_forward_hook(jhooks.host(lambda m, args, out: seen.append(out)))
    model.drop.register_forward_hook(lambda m, args, out: out * 3.0)
    model.drop.register_full_backward_hook(
        jhooks.host(lambda m, gi, go: grads_in.append((gi[0], go[0])))
    )

    def loss(model, x):
        out = model(x)
        return jnp.sum(out**2), out

    loss_and_grad = maybe_nnx_jit(nnx.value_and_grad(loss, has_aux=True))
    counts = []
    for _ in range(2):
        counts.append(int(model.drop.rngs.count[...]))
        (_, out), _ = loss_and_grad(model, x)
        # The hook saw the dropped output (kept entries scaled by 2), and replaced it.
        dropped = seen[-1]
        assert_close(out, dropped * 3.0)
        kept = dropped != 0
        assert 0 < kept.sum() < kept.size
        assert_close(dropped[kept], (model.fc(x) * 2.0)[kept])
        # The backward hook gets the gradients of the call, the forward hook's `* 3.0`
        # included (as in PyTorch, whose output wrapper is set after forward hooks).
        gi, go = grads_in[-1]
        assert_close(gi, go * kept * 2.0 * 3.0)
    assert counts[1] > counts[0] and int(model.drop.rngs.count[...]) > counts[1]
    assert not np.array_equal(seen[0] != 0, seen[1] != 0)  # a new mask each step
    model.eval()  # deterministic: the hook sees the layer's input
    out = maybe_nnx_jit(lambda m, x: m(x))(model, x)
    assert_close(seen[-1], model.fc(x))
    assert_close(out, model.fc(x) * 3.0)

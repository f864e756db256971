"""Hookable stateful layers (`eqx.nn.BatchNorm`, `eqx.nn.SpectralNorm`), against PyTorch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def batch(shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


class Net(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    sn: eqx.nn.SpectralNorm

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.lin = eqx.nn.Linear(3, 4, key=k1)
        self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch", momentum=0.9)
        self.sn = eqx.nn.SpectralNorm(eqx.nn.Linear(4, 2, key=k2), "weight", key=k3)

    def __call__(self, x, state):
        x, state = self.bn(self.lin(x), state)
        return self.sn(jnp.tanh(x), state)


def filter_jit(maybe_jit):
    """`maybe_jit` for functions of models, which hold non-array leaves (axis_name)."""
    return eqx.filter_jit if maybe_jit is jax.jit else maybe_jit


def batched(model):
    """The model over a batch, its state shared: BatchNorm's statistics are the batch's."""
    return jax.vmap(
        lambda m, x, s: m(x, s), axis_name="batch", in_axes=(None, 0, None), out_axes=(0, None)
    )


def apply(model, x, state, steps=2):
    outs = []
    for _ in range(steps):  # twice: the second step reads the state the first wrote
        out, state = batched(model)(model, x, state)
        outs.append(out)
    return outs, state


def test_stateful_layers_stay_as_equinox_needs_them():
    plain, _ = eqx.nn.make_with_state(Net)(jax.random.PRNGKey(0))
    net = jhooks.hookable(plain)
    # Named as PyTorch names them: the StateIndex keys are not modules there.
    assert [path for path, _ in jhooks.named_modules(net)] == ["", "lin", "bn", "sn", "sn.layer"]
    assert all(isinstance(m, jhooks.Module) for _, m in jhooks.named_modules(net))
    assert type(net.bn.batch_state_index) is eqx.nn.StateIndex
    assert type(net.sn.uv_index) is eqx.nn.StateIndex
    h = jhooks.register_module_hooks(net, "*", forward=lambda m, args, out: None)
    assert h.names == ["", "lin", "bn", "sn", "sn.layer"]
    h.remove()


def test_stateful_layers_with_forward_hooks_equal_unhooked(maybe_jit):
    plain, state = eqx.nn.make_with_state(Net)(jax.random.PRNGKey(0))
    net = jhooks.hookable(plain)
    x = batch((6, 3))
    calls = []

    def pre(module, args):
        calls.append(("pre", jhooks.module_path(module)))
        return tuple(args)  # a replacement equal to the arguments

    def post(module, args, output):
        calls.append(("post", jhooks.module_path(module)))
        out, new_state = output
        assert isinstance(new_state, eqx.nn.State)
        return out, new_state

    for module in (net.bn, net.sn, net.sn.layer):
        jhooks.register_forward_pre_hook(module, pre)
    jhooks.register_forward_hook(net.bn, post)
    jhooks.register_forward_hook(net.sn, post)
    jhooks.register_forward_hook(net.sn.layer, lambda m, args, out: out)
    outs, new_state = filter_jit(maybe_jit)(apply)(net, x, state)
    plain_outs, plain_state = filter_jit(maybe_jit)(apply)(plain, x, state)
    for out, plain_out in zip(outs, plain_outs):
        assert_close(out, plain_out, rtol=0, atol=0)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(plain_state)):
        assert_close(a, b, rtol=0, atol=0)
    assert ("pre", "bn") in calls and ("post", "sn") in calls and ("pre", "sn.layer") in calls


def test_stateful_layers_hooks_that_change_values(maybe_jit):
    plain, state = eqx.nn.make_with_state(Net)(jax.random.PRNGKey(0))
    net = jhooks.hookable(plain)
    x = batch((6, 3))
    jhooks.register_forward_pre_hook(net.sn, lambda m, args: (args[0] * 2.0, args[1]))
    jhooks.register_forward_hook(net.bn, lambda m, args, out: (out[0] + 1.0, out[1]))

    class Manual(eqx.Module):
        net: Net

        def __call__(self, x, state):
            y, state = self.net.bn(self.net.lin(x), state)
            return self.net.sn(jnp.tanh(y + 1.0) * 2.0, state)

    outs, new_state = filter_jit(maybe_jit)(apply)(net, x, state)
    want, want_state = filter_jit(maybe_jit)(apply)(Manual(plain), x, state)
    for out, w in zip(outs, want):
        assert_close(out, w)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state)):
        assert_close(a, b)


def torch_batchnorm(bn):
    tbn = torch.nn.BatchNorm1d(4, momentum=0.1)  # PyTorch's momentum is 1 - Equinox's
    with torch.no_grad():
        tbn.weight.copy_(torch.tensor(np.asarray(bn.weight)))
        tbn.bias.copy_(torch.tensor(np.asarray(bn.bias)))
    return tbn.train()


def test_batchnorm_forward_hook_matches_pytorch_training_mode(maybe_jit):
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        4, axis_name="batch", mode="batch", momentum=0.9
    )
    bn = jhooks.hookable(bn)
    bn = eqx.tree_at(lambda m: m.weight, bn, batch((4,), 3))  # copies share the hooks
    x = batch((8, 4)) * 3.0 + 1.0
    jhooks.register_forward_pre_hook(bn, lambda m, args: (args[0] * 0.5, args[1]))
    jhooks.register_forward_hook(bn, lambda m, args, out: (jnp.maximum(out[0], 0.0), out[1]))
    out, new_state = filter_jit(maybe_jit)(batched(bn))(bn, x, state)

    tbn = torch_batchnorm(bn)
    tbn.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    tbn.register_forward_hook(lambda m, args, out: out.clamp(min=0.0))
    with torch.no_grad():
        want = tbn(torch.tensor(np.asarray(x))).numpy()
    assert_close(out, want, rtol=1e-5, atol=1e-5)
    # The running mean after one step, as PyTorch's (both start at zero).
    hidden_mean, _ = new_state.get(bn.batch_state_index)
    assert_close(hidden_mean, tbn.running_mean.numpy(), rtol=1e-5, atol=1e-6)


def test_batchnorm_backward_hooks_under_vmap_with_unbatched_state_outputs(maybe_jit):
    """Backward hooks on a BatchNorm under vmap: its output is batched, its new state
    (running statistics, floating arrays) is not. Depends on the primitive of
    `_primitive.py` batching the unbatched values of one bind."""
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        4, axis_name="batch", mode="batch", momentum=0.9
    )
    bn = jhooks.hookable(bn)
    x = batch((8, 4)) * 3.0 + 1.0
    jhooks.register_full_backward_pre_hook(bn, lambda m, go: (go[0] * 3.0, *go[1:]))
    jhooks.register_full_backward_hook(bn, lambda m, gi, go: (gi[0] * 0.5, None))

    def loss(model_and_x):
        model, x = model_and_x
        out, _ = batched(model)(model, x, state)
        return jnp.sum(jnp.sin(out))

    grads, x_grad = filter_jit(maybe_jit)(eqx.filter_grad(loss))((bn, x))
    tbn = torch_batchnorm(bn)
    tbn.register_full_backward_pre_hook(lambda m, go: (go[0] * 3.0,))
    tbn.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    tx = torch.tensor(np.asarray(x)).requires_grad_(True)
    torch.sin(tbn(tx)).sum().backward()
    assert_close(x_grad, tx.grad, rtol=1e-4, atol=1e-5)
    assert_close(grads.weight, tbn.weight.grad, rtol=1e-4, atol=1e-5)
    assert_close(grads.bias, tbn.bias.grad, rtol=1e-4, atol=1e-5)

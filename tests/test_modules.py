"""Module hooks (API.md section 3), checked against PyTorch 2.13 with copied weights.

The parity tests run on Equinox models and on their Flax NNX twins (`nnx_models.py`):
the `mlp` and `cnn` fixtures give one of each.
"""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import nnx_models
import numpy as np
import optax
import pytest
import torch
from nnx_models import param_name, torch_named

import jhooks
from jhooks import module_path

torch.manual_seed(0)


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def to_torch(x):
    return torch.tensor(np.asarray(x))


def copy_linear(t, j):
    with torch.no_grad():
        t.weight.copy_(to_torch(j.weight))
        t.bias.copy_(to_torch(j.bias))


def copy_parameters(torch_module, model):
    """Copies every parameter of an Equinox or NNX `model` into the PyTorch twin."""
    named = torch_named(model)
    with torch.no_grad():
        for name, p in torch_module.named_parameters():
            p.copy_(to_torch(named[name].reshape(p.shape)))


def torch_grads(module):
    return {name: p.grad.detach().numpy() for name, p in module.named_parameters()}


def assert_grads(jax_grads, expected, **tolerance):
    """Compares a JAX gradient pytree with PyTorch's `.grad`s, by PyTorch name."""
    grads = torch_named(jax_grads)
    assert sorted(grads) == sorted(expected)
    for name, g in expected.items():
        assert_close(np.reshape(grads[name], g.shape), g, **tolerance)


# Models: an Equinox one and the same PyTorch one, with the same weights.


class Act(eqx.Module):
    """An activation as a module, as `torch.nn.ReLU` is (the function is static)."""

    fn: object = eqx.field(static=True)

    def __call__(self, x):
        return self.fn(x)


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    act: Act
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1)
        self.act = Act(jax.nn.relu)
        self.fc = eqx.nn.Linear(4 * 6 * 6, 10, key=k2)

    def __call__(self, x):
        return self.fc(self.act(self.conv(x)).reshape(-1))


class TorchCNN(torch.nn.Module):
    def __init__(self, cnn):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.act = torch.nn.ReLU()
        self.fc = torch.nn.Linear(4 * 6 * 6, 10)
        copy_parameters(self, cnn)

    def forward(self, x):
        return self.fc(self.act(self.conv(x)).flatten(1))


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    act: Act
    fc2: eqx.nn.Linear

    def __init__(self, key, sizes=(3, 5, 2)):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(sizes[0], sizes[1], key=k1)
        self.act = Act(jnp.tanh)
        self.fc2 = eqx.nn.Linear(sizes[1], sizes[2], key=k2)

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TorchMLP(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.fc1 = torch.nn.Linear(mlp.fc1.in_features, mlp.fc1.out_features)
        self.act = torch.nn.Tanh()
        self.fc2 = torch.nn.Linear(mlp.fc2.in_features, mlp.fc2.out_features)
        copy_parameters(self, mlp)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def batch(shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@functools.cache
def plain_cnn():
    return CNN(jax.random.PRNGKey(0))


@functools.cache
def plain_mlp():
    return MLP(jax.random.PRNGKey(0))


def mse(model, x, t):
    return jnp.mean((jax.vmap(model)(x) - t) ** 2)


def torch_mse(model, x, t, x_grad=False):
    tx = to_torch(x).requires_grad_(x_grad)
    loss = ((model(tx) - to_torch(t)) ** 2).mean()
    loss.backward()
    return tx


FRAMEWORKS = ["equinox", "nnx"]


@pytest.fixture(params=FRAMEWORKS)
def cnn(request):
    # Equinox: new modules, with hooks of their own. NNX: a new model, hookable in place.
    return jhooks.hookable(plain_cnn() if request.param == "equinox" else nnx_models.CNN())


@pytest.fixture(params=FRAMEWORKS)
def mlp(request):
    return jhooks.hookable(plain_mlp() if request.param == "equinox" else nnx_models.MLP())


def plain_twin(mlp):
    """An MLP of `mlp`'s framework without hooks, with the `mlp` fixture's weights."""
    return nnx_models.MLP() if nnx_models.is_nnx(mlp) else plain_mlp()


# hookable, names


def test_hookable_keeps_class_leaves_and_behaviour():
    plain = plain_cnn()
    net = jhooks.hookable(plain)
    assert isinstance(net, CNN) and isinstance(net.fc, eqx.nn.Linear)
    assert isinstance(net.conv, eqx.nn.Conv2d) and isinstance(net.fc, jhooks.Module)
    assert type(net.fc).__name__ == "Linear" and net.fc.in_features == 144
    assert repr(net) == repr(plain)
    plain_leaves, net_leaves = jax.tree.leaves(plain), jax.tree.leaves(net)
    assert len(plain_leaves) == len(net_leaves) == 4
    assert all(a is b for a, b in zip(plain_leaves, net_leaves))
    x = batch((2, 1, 8, 8))
    assert_close(jax.vmap(net)(x), jax.vmap(plain)(x), rtol=0, atol=0)
    # Idempotent: hooks already registered survive a second call.
    h = net.fc.register_forward_hook(lambda m, args, out: out * 0)
    again = jhooks.hookable(net)
    assert again.fc._jhooks is net.fc._jhooks
    assert float(jnp.abs(again(x[0])).max()) == 0.0
    h.remove()
    assert [module_path(m) for _, m in jhooks.named_modules(net)] == ["", "conv", "act", "fc"]


def test_stock_layers_and_containers():
    key = jax.random.PRNGKey(0)
    mlp = jhooks.hookable(eqx.nn.MLP(3, 2, 4, 2, key=key))
    seen = []
    mlp.layers[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    shared = eqx.nn.Linear(2, 2, key=key)
    tree = jhooks.hookable({"a": [shared, shared], "b": (eqx.nn.Identity(),)})
    assert tree["a"][0] is tree["a"][1]  # one module, one set of hooks
    assert [n for n, _ in jhooks.named_modules(tree)] == ["a.0", "b.0"]
    mlp(jnp.ones(3))
    assert seen == [(4,)]
    with pytest.raises(TypeError, match="expects an Equinox module"):
        jhooks.hookable(jnp.ones(3))


def test_names_match_pytorch():
    class Net(eqx.Module):
        conv: eqx.nn.Conv2d
        fc1: eqx.nn.Linear
        layers: list

        def __init__(self, key):
            k1, k2, k3, k4 = jax.random.split(key, 4)
            self.conv = eqx.nn.Conv2d(1, 2, 3, key=k1)
            self.fc1 = eqx.nn.Linear(4, 4, key=k2)
            self.layers = [eqx.nn.Linear(4, 4, key=k3), eqx.nn.Linear(4, 2, key=k4)]

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 2, 3)
            self.fc1 = torch.nn.Linear(4, 4)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])

    net, tnet = jhooks.hookable(Net(jax.random.PRNGKey(0))), TorchNet()
    params = list(jhooks.named_parameters(net))
    assert [n for n, _ in params] == [n for n, _ in tnet.named_parameters()]
    for (_, p), (_, tp) in zip(params, tnet.named_parameters()):
        assert p.size == tp.numel()
    assert params[3][1] is net.fc1.bias
    # nn.ModuleList is a module in PyTorch; a Python list is not one in Equinox.
    torch_modules = [n for n, m in tnet.named_modules() if not isinstance(m, torch.nn.ModuleList)]
    assert [n for n, _ in jhooks.named_modules(net)] == torch_modules


# Parity of gradients with PyTorch


def test_cnn_clamp_and_zeroed_bias(cnn, maybe_jit):
    x, t = batch((8, 1, 8, 8)), batch((8, 10), 2)
    cnn.act.register_full_backward_hook(lambda m, gi, go: (jnp.maximum(gi[0], 0.0),))
    cnn.register_parameter_hook("fc.bias", jnp.zeros_like)
    grads = maybe_jit(jax.grad(mse))(cnn, x, t)

    tm = TorchCNN(cnn)
    tm.act.register_full_backward_hook(lambda m, gi, go: (gi[0].clamp(min=0),))
    tm.fc.bias.register_hook(torch.zeros_like)
    torch_mse(tm, x, t)
    assert_grads(grads, torch_grads(tm))
    named = torch_named(grads)
    assert float(np.abs(named["fc.bias"]).max()) == 0.0
    assert float(np.abs(named["conv.weight"]).max()) > 0.0


def test_backward_pre_hooks_scale_grad_output(mlp, maybe_jit):
    x, t = batch((4, 3)), batch((4, 2), 2)
    mlp.fc2.register_full_backward_pre_hook(lambda m, go: (go[0] * 3.0,))
    mlp.act.register_full_backward_pre_hook(lambda m, go: (-go[0],))
    grads = maybe_jit(jax.grad(mse))(mlp, x, t)

    tm = TorchMLP(mlp)
    tm.fc2.register_full_backward_pre_hook(lambda m, go: (go[0] * 3.0,))
    tm.act.register_full_backward_pre_hook(lambda m, go: (-go[0],))
    torch_mse(tm, x, t)
    assert_grads(grads, torch_grads(tm))


def test_full_backward_hooks_replace_grad_input_and_see_pytorch_values(mlp, maybe_jit):
    x, t = batch((4, 3)), batch((4, 2), 2)
    seen = []
    mlp.act.register_full_backward_hook(jhooks.host(lambda m, gi, go: seen.append((gi, go))))
    mlp.act.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    grads, x_grad = maybe_jit(jax.grad(mse, argnums=(0, 1)))(mlp, x, t)

    tm, torch_seen = TorchMLP(mlp), []
    tm.act.register_full_backward_hook(
        lambda m, gi, go: torch_seen.append((gi[0].numpy().copy(), go[0].numpy().copy()))
    )
    tm.act.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    tx = torch_mse(tm, x, t, x_grad=True)
    assert_grads(grads, torch_grads(tm))
    assert_close(x_grad, tx.grad)
    # Per example under vmap: PyTorch's shapes without the batch dimension.
    assert len(seen) == 4 and seen[0][0][0].shape == (5,)
    assert_close(np.stack([gi[0] for gi, _ in seen]), torch_seen[0][0])
    assert_close(np.stack([go[0] for _, go in seen]), torch_seen[0][1])


def test_register_backward_hook_warns_and_acts_as_full(mlp):
    x, t = batch((4, 3)), batch((4, 2), 2)

    def halve(m, gi, go):
        return (gi[0] * 0.5,)

    with pytest.warns(FutureWarning, match="register_backward_hook is deprecated.*halve"):
        mlp.act.register_backward_hook(halve)
    grads = jax.grad(mse)(mlp, x, t)
    tm = TorchMLP(mlp)
    tm.act.register_full_backward_hook(halve)
    torch_mse(tm, x, t)
    assert_grads(grads, torch_grads(tm))


class Twice(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return self.lin(jnp.sin(self.lin(x)))


class TorchTwice(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        copy_linear(self.lin, m.lin)

    def forward(self, x):
        return self.lin(torch.sin(self.lin(x)))


def test_module_called_twice_outer_call_first(maybe_jit):
    net = jhooks.hookable(Twice(eqx.nn.Linear(3, 3, key=jax.random.PRNGKey(0))))
    x, t = batch((2, 3)), batch((2, 3), 2)
    seen = []
    net.lin.register_full_backward_pre_hook(jhooks.host(lambda m, go: seen.append(go[0])))
    net.lin.register_full_backward_hook(lambda m, gi, go: (gi[0] * 2.0,))
    net.register_parameter_hook("lin.weight", lambda g: g * 10.0)
    grads, x_grad = maybe_jit(jax.grad(mse, argnums=(0, 1)))(net, x, t)

    tm, torch_seen = TorchTwice(net), []
    tm.lin.register_full_backward_pre_hook(lambda m, go: torch_seen.append(go[0].numpy().copy()))
    tm.lin.register_full_backward_hook(lambda m, gi, go: (gi[0] * 2.0,))
    tm.lin.weight.register_hook(lambda g: g * 10.0)
    tx = torch_mse(tm, x, t, x_grad=True)
    assert_grads(grads, torch_grads(tm))
    assert_close(x_grad, tx.grad)
    # Two calls, the outer (second) call's hooks first; per example under vmap.
    assert len(torch_seen) == 2 and len(seen) == 4
    assert_close(np.stack(seen[:2]), torch_seen[0])
    assert_close(np.stack(seen[2:]), torch_seen[1])


def test_forward_pre_hook_non_tuple_and_forward_hook_replacing_output(mlp, maybe_jit):
    x, t = batch((4, 3)), batch((4, 2), 2)
    mlp.fc1.register_forward_pre_hook(lambda m, args: args[0] * 2.0)
    mlp.fc2.register_forward_hook(lambda m, args, out: out + args[0][:2])
    out = maybe_jit(jax.vmap(mlp))(x)
    grads = maybe_jit(jax.grad(mse))(mlp, x, t)

    tm = TorchMLP(mlp)
    tm.fc1.register_forward_pre_hook(lambda m, args: args[0] * 2.0)
    tm.fc2.register_forward_hook(lambda m, args, out: out + args[0][:, :2])
    assert_close(out, tm(to_torch(x)).detach())
    torch_mse(tm, x, t)
    assert_grads(grads, torch_grads(tm))


class Scaled(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x, *, scale=1.0):
        return self.lin(x) * scale


class TorchScaled(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        copy_linear(self.lin, m.lin)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


def test_with_kwargs(maybe_jit):
    net = jhooks.hookable(Scaled(eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))))
    tm = TorchScaled(net)
    x = batch((4, 3))
    for m in (net, tm):
        m.register_forward_pre_hook(
            lambda m, args, kwargs: (args, {**kwargs, "scale": kwargs["scale"] + 1.0}),
            with_kwargs=True,
        )
        m.register_forward_hook(
            lambda m, args, kwargs, out: out * kwargs["scale"], with_kwargs=True
        )

    def loss(net, x):
        out = jax.vmap(lambda x: net(x, scale=2.0))(x)
        return jnp.sum(out**2), out

    (_, out), grads = maybe_jit(jax.value_and_grad(loss, has_aux=True))(net, x)
    tout = tm(to_torch(x), scale=2.0)
    (tout**2).sum().backward()
    assert_close(out, tout.detach())
    assert_close(out, jax.vmap(net.lin)(x) * 9.0)
    assert_grads(grads, torch_grads(tm), rtol=1e-5, atol=1e-4)  # gradients of size 1e2


def hook_log(log, kind, label, n_args):
    def pre(m, args):
        log.append((kind, label))

    def fwd(m, args, out):
        log.append((kind, label))

    def bwd(m, gi, go):
        log.append((kind, label))

    return {1: lambda m, go: log.append((kind, label)), 2: pre, 3: fwd, 4: bwd}[n_args]


def register_all(module, log, label, prepend):
    module.register_forward_pre_hook(hook_log(log, "pre", label, 2), prepend=prepend)
    module.register_forward_hook(hook_log(log, "fwd", label, 3), prepend=prepend)
    module.register_full_backward_pre_hook(hook_log(log, "bpre", label, 1), prepend=prepend)
    module.register_full_backward_hook(hook_log(log, "bwd", label, 4), prepend=prepend)


def test_prepend_orders(mlp, maybe_jit):
    x, t = batch((4, 3)), batch((4, 2), 2)
    tm = TorchMLP(mlp)
    log, torch_log = [], []
    for label, prepend in [("a", False), ("b", False), ("c", True), ("d", False), ("e", True)]:
        register_all(mlp.fc2, log, label, prepend)
        register_all(tm.fc2, torch_log, label, prepend)
    maybe_jit(jax.grad(mse))(mlp, x, t)
    torch_mse(tm, x, t)
    assert log == torch_log
    assert [label for kind, label in log if kind == "pre"] == ["e", "c", "a", "b", "d"]


class Boom(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        raise ValueError("boom")


class TorchBoom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom")


def test_always_call_when_forward_raises(maybe_jit):
    net = jhooks.hookable(Boom(eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))))
    tm = TorchBoom()
    logs = []
    for m in (net, tm):
        log = []
        logs.append(log)
        m.register_forward_hook(lambda m, a, out, log=log: log.append(("plain", out)))
        m.register_forward_hook(
            lambda m, a, out, log=log: log.append(("always", out)), always_call=True
        )
        m.register_forward_hook(
            lambda m, a, k, out, log=log: log.append(("kwargs", k, out)),
            always_call=True,
            with_kwargs=True,
        )
    with pytest.raises(ValueError, match="boom"):
        maybe_jit(lambda x: net(x))(jnp.ones(2))
    with pytest.raises(ValueError, match="boom"):
        tm(torch.ones(2))
    assert logs[0] == logs[1] == [("always", None), ("kwargs", {}, None)]


def test_global_hooks_run_before_local_ones_as_in_pytorch(mlp, maybe_jit):
    x, t = batch((2, 3)), batch((2, 2), 2)
    tm = TorchMLP(mlp)
    torch_names = {m: n for n, m in tm.named_modules()}
    log, torch_log = [], []

    def globals_for(log, name_of):
        return [
            lambda m, args: log.append(("pre", "global", name_of(m))),
            lambda m, args, out: log.append(("fwd", "global", name_of(m))),
            lambda m, go: log.append(("bpre", "global", name_of(m))),
            lambda m, gi, go: log.append(("bwd", "global", name_of(m))),
        ]

    def register_globals(module, hooks):
        return [
            module.register_module_forward_pre_hook(hooks[0]),
            module.register_module_forward_hook(hooks[1]),
            module.register_module_full_backward_pre_hook(hooks[2]),
            module.register_module_full_backward_hook(hooks[3]),
        ]

    register_all(mlp.fc2, log, "local", False)
    register_all(tm.fc2, torch_log, "local", False)
    handles = register_globals(jhooks, globals_for(log, module_path))
    try:
        maybe_jit(jax.grad(mse, argnums=(0, 1)))(mlp, x, t)
    finally:
        for h in handles:
            h.remove()
    handles = register_globals(torch.nn.modules.module, globals_for(torch_log, torch_names.get))
    try:
        torch_mse(tm, x, t, x_grad=True)
    finally:
        for h in handles:
            h.remove()
    assert log == torch_log
    assert log[:3] == [("pre", "global", ""), ("pre", "global", "fc1"), ("fwd", "global", "fc1")]


# jit: registration retraces, removal returns to the cached program


@pytest.mark.usefixtures("settled_hook_state")  # it counts traces
def test_jit_retraces_on_registration_and_removal(mlp):
    traces = []
    x = batch((3, 3))

    @jax.jit
    def run(model, x):
        traces.append(None)
        return jax.vmap(model)(x)

    base = run(mlp, x)
    assert len(traces) == 1
    h = mlp.fc2.register_forward_hook(lambda m, args, out: out * 0.0)
    assert float(jnp.abs(run(mlp, x)).max()) == 0.0 and len(traces) == 2
    run(mlp, x)
    assert len(traces) == 2
    h.remove()
    assert_close(run(mlp, x), base, rtol=0, atol=0)
    assert len(traces) == 2  # the original program, from the cache
    # A global hook changes every module's output, the root's too.
    expected = jax.vmap(lambda x: mlp.fc2(jnp.tanh(mlp.fc1(x) + 1.0) + 1.0) + 2.0)(x)
    with jhooks.register_module_forward_hook(lambda m, args, out: out + 1.0):
        assert_close(run(mlp, x), expected)
    assert len(traces) == 3
    assert_close(run(mlp, x), base, rtol=0, atol=0)
    assert len(traces) == 3
    h = mlp.register_parameter_hook("fc2.bias", jnp.zeros_like)
    g = jax.jit(jax.grad(lambda m: jnp.sum(jax.vmap(m)(x))))
    assert float(jnp.abs(g(mlp).fc2.bias).max()) == 0.0
    h.remove()
    assert float(jnp.abs(g(mlp).fc2.bias).min()) == 3.0


def test_no_hooks_compiles_to_the_plain_program(mlp):
    plain = plain_twin(mlp)  # the same weights, not hookable
    net = mlp
    x, t = batch((4, 3)), batch((4, 2), 2)
    step = jax.jit(jax.grad(mse))

    def hlo(model):
        text = step.lower(model, x, t).compile().as_text()
        text = text[text.index("HloModule") : text.index("\nFileNames")]
        return re.sub(r", metadata=\{[^}]*\}", "", text)

    assert step.lower(net, x, t).as_text() == step.lower(plain, x, t).as_text()
    assert hlo(net) == hlo(plain)
    h = net.fc2.register_forward_hook(lambda m, args, out: out)
    assert hlo(net) == hlo(plain)  # an identity hook adds no operation
    h.remove()


# Training keeps the hooks


def test_training_survives_hooks_and_copies_share_them(tmp_path):
    net = jhooks.hookable(plain_cnn())
    x, y = batch((8, 1, 8, 8)), jnp.arange(8) % 10
    optim = optax.sgd(0.1)
    opt_state = optim.init(eqx.filter(net, eqx.is_array))
    traces = []

    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def step(model, opt_state):
        traces.append(None)
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    bias0 = net.fc.bias
    h = net.register_parameter_hook("fc.bias", jnp.zeros_like)
    model = net
    for _ in range(3):
        model, opt_state = step(model, opt_state)
    assert len(traces) == 1
    assert np.array_equal(model.fc.bias, bias0)  # the hook ran in every step
    assert not np.array_equal(model.fc.weight, net.fc.weight)
    copy = jax.tree.map(lambda a: a, model)
    eqx.tree_serialise_leaves(tmp_path / "m.eqx", copy)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "m.eqx", net)
    for m in (model, copy, loaded):
        assert m.fc._jhooks is net.fc._jhooks and module_path(m.fc) == "fc"
    assert_close(loaded.fc.weight, model.fc.weight, rtol=0, atol=0)
    loaded, opt_state = step(loaded, opt_state)
    assert np.array_equal(loaded.fc.bias, bias0)
    h.remove()  # a handle from the original model removes the hook from every copy
    loaded, opt_state = step(loaded, opt_state)
    assert len(traces) == 2
    assert not np.array_equal(loaded.fc.bias, bias0)


# vmap: parameter hooks see the total gradient, or per-example ones under vmap(grad)


def test_parameter_hook_total_under_vmap_and_per_example_under_vmap_of_grad(mlp, maybe_jit):
    x, t = batch((4, 3)), batch((4, 2), 2)
    seen = []
    mlp.register_parameter_hook("fc1.bias", jhooks.host(lambda g: seen.append(g)))

    def clip(g):
        return g / jnp.maximum(1.0, jnp.linalg.norm(g) / 0.05)

    mlp.register_parameter_hook(param_name(mlp, "fc1.weight"), clip)
    grads = maybe_jit(jax.grad(mse))(mlp, x, t)
    tm = TorchMLP(mlp)
    torch_seen = []
    tm.fc1.bias.register_hook(lambda g: torch_seen.append(g.numpy().copy()))
    tm.fc1.weight.register_hook(lambda g: g / torch.clamp(g.norm() / 0.05, min=1.0))
    torch_mse(tm, x, t)
    assert len(seen) == 1  # once, with the total gradient over the batch
    assert_close(seen[0], torch_seen[0])
    assert_grads(grads, torch_grads(tm))

    def one_loss(model, x, t):
        return jnp.mean((model(x) - t) ** 2)

    per_example = maybe_jit(jax.vmap(jax.grad(one_loss), in_axes=(None, 0, 0)))(mlp, x, t)
    per_example = torch_named(per_example, batch_dims=1)
    for i in range(4):
        tm.zero_grad()
        ((tm(to_torch(x[i])) - to_torch(t[i])) ** 2).mean().backward()
        assert_close(per_example["fc1.weight"][i], tm.fc1.weight.grad)
        assert_close(per_example["fc1.bias"][i], tm.fc1.bias.grad)
        assert_close(seen[1 + i], torch_seen[1 + i])
    assert len(seen) == 5


# jhooks.Module


def test_module_base_class_makes_children_hookable():
    class Block(jhooks.Module):
        lin: eqx.nn.Linear

        def __init__(self, key):
            self.lin = eqx.nn.Linear(2, 2, key=key)

        def __call__(self, x):
            return self.lin(x)

    class Doubled(Block):
        def __call__(self, x):
            return super().__call__(x) * 2.0

    class Net(jhooks.Module):
        blocks: tuple

        def __init__(self, key):
            self.blocks = (Block(key), Doubled(key))

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    net = Net(jax.random.PRNGKey(0))
    assert [module_path(m) for _, m in jhooks.named_modules(net)] == [
        "",
        "blocks.0",
        "blocks.0.lin",
        "blocks.1",
        "blocks.1.lin",
    ]
    calls = []
    net.blocks[1].register_forward_hook(lambda m, args, out: calls.append(module_path(m)))
    net.blocks[1].lin.register_forward_hook(lambda m, args, out: out + 1.0)
    x = jnp.ones(2)
    lin = net.blocks[1].lin
    assert_close(net(x), lin(net.blocks[0](x)) * 2.0)  # lin runs its own hook
    assert calls == ["blocks.1"]  # once, though Doubled calls Block.__call__ through super()


def test_forward_mode_is_unaffected(mlp):
    x = batch((3,))
    plain = plain_twin(mlp)
    mlp.fc1.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.0,))
    mlp.fc2.register_full_backward_pre_hook(lambda m, go: (go[0] * 0.0,))
    assert_close(jax.jacfwd(mlp)(x), jax.jacfwd(plain)(x))
    assert_close(jax.jvp(mlp, (x,), (jnp.ones(3),))[1], jax.jvp(plain, (x,), (jnp.ones(3),))[1])


# Errors name the hook and the module


def test_registering_on_a_module_that_is_not_hookable():
    plain = plain_mlp()
    jhooks.hookable(plain_mlp())  # the first call explains missing methods from then on
    # A plain module has no register_* methods, and the error and the functions say what
    # to call first (tests/test_modules_api.py: installed by hookable, not at import).
    with pytest.raises(
        AttributeError,
        match=r"Linear.register_forward_hook: this module is not hookable. Call `model = "
        r"jhooks.hookable\(model\)`",
    ):
        plain.fc1.register_forward_hook(print)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"cannot register a hook on Linear.*jhooks.hookable"):
        jhooks.register_forward_hook(plain.fc1, print)
    with pytest.raises(TypeError, match=r"cannot register a hook on Linear.*jhooks.hookable"):
        jhooks.Module.register_forward_hook(plain.fc1, print)
    with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
        plain.nonsense  # noqa: B018


def test_bad_hooks_raise_errors_naming_hook_and_module(mlp):
    x, t = batch((2, 3)), batch((2, 2), 2)
    grad = jax.jit(jax.grad(mse))  # the errors are raised while tracing

    def two_grads(m, go):
        return (go[0], go[0])

    with mlp.fc2.register_full_backward_pre_hook(two_grads):
        with pytest.raises(ValueError, match=r"two_grads of module 'fc2' \(Linear\) returned 2"):
            grad(mlp, x, t)

    def bad_shape(m, gi, go):
        return (jnp.zeros(2),)

    with mlp.act.register_full_backward_hook(bad_shape):
        with pytest.raises(ValueError, match=r"bad_shape of module 'act' \(Act\).*float32\[2\]"):
            jax.jit(jax.grad(mse, argnums=(0, 1)))(mlp, x, t)

    def too_many(m, gi, go):
        return (gi[0], gi[0])

    with mlp.fc2.register_full_backward_hook(too_many):
        with pytest.raises(
            ValueError, match=r"too_many of module 'fc2' \(Linear\) returned 2 grad"
        ):
            jax.jit(jax.grad(mse, argnums=(0, 1)))(mlp, x, t)

    def args_only(m, args, kwargs):
        return args

    with mlp.fc1.register_forward_pre_hook(args_only, with_kwargs=True):
        with pytest.raises(
            ValueError, match=r"args_only of module 'fc1' \(Linear\).*\(args, kwargs\)"
        ):
            jax.jit(lambda x: mlp(x))(x[0])

    def extra_arg(m, args):
        return (*args, 1.0)

    with mlp.fc1.register_forward_pre_hook(extra_arg):
        with pytest.raises(TypeError, match=r"module 'fc1' \(Linear\).*extra_arg.*from 1 to 2"):
            jax.jit(lambda x: mlp(x))(x[0])

    def wrong_grad(g):
        return g[:1]

    with mlp.register_parameter_hook("fc2.bias", wrong_grad):
        with pytest.raises(ValueError, match=r"wrong_grad on parameter 'fc2.bias' of module ''"):
            grad(mlp, x, t)

    framework = "nnx" if nnx_models.is_nnx(mlp) else "equinox"
    names = {"equinox": "fc1.weight, fc1.bias, fc2.weight", "nnx": "fc1.bias, fc1.kernel, fc2.bias"}
    with pytest.raises(ValueError, match=rf"no such parameter.*{names[framework]}"):
        mlp.register_parameter_hook("fc3.bias", wrong_grad)
    with pytest.raises(TypeError, match="hook must be callable"):
        mlp.fc1.register_forward_hook(3)
    # Nothing stale is left behind: the model works as before.
    plain = plain_twin(mlp)
    assert_close(
        torch_named(grad(mlp, x, t))["fc2.bias"], torch_named(grad(plain, x, t))["fc2.bias"]
    )


# Transformations and multi-output calls


class TorchLoop(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        copy_linear(self.lin, lin)


def hook_linear(lin, log):
    lin.register_full_backward_pre_hook(lambda m, go: (go[0] * 2.0,))

    def halve(m, gi, go):
        log.append(m.weight.shape)  # the module's shapes (and path), not its values
        return (gi[0] * 0.5,)

    lin.register_full_backward_hook(halve)


@pytest.mark.parametrize("transform", ["scan", "checkpoint"])
def test_scan_and_checkpoint_match_pytorch(transform, maybe_jit):
    lin = jhooks.hookable(eqx.nn.Linear(3, 3, key=jax.random.PRNGKey(3)))
    log = []
    hook_linear(lin, log)
    lin.register_parameter_hook("bias", lambda g: g * 3.0)
    x = batch((3,))

    def loss(m, x):
        if transform == "scan":
            c, _ = jax.lax.scan(lambda c, _: (jnp.tanh(m(c)), None), x, None, length=3)
        else:
            c = jax.checkpoint(lambda m, x: jnp.tanh(m(jnp.tanh(m(jnp.tanh(m(x)))))))(m, x)
        return jnp.sum(c**2)

    grads, x_grad = maybe_jit(jax.grad(loss, argnums=(0, 1)))(lin, x)
    tm = TorchLoop(lin)
    hook_linear(tm.lin, [])
    tm.lin.bias.register_hook(lambda g: g * 3.0)
    tx = to_torch(x).requires_grad_(True)
    c = tx
    for _ in range(3):
        c = torch.tanh(tm.lin(c))
    (c**2).sum().backward()
    assert_grads({"lin": grads}, {f"lin.{k}": v for k, v in torch_grads(tm.lin).items()})
    assert_close(x_grad, tx.grad)
    assert log and all(shape == (3, 3) for shape in log)


class Split(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x, power):
        y = self.lin(x)
        return y, y**power


class TorchSplit(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        copy_linear(self.lin, m.lin)

    def forward(self, x, power):
        y = self.lin(x)
        return y, y**power


class UseSplit(eqx.Module):
    split: Split

    def __call__(self, x):
        a, b = self.split(x, 2)
        return jnp.sum(a * b)


def test_tuple_outputs_and_non_array_arguments(maybe_jit):
    net = jhooks.hookable(UseSplit(Split(eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(4)))))
    tm = TorchSplit(net.split)
    shapes, torch_shapes = [], []
    for m, log in [(net.split, shapes), (tm, torch_shapes)]:
        m.register_full_backward_pre_hook(lambda m, go: (go[0], go[1] * 3.0))

        def hook(m, gi, go, log=log):
            log.append((len(gi), gi[1] is None, len(go)))
            return (gi[0] * -1.0, None)

        m.register_full_backward_hook(hook)
    x = batch((4, 3))
    loss = lambda net, x: jnp.sum(jax.vmap(net)(x))  # noqa: E731
    grads, x_grad = maybe_jit(jax.grad(loss, argnums=(0, 1)))(net, x)
    tx = to_torch(x).requires_grad_(True)
    a, b = tm(tx, 2)
    (a * b).sum().backward()
    assert_grads(grads.split, torch_grads(tm))
    assert_close(x_grad, tx.grad)
    assert shapes[0] == torch_shapes[0] == (2, True, 2)


def test_host_forward_hook_runs_every_step_with_concrete_values(mlp):
    outputs = []
    mlp.fc1.register_forward_hook(jhooks.host(lambda m, args, out: outputs.append(out)))
    run = jax.jit(lambda model, x: model(x))
    x = batch((3,))
    for _ in range(3):
        run(mlp, x)
    assert len(outputs) == 3 and all(isinstance(o, np.ndarray) for o in outputs)
    assert_close(outputs[2], plain_twin(mlp).fc1(x))

"""Flax NNX models: hookable in place, hooks through NNX's transforms and stateful layers.

PyTorch 2.13 is the oracle, with copied weights. The parity tests shared with Equinox
(the `mlp` and `cnn` fixtures of `test_modules.py`, `test_points_modules.py`) run on
NNX twins too; these tests are what only NNX has: in-place `hookable`, `nnx.jit` and
the other NNX transforms, `nnx.BatchNorm` and `nnx.Dropout` state, NNX copies.
"""

import collections
import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from nnx_models import MLP, assert_close, batch, torch_named

import jhooks


def torch_twin(model, layers):
    """A PyTorch `Sequential` named as `model`'s children, with `model`'s parameters."""
    twin = torch.nn.Sequential(collections.OrderedDict(layers))
    named = torch_named(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(torch.tensor(named[name].reshape(p.shape)))
    return twin


def torch_mlp(model):
    return torch_twin(
        model,
        [("fc1", torch.nn.Linear(3, 5)), ("act", torch.nn.Tanh()), ("fc2", torch.nn.Linear(5, 2))],
    )


def torch_grads(module):
    return {name: p.grad.numpy() for name, p in module.named_parameters()}


def assert_grads(grads, expected, **tolerance):
    named = torch_named(grads)
    assert sorted(named) == sorted(expected)
    for name, g in expected.items():
        assert_close(named[name].reshape(g.shape), g, **tolerance)


# hookable: in place, classes kept, names from NNX paths


class Tower(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(2)])
        self.bn = nnx.BatchNorm(2, rngs=rngs)
        self.shared = self.layers[0]  # the same module twice

    def __call__(self, x):
        return self.bn(self.shared(self.layers[1](self.layers[0](x))))


def test_hookable_is_in_place_and_keeps_classes_names_and_state():
    model = Tower(nnx.Rngs(0))
    layer, graphdef = model.layers[0], nnx.graphdef(model)
    x = batch((4, 2))
    plain_out = nnx.clone(model)(x)
    assert jhooks.hookable(model) is model and model.layers[0] is layer
    assert isinstance(layer, nnx.Linear) and type(layer).__name__ == "Linear"
    assert jhooks.hookable(model) is model  # again: nothing changes
    assert [n for n, _ in jhooks.named_modules(model)] == [
        "",
        "bn",
        "layers",
        "layers.0",
        "layers.1",
    ]  # `shared` is `layers.0`, listed once; nnx.List is a module, as torch's ModuleList
    assert jhooks.module_path(model.shared) == "layers.0"
    # Parameters are nnx.Params (BatchNorm's statistics are buffers, as in PyTorch).
    assert [n for n, _ in jhooks.named_parameters(model)] == [
        "bn.bias",
        "bn.scale",
        "layers.0.bias",
        "layers.0.kernel",
        "layers.1.bias",
        "layers.1.kernel",
    ]
    assert_close(model(x), plain_out, rtol=0, atol=0)
    # The graph is NNX's, with the hook registry a static attribute.
    assert nnx.graphdef(model) != graphdef
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(nnx.state(Tower(nnx.Rngs(0))))


def test_registering_on_a_plain_nnx_module_says_what_to_do():
    model = MLP()
    with pytest.raises(TypeError, match=r"cannot register a hook on Linear: it is not hookable"):
        jhooks.register_forward_hook(model.fc1, lambda m, a, o: None)
    jhooks.hookable(model)
    model.extra = nnx.Linear(2, 2, rngs=nnx.Rngs(1))  # added later: hookable() again
    with pytest.raises(TypeError, match=r"jhooks.hookable"):
        jhooks.register_forward_hook(model.extra, lambda m, a, o: None)
    h = jhooks.register_forward_hook(model.fc1, lambda m, a, o: o * 0.0)
    jhooks.hookable(model)  # keeps the hooks registered before
    assert_close(model.fc1(batch((3,))), np.zeros(5), rtol=0, atol=0)
    assert jhooks.module_path(model.extra) == "extra"
    h.remove()


def test_copies_pickles_and_deepcopies():
    model = jhooks.hookable(MLP())
    x = batch((3,))
    h = model.fc1.register_forward_hook(lambda m, a, o: o * 0.0)
    expected = model.fc2(jnp.tanh(jnp.zeros(5)))
    # nnx.clone (split and merge) and every NNX transform share the hooks, as the
    # one PyTorch module object would; the handle removes them from every copy.
    clone = nnx.clone(model)
    assert clone.fc1._jhooks is model.fc1._jhooks
    assert_close(clone(x), expected)
    # A deep copy or a pickle is hookable, without hooks (as for Equinox models).
    deep = copy.deepcopy(model)
    assert isinstance(deep, MLP) and jhooks.module_path(deep.fc2) == "fc2"
    assert not deep.fc1._jhooks.forward
    assert_close(deep(x), MLP()(x))
    deep.fc2.register_forward_hook(lambda m, a, o: o + 1.0)
    assert_close(deep(x), MLP()(x) + 1.0)
    h.remove()
    assert_close(clone(x), MLP()(x))

    tower = jhooks.hookable(Tower(nnx.Rngs(0)))  # (jnp.tanh, in MLP, does not pickle)
    tower.layers[1].register_forward_hook(lambda m, a, o: o * 0.0)
    loaded = pickle.loads(pickle.dumps(tower))
    assert isinstance(loaded, Tower) and jhooks.module_path(loaded.layers[1]) == "layers.1"
    assert not loaded.layers[1]._jhooks.forward
    y = batch((4, 2))
    assert_close(loaded(y), Tower(nnx.Rngs(0))(y))
    loaded.bn.register_forward_hook(lambda m, a, o: o * 0.0)
    assert_close(loaded(y), np.zeros((4, 2)), rtol=0, atol=0)


# NNX's transforms: the same hooks, the same gradients as PyTorch


def hooks_on(mlp):
    """Hooks of every kind, written once for NNX and PyTorch modules."""
    return [
        mlp.fc1.register_forward_pre_hook(lambda m, args: args[0] * 2.0),
        mlp.act.register_forward_hook(lambda m, args, out: out * 0.5),
        mlp.fc2.register_full_backward_pre_hook(lambda m, go: (go[0] * 3.0,)),
        mlp.act.register_full_backward_hook(lambda m, gi, go: (gi[0] - 0.1,)),
    ]


def loss_of(model, x, t):
    return jnp.mean((model(x) - t) ** 2)


TRANSFORMS = {
    "nnx.grad": lambda model, x, t: nnx.grad(loss_of)(model, x, t),
    "nnx.jit(nnx.grad)": lambda model, x, t: nnx.jit(nnx.grad(loss_of))(model, x, t),
    "nnx.value_and_grad": lambda model, x, t: nnx.value_and_grad(loss_of)(model, x, t)[1],
    "nnx.remat": lambda model, x, t: nnx.grad(
        lambda m, x, t: jnp.mean((nnx.remat(lambda m, x: m(x))(m, x) - t) ** 2)
    )(model, x, t),
    "nnx.vmap": lambda model, x, t: nnx.grad(
        lambda m, x, t: jnp.mean((nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, x) - t) ** 2)
    )(model, x, t),
    "split/merge + jax.jit(jax.grad)": lambda model, x, t: split_merge_grad(model, x, t),
}


def split_merge_grad(model, x, t):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x, t):
        return loss_of(nnx.merge(graphdef, params, rest), x, t)

    return jax.jit(jax.grad(loss))(params, x, t)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_hooks_under_nnx_transforms_match_torch(transform):
    model = jhooks.hookable(MLP())
    x, t = batch((4, 3)), batch((4, 2), 2)
    hooks_on(model)
    model.register_parameter_hook("fc1.bias", lambda g: g * 10.0)
    grads = TRANSFORMS[transform](model, x, t)

    tm = torch_mlp(model)
    hooks_on(tm)
    tm.fc1.bias.register_hook(lambda g: g * 10.0)
    ((tm(torch.tensor(np.asarray(x))) - torch.tensor(np.asarray(t))) ** 2).mean().backward()
    assert_grads(grads, torch_grads(tm))


@pytest.mark.usefixtures("settled_hook_state")  # it counts traces
def test_nnx_jit_retraces_exactly_when_hooks_change():
    model = jhooks.hookable(MLP())
    x = batch((4, 3))
    traces = []

    @nnx.jit
    def run(model, x):
        traces.append(None)
        return model(x)

    def zero(m, args, out):
        return out * 0.0

    base = run(model, x)
    assert len(traces) == 1
    h = jhooks.register_forward_hook(model.fc2, zero)
    assert float(jnp.abs(run(model, x)).max()) == 0.0 and len(traces) == 2
    run(model, x)
    assert len(traces) == 2
    h.remove()
    assert_close(run(model, x), base, rtol=0, atol=0)
    assert len(traces) == 2  # the program without the hook, from the cache
    h = jhooks.register_forward_hook(model.fc2, zero)  # the same hook again: cached too
    assert float(jnp.abs(run(model, x)).max()) == 0.0 and len(traces) == 2
    h.remove()
    expected = model.fc2(jnp.tanh(model.fc1(x) + 1.0) + 1.0) + 2.0
    with jhooks.register_module_forward_hook(lambda m, args, out: out + 1.0):
        assert_close(run(model, x), expected)  # every module's output, the root's too
    assert len(traces) == 3


def test_no_hooks_compile_to_the_plain_nnx_program():
    plain, net = MLP(), jhooks.hookable(MLP())
    x, t = batch((4, 3)), batch((4, 2), 2)

    def hlo(model):
        graphdef, state = nnx.split(model)
        step = jax.jit(jax.grad(lambda s, x, t: loss_of(nnx.merge(graphdef, s), x, t)))
        return step.lower(state, x, t).as_text()

    assert hlo(net) == hlo(plain)
    h = jhooks.register_forward_hook(net.fc2, lambda m, args, out: out)
    assert hlo(net) == hlo(plain)  # an identity hook adds no operation
    h.remove()


def test_training_with_an_optimizer_under_nnx_jit():
    model = jhooks.hookable(MLP())
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, t = batch((4, 3)), batch((4, 2), 2)
    traces = []

    @nnx.jit
    def step(model, optimizer):
        traces.append(None)
        loss, grads = nnx.value_and_grad(loss_of)(model, x, t)
        optimizer.update(model, grads)
        return loss

    bias = model.fc2.bias[...]
    h = model.register_parameter_hook("fc2.bias", jnp.zeros_like)
    losses = [float(step(model, optimizer)) for _ in range(3)]
    assert len(traces) == 1 and losses[2] < losses[0]
    assert np.array_equal(model.fc2.bias[...], bias)  # the hook ran in every step
    h.remove()
    step(model, optimizer)
    assert len(traces) == 2 and not np.array_equal(model.fc2.bias[...], bias)


# Scan over layers made by nnx.vmap


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class Stack(nnx.Module):
    def __init__(self, rngs, n=3):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


def torch_stack(model):
    kernels, biases = model.blocks.linear.kernel[...], model.blocks.linear.bias[...]
    layers = []
    for k, b in zip(kernels, biases):
        linear = torch.nn.Linear(4, 4)
        with torch.no_grad():
            linear.weight.copy_(torch.tensor(np.asarray(k).T))
            linear.bias.copy_(torch.tensor(np.asarray(b)))
        layers.append(linear)
    return layers


def test_scan_over_layers_runs_hooks_per_layer_as_torch():
    model = jhooks.hookable(Stack(nnx.Rngs(0)))
    assert [n for n, _ in jhooks.named_modules(model)] == ["", "blocks", "blocks.linear"]
    x = batch((2, 4))
    seen, grads_in = [], []
    model.blocks.linear.register_forward_hook(lambda m, a, out: out * 0.5)
    model.blocks.register_forward_hook(jhooks.host(lambda m, a, out: seen.append(out)))
    model.blocks.register_full_backward_hook(jhooks.host(lambda m, gi, go: grads_in.append(gi[0])))
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2)))(model, x)

    layers, h = torch_stack(model), torch.tensor(np.asarray(x)).requires_grad_(True)
    torch_seen, torch_in = [], [h]
    for linear in layers:
        h = torch.tanh(linear(h) * 0.5)
        torch_seen.append(h)
        h.retain_grad()
        torch_in.append(h)
    (h**2).sum().backward()
    assert_close(loss, (h**2).sum())
    assert len(seen) == 3  # once per layer, as the scan runs
    for ours, theirs in zip(seen, torch_seen):
        assert_close(ours, theirs)
    # Backward: the last layer first; grad_input is the gradient of each layer's input.
    for ours, theirs in zip(grads_in, reversed(torch_in[:3])):
        assert_close(ours, theirs.grad)
    kernel_grads = grads["blocks"]["linear"]["kernel"][...]
    for i, linear in enumerate(layers):
        assert_close(kernel_grads[i].T, linear.weight.grad)

    # Points inside the scan come back stacked along the layers.
    _, cache = jhooks.run_with_cache(lambda m, x: jnp.sum(m(x) ** 2), model, x, incl_bwd=True)
    assert sorted(cache) == ["blocks", "blocks.linear", "blocks.linear_grad", "blocks_grad"]
    assert cache["blocks"].shape == (3, 2, 4)
    for i in range(3):
        assert_close(cache["blocks"][i], torch_seen[i])
        assert_close(cache["blocks_grad"][i], torch_in[i + 1].grad)

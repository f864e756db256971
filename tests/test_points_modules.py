"""Module outputs as named points, and register_module_hooks, checked against PyTorch.

Each parity test runs on an Equinox model and on its Flax NNX twin (`nnx_models.Net`,
the same paths): the `framework` fixture picks one.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import nnx_models
import numpy as np
import pytest
import torch
from flax import nnx

import jhooks


class Block(eqx.Module):
    fc: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        self.fc = eqx.nn.Linear(6, 6, key=key)
        self.norm = eqx.nn.LayerNorm(6)

    def __call__(self, x):
        return x + jax.nn.relu(self.fc(self.norm(x)))


class Net(eqx.Module):
    proj: eqx.nn.Linear
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.proj = eqx.nn.Linear(4, 6, key=k1)
        self.blocks = [Block(k2), Block(k3)]
        self.head = eqx.nn.Linear(6, 3, key=k4)

    def __call__(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 6)
        self.blocks = torch.nn.ModuleList([TorchBlock(), TorchBlock()])
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(params=["equinox", "nnx"])
def framework(request):
    return request.param


def plain_net(framework):
    return Net(jax.random.PRNGKey(0)) if framework == "equinox" else nnx_models.Net()


def models(framework="equinox"):
    net = jhooks.hookable(plain_net(framework))
    tnet = TorchNet()
    params = nnx_models.torch_named(net)
    with torch.no_grad():
        for name, p in tnet.named_parameters():
            p.copy_(torch.tensor(params[name].reshape(p.shape)))
    return net, tnet


def xs(batch=5):
    return np.random.default_rng(0).normal(size=(batch, 4)).astype(np.float32)


def close(a, b, rtol=1e-5, atol=1e-6):
    if isinstance(b, torch.Tensor):
        b = b.detach().numpy()
    np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=atol)


MODULES = [
    "proj",
    "blocks.0.norm",
    "blocks.0.fc",
    "blocks.0",
    "blocks.1.norm",
    "blocks.1.fc",
    "blocks.1",
    "head",
]


def test_module_outputs_are_named_points(maybe_jit, framework):
    net, tnet = models(framework)
    x = xs()
    cache_t = {}
    for name, module in tnet.named_modules():
        if name:
            module.register_forward_hook(lambda m, a, o, name=name: cache_t.__setitem__(name, o))
    out_t = tnet(torch.from_numpy(x))

    out, cache = maybe_jit(jax.vmap(lambda x: jhooks.run_with_cache(net, x)))(x)
    close(out, out_t)
    # torch's ModuleList is a module ("blocks"), without a call: no output, no point.
    # An Equinox list is no module; an nnx.List is one, without a call.
    assert set(cache) == set(MODULES) == set(cache_t) - {"blocks"}
    for name in MODULES:
        close(cache[name], cache_t[name])


def test_patching_a_module_output_matches_torch(maybe_jit, framework):
    net, tnet = models(framework)
    x = xs()

    def ablate_t(module, args, output):
        return output * 0.5

    for block in tnet.blocks:
        block.fc.register_forward_hook(ablate_t)
    xt = torch.from_numpy(x).requires_grad_(True)
    tnet(xt).pow(2).sum().backward()

    def loss(x):
        hooks = [(lambda n: n.endswith(".fc"), lambda v, n: v * 0.5)]
        out = jax.vmap(lambda x: jhooks.run_with_hooks(net, x, fwd_hooks=hooks))(x)
        return jnp.sum(out**2)

    grad = maybe_jit(jax.grad(loss))(x)
    close(grad, xt.grad)
    # Only for that call.
    close(jax.vmap(net)(x), TorchNet.forward(models(framework)[1], torch.from_numpy(x)))


def test_cache_gradients_of_module_outputs_match_torch(maybe_jit, framework):
    net, tnet = models(framework)
    x = xs(1)[0]
    outs = {}

    def keep(name):
        def hook(module, args, output):
            output.retain_grad()
            outs[name] = output

        return hook

    for name in ("blocks.0", "blocks.1.fc"):
        tnet.get_submodule(name).register_forward_hook(keep(name))
    tnet(torch.from_numpy(x)).pow(2).sum().backward()

    value, cache = maybe_jit(
        lambda x: jhooks.run_with_cache(
            lambda x: jnp.sum(net(x) ** 2),
            x,
            names_filter=["blocks.0", "blocks.1.fc"],
            incl_bwd=True,
        )
    )(x)
    for name in ("blocks.0", "blocks.1.fc"):
        close(cache[name], outs[name])
        close(cache[name + "_grad"], outs[name].grad)


# Types are Equinox's; `types_in` gives their NNX twins.
WHERE = [
    (eqx.nn.Linear, ["proj", "blocks.0.fc", "blocks.1.fc", "head"]),
    ((eqx.nn.LayerNorm, Block), ["blocks.0", "blocks.0.norm", "blocks.1", "blocks.1.norm"]),
    ("blocks.*.fc", ["blocks.0.fc", "blocks.1.fc"]),
    ("blocks.1*", ["blocks.1", "blocks.1.fc", "blocks.1.norm"]),
    (lambda path, m: path.startswith("blocks.0"), ["blocks.0", "blocks.0.fc", "blocks.0.norm"]),
]


NNX_TYPES = {eqx.nn.Linear: nnx.Linear, eqx.nn.LayerNorm: nnx.LayerNorm, Block: nnx_models.Block}


def types_in(framework, where):
    """`where` with each Equinox type replaced by its NNX twin for an NNX model."""
    if framework == "equinox":
        return where
    if isinstance(where, tuple):
        return tuple(NNX_TYPES[t] for t in where)
    return NNX_TYPES.get(where, where) if isinstance(where, type) else where


@pytest.mark.parametrize("where, hooked", WHERE)
def test_register_module_hooks_selects(where, hooked, framework):
    net, _ = models(framework)
    where = types_in(framework, where)
    group = jhooks.register_module_hooks(net, where, forward=lambda m, a, o: None)
    assert sorted(group.names) == sorted(hooked)
    assert len(group.handles) == len(hooked)
    hooked_modules = [m for name, m in jhooks.named_modules(net) if name in hooked]
    assert all(m._jhooks.forward for m in hooked_modules)
    group.remove()
    assert not any(m._jhooks.forward for _, m in jhooks.named_modules(net))


@pytest.mark.parametrize("where, hooked", [WHERE[1], WHERE[2]])
def test_register_module_hooks_matches_torch(maybe_jit, where, hooked, framework):
    net, tnet = models(framework)
    where = types_in(framework, where)
    x = xs()
    calls = []

    def forward(module, args, output):
        calls.append(type(module).__name__)
        return output * 2.0

    def scale_grad_input(module, grad_input, grad_output):
        return tuple(None if g is None else g * 3.0 for g in grad_input)

    group = jhooks.register_module_hooks(
        net, where, forward=forward, full_backward=scale_grad_input
    )
    assert sorted(group.names) == sorted(hooked)
    for name in hooked:
        module = tnet.get_submodule(name)
        module.register_forward_hook(lambda m, a, o: o * 2.0)
        module.register_full_backward_hook(scale_grad_input)
    xt = torch.from_numpy(x).requires_grad_(True)
    out_t = tnet(xt)
    out_t.pow(2).sum().backward()

    def loss(x):
        out = jax.vmap(net)(x)
        return jnp.sum(out**2), out

    (_, out), grad = maybe_jit(jax.value_and_grad(loss, has_aux=True))(x)
    close(out, out_t)
    # Gradients reach 1e3 here (hooks scale them by 3 per level): float32 rounding.
    close(grad, xt.grad, rtol=1e-4, atol=1e-4)
    assert len(calls) == len(hooked)

    group.remove()
    out = jax.vmap(net)(x)
    with torch.no_grad():
        close(out, models(framework)[1](torch.from_numpy(x)))


def test_register_module_hooks_errors():
    net, _ = models()
    hook = lambda m, a, o: None  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"no module path matches 'block\.\*\.fcc'\. "
        r"Did you mean 'blocks\.1\.fc', 'blocks\.0\.fc'",
    ):
        jhooks.register_module_hooks(net, "block.*.fcc", forward=hook)
    with pytest.raises(
        ValueError,
        match=r"no module is an instance of <class 'equinox.nn.*Conv2d'>. The model holds: "
        r"Block, LayerNorm, Linear, Net",
    ):
        jhooks.register_module_hooks(net, eqx.nn.Conv2d, forward=hook)
    with pytest.raises(TypeError, match="needs at least one hook"):
        jhooks.register_module_hooks(net, eqx.nn.Linear)
    with pytest.raises(
        TypeError, match="the forward hook of register_module_hooks must be callable"
    ):
        jhooks.register_module_hooks(net, eqx.nn.Linear, forward=3)
    with pytest.raises(TypeError, match="`where` must be a module type"):
        jhooks.register_module_hooks(net, 3, forward=hook)
    with pytest.raises(TypeError, match="is not hookable"):
        jhooks.register_module_hooks(Net(jax.random.PRNGKey(0)), eqx.nn.Linear, forward=hook)


def test_unknown_module_path_lists_close_matches():
    net, _ = models()
    with pytest.raises(
        ValueError, match=r"no hook point named 'blocks.0.fcc'. Did you mean 'blocks.0.fc'"
    ):
        jhooks.run_with_hooks(net, xs()[0], fwd_hooks=[("blocks.0.fcc", lambda v, n: v)])


def test_points_under_a_vmap_inside_the_model():
    class Seq(eqx.Module):
        inner: eqx.nn.Linear

        def __call__(self, x):  # x: (positions, 4); the layer is applied per position
            return jax.vmap(self.inner)(x)

    model = jhooks.hookable(Seq(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(1))))
    x = jnp.asarray(xs())
    # The point is inside the model's own vmap: it comes back stacked along the batch axis.
    out, cache = jhooks.run_with_cache(model, x)
    assert list(cache) == ["inner"]
    close(cache["inner"], out)
    _, cache = jhooks.run_with_cache(model, x, names_filter="inner")
    close(cache["inner"], out)
    # Hooks still run there, per position.
    out = jhooks.run_with_hooks(model, x, fwd_hooks=[("inner", lambda v, n: v * 0.0)])
    close(out, np.zeros((5, 2), np.float32))


def test_hookable_model_without_a_run_is_plain(framework):
    net, _ = models(framework)
    plain = plain_net(framework)
    x = xs()[0]
    assert str(jax.make_jaxpr(net)(x)) == str(jax.make_jaxpr(plain)(x))

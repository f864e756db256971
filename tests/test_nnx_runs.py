"""Flax NNX models in runs and per-example gradients: `clipped_grad`, `emit`, caches.

`clipped_grad` is checked against `jax.vmap(jax.grad(...))` then clipping, over the
model's `nnx.Param`s (what `nnx.grad` differentiates); emitted values and cached
gradients against PyTorch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from nnx_models import CNN, MLP, assert_close, batch, torch_named

import jhooks


def vmap_grad_then_clip(loss, model, max_norm, *batch):
    """The reference: every per-example gradient, its norm, clipped, summed."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def params_loss(params, *example):
        return loss(nnx.merge(graphdef, params, rest), *example)

    per_example = jax.vmap(jax.grad(params_loss), in_axes=(None, 0, 0))(params, *batch)
    leaves = jax.tree.leaves(per_example)
    norms = jnp.sqrt(sum(jnp.sum(g**2, axis=tuple(range(1, g.ndim))) for g in leaves))
    weights = jnp.minimum(1.0, max_norm / norms)
    return jax.tree.map(lambda g: jnp.tensordot(weights, g, 1), per_example), norms


class RematMLP(MLP):
    """`fc1` under `nnx.remat`: `clipped_grad` takes its two-pass route (norms in the
    backward pass)."""

    def __call__(self, x):
        h = nnx.remat(lambda fc, x: fc(x))(self.fc1, x)
        return self.fc2(self.act(h))


CASES = {
    "mlp": (MLP, (6, 3), (6, 2)),
    "remat-mlp": (RematMLP, (6, 3), (6, 2)),
    "cnn": (CNN, (4, 1, 8, 8), (4, 10)),
}
JITS = {"eager": lambda f: f, "jax.jit": jax.jit, "nnx.jit": nnx.jit}


def assert_clipped_grad_matches(case, jit, passes=None):
    make, x_shape, y_shape = CASES[case]
    model = jhooks.hookable(make())
    xs, ys = batch(x_shape), batch(y_shape, 2)

    def loss(model, x, y):  # one example
        return jnp.sum((model(x) - y) ** 2)

    grads, norms = JITS[jit](jhooks.clipped_grad(loss, 0.5, passes=passes))(model, xs, ys)
    expected, expected_norms = vmap_grad_then_clip(loss, model, 0.5, xs, ys)
    assert isinstance(grads, nnx.State)  # shaped as nnx.grad's
    assert_close(norms, expected_norms, rtol=1e-4)
    assert bool(jnp.all(norms > 0.5))  # every example is clipped: the test clips
    got, want = torch_named(grads), torch_named(expected)
    assert sorted(got) == sorted(want)
    for name in want:
        assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("case", CASES)
def test_clipped_grad_of_an_nnx_model_is_exact(case, jit):
    assert_clipped_grad_matches(case, jit)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("case", ["mlp", "remat-mlp"])
def test_either_clipped_grad_route_on_an_nnx_model(case, passes):
    # `passes=1` under `nnx.remat` keeps the sites' records; `passes=2` without it taps.
    assert_clipped_grad_matches(case, "nnx.jit", passes)


def test_emit_from_nnx_module_backward_hooks_matches_torch():
    model = jhooks.hookable(MLP())
    x = batch((4, 3))

    def keep(m, grad_input, grad_output):
        jhooks.emit(f"{jhooks.module_path(m)}.grad_output", grad_output[0])

    model.act.register_full_backward_hook(keep)
    model.fc2.register_full_backward_hook(keep)
    loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    grads, emitted = jax.jit(jhooks.grad(loss))(model, x)
    _, cache = jhooks.run_with_cache(loss, model, x, incl_bwd=True)

    tm = torch.nn.Sequential()
    for name, layer in (("fc1", torch.nn.Linear(3, 5)), ("act", torch.nn.Tanh())):
        tm.add_module(name, layer)
    tm.add_module("fc2", torch.nn.Linear(5, 2))
    named = torch_named(model)
    with torch.no_grad():
        for name, p in tm.named_parameters():
            p.copy_(torch.tensor(named[name]))
    seen = {}
    for name in ("act", "fc2"):
        tm.get_submodule(name).register_full_backward_hook(
            lambda m, gi, go, name=name: seen.__setitem__(name, go[0])
        )
    (tm(torch.tensor(np.asarray(x))) ** 2).sum().backward()
    for name in ("act", "fc2"):
        assert_close(emitted[f"{name}.grad_output"], seen[name])
        assert_close(cache[f"{name}.grad_output"], seen[name])  # emits join the cache
        assert_close(cache[f"{name}_grad"], seen[name])  # the module output's gradient
    for name, p in tm.named_parameters():
        assert_close(torch_named(grads)[name], p.grad)


def test_runs_compute_with_a_copy_of_the_nnx_state():
    class Normed(nnx.Module):
        def __init__(self):
            self.fc = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.bn(self.fc(x))

    model = jhooks.hookable(Normed())
    x = batch((5, 3))
    out, cache = jhooks.run_with_cache(model, x)
    assert_close(cache["bn"], out)
    assert_close(cache["fc"], model.fc(x))
    # The statistics the run computed are not written back (see docs/flax_nnx.md).
    assert not np.any(model.bn.mean[...])
    assert_close(out, Normed()(x))


def test_hook_points_inside_an_nnx_module_are_named_under_its_path():
    class Attn(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return jhooks.hook_point(jnp.tanh(self.proj(x)), "hook_z")

    class Net(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([Attn(), Attn()])

        def __call__(self, x):
            return self.layers[1](self.layers[0](x))

    model = jhooks.hookable(Net())
    x = batch((2, 3))
    out, cache = jhooks.run_with_cache(model, x)
    assert "layers.0.hook_z" in cache and "layers.1.hook_z" in cache
    assert_close(cache["layers.1.hook_z"], out)
    patched = jhooks.run_with_hooks(model, x, fwd_hooks=[("layers.1.hook_z", lambda v, n: v * 0.0)])
    assert_close(patched, np.zeros((2, 3)), rtol=0, atol=0)


# Flax's `TestCapture.test_nested_modules` (tests/nnx/module_test.py), translated:
# submodules in a plain list made data by `nnx.data` (not an `nnx.List`), each with a
# point at its input, named by their NNX paths as `nnx.List`'s are (issue 35).
CONTAINERS = {
    "nnx.data(list)": (lambda foos: nnx.data(foos), ("0", "1", "2")),
    "nnx.data(tuple)": (lambda foos: nnx.data(tuple(foos)), ("0", "1", "2")),
    "nnx.data(dict)": (lambda foos: nnx.data(dict(zip("abc", foos))), ("a", "b", "c")),
    "nnx.List": (nnx.List, ("0", "1", "2")),  # a module itself, listed as "foos"
}


class Foo(nnx.Module):
    def __init__(self, scale):
        self.scale = nnx.Param(jnp.asarray(scale))

    def __call__(self, x):
        x = jhooks.hook_point(x, "grad_of_x")
        return x * self.scale[...]


class Foos(nnx.Module):
    def __init__(self, container):
        self.foos = container([Foo(2.0), Foo(3.0), Foo(5.0)])

    def __call__(self, x):
        for foo in self.foos.values() if isinstance(self.foos, dict) else self.foos:
            x = foo(x)
        return x


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("container", CONTAINERS)
def test_modules_in_nnx_data_containers_are_named_by_their_paths(container, jit):
    make, keys = CONTAINERS[container]
    model = jhooks.hookable(Foos(make))
    names = [f"foos.{key}" for key in keys]
    listed = ["", *(["foos"] if container == "nnx.List" else []), *names]
    assert [name for name, _ in jhooks.named_modules(model)] == listed
    everywhere = jhooks.named_modules(model, remove_duplicate=False)
    assert [name for name, _ in everywhere] == listed
    assert [jhooks.module_path(m) for _, m in jhooks.named_modules(model)] == listed

    x = batch((2, 3))
    loss = lambda m, x: jnp.sum(m(x))  # noqa: E731
    run = JITS[jit](lambda m, x: jhooks.run_with_cache(loss, m, x, incl_bwd=True))
    out, cache = run(model, x)
    points = [f"{name}.grad_of_x" for name in names]
    assert sorted(cache) == sorted(f"{n}{g}" for n in (*points, *names) for g in ("", "_grad"))
    # By hand: foo i sees x times the scales before it, and the loss's gradient at its
    # input is the product of the scales from it on; its output, the same one on.
    scales = [1.0, 2.0, 6.0, 30.0]
    for i, (name, point) in enumerate(zip(names, points)):
        assert_close(cache[point], x * scales[i])
        assert_close(cache[f"{point}_grad"], np.full((2, 3), 30.0 / scales[i]))
        assert_close(cache[name], x * scales[i + 1])
        assert_close(cache[f"{name}_grad"], np.full((2, 3), 30.0 / scales[i + 1]))
    assert_close(out, jnp.sum(x * 30.0))
    # A hook selects the point by its name: zeroing foo 1's input zeroes the output.
    zero = [(points[1], lambda v, n: v * 0.0)]
    patched = JITS[jit](lambda m, x: jhooks.run_with_hooks(m, x, fwd_hooks=zero))(model, x)
    assert_close(patched, np.zeros((2, 3)), rtol=0, atol=0)


@pytest.mark.parametrize("jit", ["eager", "nnx.jit"])
def test_a_backward_hook_uses_what_a_forward_hook_kept_as_in_torch(jit):
    # Values between hooks (issue 42) on an NNX model, under `nnx.jit` and `nnx.grad`:
    # the backward hook at `act` multiplies its gradient by the activation that the
    # forward hook kept, as a PyTorch forward hook registering a tensor hook does.
    model = jhooks.hookable(MLP())
    x = batch((4, 3))
    saved = {}

    def keep(z, name):
        saved["a"] = z

    def times_activation(g, name):
        return g * saved["a"]

    def loss(m, x):
        hooks = {"fwd_hooks": [("act", keep)], "bwd_hooks": [("act", times_activation)]}
        return jnp.sum(jhooks.run_with_hooks(m, x, **hooks) ** 2)

    grads = JITS[jit](nnx.grad(loss))(model, x)

    tm = torch.nn.Sequential()
    for name, layer in (("fc1", torch.nn.Linear(3, 5)), ("act", torch.nn.Tanh())):
        tm.add_module(name, layer)
    tm.add_module("fc2", torch.nn.Linear(5, 2))
    with torch.no_grad():
        for name, p in tm.named_parameters():
            p.copy_(torch.tensor(torch_named(model)[name]))
    kept = {}

    def torch_keep(module, args, output):
        kept["a"] = output.detach()
        output.register_hook(lambda g: g * kept["a"])

    tm.act.register_forward_hook(torch_keep)
    (tm(torch.tensor(np.asarray(x))) ** 2).sum().backward()
    for name, p in tm.named_parameters():
        assert_close(torch_named(grads)[name], p.grad)
    if jit == "eager":
        assert_close(saved["a"], kept["a"])  # the concrete activation, not a tracer

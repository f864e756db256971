"""Pickling hookable models: the copy is hookable, with registries of its own and no hooks."""

import copy
import pickle
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

try:
    import cloudpickle
except ImportError:  # optional
    cloudpickle = None

PICKLERS = [pickle] + ([cloudpickle] if cloudpickle is not None else [])


def tanh(x):  # jnp.tanh itself cannot be pickled by reference
    return jnp.tanh(x)


class Pair(eqx.Module):
    """A user class on `eqx.Module`, holding one module twice."""

    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        return self.b(tanh(self.a(x)))


class Block(jhooks.Module):
    """A user class on `jhooks.Module`, with stock layers inside."""

    seq: eqx.nn.Sequential
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.seq = eqx.nn.Sequential(
            [eqx.nn.Linear(3, 4, key=k1), eqx.nn.Lambda(tanh), eqx.nn.Linear(4, 3, key=k2)]
        )
        self.norm = eqx.nn.LayerNorm(3)

    def __call__(self, x):
        return self.norm(self.seq(x))


def models():
    key = jax.random.PRNGKey(0)
    lin = eqx.nn.Linear(3, 3, key=key)
    return {
        "stock": jhooks.hookable(eqx.nn.Linear(3, 3, key=key)),
        "user": jhooks.hookable(Pair(lin, lin)),
        "module": Block(key),
    }


def submodule(model):
    if isinstance(model, Pair):
        return model.a
    if isinstance(model, Block):
        return model.seq.layers[0]
    return model


@pytest.mark.parametrize("pickler", PICKLERS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("kind", ["stock", "user", "module"])
def test_round_trip(kind, pickler, maybe_jit):
    model = models()[kind]
    x = jnp.arange(3.0)
    # Block holds a function (eqx.nn.Lambda): jit it as Equinox does.
    run = (eqx.filter_jit if maybe_jit is jax.jit else maybe_jit)(lambda m, x: m(x))
    h = jhooks.register_forward_hook(submodule(model), lambda m, args, out: out * 0.0)
    hooked_out = run(model, x)

    loaded = pickler.loads(pickler.dumps(model))
    assert type(loaded) is type(model) and isinstance(loaded, jhooks.Module)
    assert [p for p, _ in jhooks.named_modules(loaded)] == [
        p for p, _ in jhooks.named_modules(model)
    ]
    for (_, a), (_, b) in zip(jhooks.named_modules(loaded), jhooks.named_modules(model)):
        if isinstance(b, jhooks.Module):
            assert jhooks.module_path(a) == jhooks.module_path(b)
            assert a._jhooks is not b._jhooks and not a._jhooks.active()
    if kind == "user":
        assert loaded.a is loaded.b  # still one module
    # No hooks on the copy: it computes what the model computes without them.
    h.remove()
    plain_out = run(model, x)
    assert not np.array_equal(hooked_out, plain_out)
    np.testing.assert_array_equal(run(loaded, x), plain_out)
    # Hooks can be registered on the copy; the original's hooks are its own.
    with jhooks.register_forward_hook(submodule(loaded), lambda m, args, out: out * 0.0):
        np.testing.assert_array_equal(run(loaded, x), hooked_out)
        np.testing.assert_array_equal(run(model, x), plain_out)
    with jhooks.register_forward_hook(submodule(model), lambda m, args, out: out * 0.0):
        np.testing.assert_array_equal(run(model, x), hooked_out)
        np.testing.assert_array_equal(run(loaded, x), plain_out)


def test_copies_that_share_hooks_still_share_them_after_pickling(maybe_jit):
    model = models()["user"]
    twin = jax.tree.map(lambda a: a, model)  # a copy: the same registries
    assert twin.a._jhooks is model.a._jhooks
    loaded, loaded_twin = pickle.loads(pickle.dumps((model, twin)))
    assert loaded.a._jhooks is loaded_twin.a._jhooks is not model.a._jhooks
    calls = []
    jhooks.register_forward_pre_hook(loaded.a, lambda m, args: calls.append(1))
    maybe_jit(lambda m, x: m(x))(loaded_twin, jnp.ones(3))
    assert len(calls) == 2  # a and b: one module


def test_deepcopy_is_a_fresh_copy_and_copy_shares(maybe_jit):
    model = models()["stock"]
    h = jhooks.register_forward_hook(model, lambda m, args, out: out * 0.0)
    deep, shallow = copy.deepcopy(model), copy.copy(model)
    assert deep._jhooks is not model._jhooks and not deep._jhooks.active()
    assert shallow._jhooks is model._jhooks
    run = maybe_jit(lambda m, x: m(x))
    assert float(jnp.abs(run(deep, jnp.ones(3))).max()) > 0
    assert float(jnp.abs(run(shallow, jnp.ones(3))).max()) == 0
    h.remove()


def test_unpicklable_hooks_do_not_stop_pickling():
    model = models()["stock"]
    local = jnp.ones(3)
    jhooks.register_forward_hook(model, lambda m, args, out: out + local)  # a lambda
    jhooks.register_parameter_hook(model, "bias", lambda g: g * 0.0)
    loaded = pickle.loads(pickle.dumps(model))
    assert not loaded._jhooks.active() and loaded._jhooks.parameters == {}


@pytest.mark.skipif(cloudpickle is None, reason="cloudpickle is not installed")
def test_cloudpickle_locally_defined_classes(maybe_jit):
    class Local(jhooks.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return self.lin(x) * 2.0

    class PlainLocal(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return self.lin(x) * 3.0

    key = jax.random.PRNGKey(0)
    x = jnp.ones(2)
    models = [Local(eqx.nn.Linear(2, 2, key=key))]
    models.append(jhooks.hookable(PlainLocal(eqx.nn.Linear(2, 2, key=key))))
    for model in models:
        loaded = cloudpickle.loads(cloudpickle.dumps(model))
        assert isinstance(loaded, jhooks.Module) and type(loaded).__name__ == type(model).__name__
        np.testing.assert_allclose(maybe_jit(lambda m, x: m(x))(loaded, x), model(x), rtol=1e-6)
        calls = []
        jhooks.register_forward_hook(loaded.lin, lambda m, args, out: calls.append(1))  # noqa: B023
        maybe_jit(lambda m, x: m(x))(loaded, x)
        model(x)
        assert calls == [1]


def test_a_pickle_written_by_jhooks_0_2_loads():
    # Written by jhooks 0.2 (flat modules) with `pickle.dumps(net, protocol=4)` of the model
    # built below; it names `jhooks._hookable` and `jhooks._module_registry`.
    with open(Path(__file__).parent / "data" / "hookable_sequential_v0.2.pkl", "rb") as f:
        loaded = pickle.load(f)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    built = jhooks.hookable(
        eqx.nn.Sequential(
            [eqx.nn.Linear(3, 4, key=k1), eqx.nn.LayerNorm(4), eqx.nn.Linear(4, 2, key=k2)]
        )
    )
    x = jnp.arange(3.0)
    np.testing.assert_allclose(loaded(x), built(x), rtol=1e-6)
    assert jhooks.module_path(loaded.layers[1]) == "layers.1"
    handle = jhooks.register_forward_hook(loaded.layers[2], lambda m, a, out: out * 2)
    np.testing.assert_allclose(jax.jit(loaded.__call__)(x), 2 * built(x), rtol=1e-6)
    handle.remove()
    np.testing.assert_allclose(loaded(x), built(x), rtol=1e-6)

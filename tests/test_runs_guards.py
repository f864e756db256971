"""Runs are never stale: everything a run reads is traced, or guarded, or refused.

Each test is a case of issue 15: the reference is the hook applied by hand, eagerly
(or `jax.jit` where the issue says so), call after call, while the values the hooks
read change between calls.
"""

import dataclasses
import functools
import types
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

W = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3)).astype(np.float32))
X = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3)).astype(np.float32))
TRACES: list = []


def f(w, x):
    TRACES.append(1)
    h = jhooks.hook_point(jnp.tanh(x @ w), "h")
    return jnp.sum(h**2)


def by_hand(hook, w=W, x=X):
    h = jnp.tanh(x @ w)
    new = hook(h, "h")
    return jnp.sum((h if new is None else new) ** 2)


def grad_by_hand(hook, w=W, x=X):
    def loss(x):
        h = jhooks.register_hook(jnp.tanh(x @ w), lambda g: hook(g, "h"))
        return jnp.sum(h**2)

    return jax.grad(loss)(x)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def check(hook, change, calls=3):
    """Runs `hook` through `run_with_hooks` and by hand, changing the values it reads
    with `change(i)` before each call; returns the number of traces."""
    TRACES.clear()
    for i in range(calls):
        change(i)
        close(jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", hook)]), by_hand(hook))
    return len(TRACES)


class Scaler:
    offset = 0.0  # a class attribute

    def __init__(self, alpha):
        self.alpha = alpha
        self.vec = np.zeros(3, np.float32)

    def method(self, h, name):
        return h * self.alpha + self.vec + self.offset

    def __call__(self, h, name):
        return h * self.alpha - self.vec


@dataclasses.dataclass
class Config:
    scale: float
    shift: jax.Array


def test_object_attributes_bound_methods_instances_classes_namespaces_dataclasses():
    s = Scaler(1.0)
    ns = types.SimpleNamespace(scale=2.0, on=True)
    cfg = Config(0.5, jnp.zeros(3))

    def attribute_change(i):
        s.alpha = 1.0 + i
        s.vec = np.full(3, i, np.float32)

    assert check(s.method, attribute_change) <= 2  # a number, then traced
    assert check(s, attribute_change) <= 2
    assert check(lambda h, n: h + s.vec, lambda i: s.vec.__setitem__(0, i)) <= 1

    def class_change(i):
        Scaler.offset = float(i)

    try:
        assert check(s.method, class_change) <= 2
    finally:
        Scaler.offset = 0.0

    def namespace(h, name):
        return h * ns.scale if ns.on else -h

    def ns_change(i):
        ns.scale = 2.0 + i
        ns.on = i != 1

    assert check(namespace, ns_change, calls=4) <= 4  # one program per flag, numbers traced
    assert (
        check(
            lambda h, n: h * cfg.scale + cfg.shift, lambda i: setattr(cfg, "shift", jnp.full(3, i))
        )
        <= 1
    )


def test_lists_of_bools_and_strings_and_sets_mutated_in_place():
    flags, words, chosen = [True, False], ["tanh"], {0}

    def hook(h, name):
        h = h * 2.0 if flags[0] else h
        h = jnp.sin(h) if words[0] == "sin" else h
        return h.at[:, 1].set(0.0) if 1 in chosen else h

    def change(i):
        flags[0] = i % 2 == 0
        words[0] = ("tanh", "sin")[i % 2]
        chosen.add(i)

    check(hook, change, calls=4)


class Trainer:
    def __init__(self, model):
        self.model = model

    def forward(self, x):
        return self.model(x)


class Net(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.sum(jhooks.hook_point(jnp.tanh(x @ self.w), "h") ** 2)


def test_a_model_reassigned_on_its_trainer_is_read_every_call(maybe_jit):
    trainer = Trainer(Net(W))
    # Its arrays are read outside the arguments: traced again at each new model, and
    # said so at the second (tests/test_runs_identity.py tests the warning).
    with pytest.warns(UserWarning, match="traced and compiled again.*`trainer`|self.model"):
        for epoch in range(3):
            trainer.model = Net(W * (epoch + 1.0))
            expected = trainer.model(X)
            out, cache = jhooks.run_with_cache(trainer.forward, X)
            close(out, expected)
            close(cache["h"], jnp.tanh(X @ trainer.model.w))
            double = jhooks.run_with_hooks(
                lambda x: trainer.model(x),  # noqa: B023
                X,
                fwd_hooks=[("h", lambda h, n: h * 2.0)],
            )
            close(double, 4.0 * expected)


BWD_SCALE = np.ones(3, np.float32)


def test_backward_hooks_read_arrays_mutated_in_place_and_attributes(maybe_jit):
    s = Scaler(1.0)

    def by_global(g, name):
        return g * BWD_SCALE

    for i in range(3):
        BWD_SCALE[:] = [1.0, i, -i]  # in place
        s.alpha = 1.0 + i
        s.vec = np.full(3, 0.1 * i, np.float32)
        for hook in (by_global, s):
            grad = maybe_jit(
                jax.grad(lambda x: jhooks.run_with_hooks(f, W, x, bwd_hooks=[("h", hook)]))  # noqa: B023
            )(X)
            close(grad, grad_by_hand(hook))
    BWD_SCALE[:] = 1.0


def _decorate(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        return fn(*args)

    return wrapper


DEEP = 1.0


def test_a_hook_behind_ten_decorators_reads_a_changed_global():
    global DEEP

    def hook(h, name):
        return h * DEEP

    decorated: Any = hook
    for _ in range(10):
        decorated = _decorate(decorated)
    try:
        for DEEP in (1.0, 2.0, -3.0):  # noqa: B007
            close(jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", decorated)]), by_hand(decorated))
    finally:
        DEEP = 1.0


class Layer(jhooks.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


def test_module_hooks_registered_again_after_a_change_are_not_stale():
    net = Layer(W)
    step = jax.jit(lambda net, x: jnp.sum(net(x) ** 2))
    small = np.zeros(3, np.float32)
    s = Scaler(1.0)
    for i in range(3):
        small[:] = i  # in place
        s.alpha = 1.0 + i
        for hook in (lambda m, a, out: out + small, lambda m, a, out: s.method(out, "")):
            with net.register_forward_hook(hook):
                out = step(net, X)
            close(out, by_hand(lambda h, n: hook(None, None, h)))  # noqa: B023


def test_a_registered_module_hook_in_a_run_acts_as_it_reads_on_every_call(maybe_jit):
    """Issue 43: a module hook reading `cfg["s"]`, and TransformerLens' counter as a
    permanent hook, kept what they read when registered under run_with_hooks and
    run_with_cache. A run keys them again on every call (a change traces it again).
    Under the user's jit the run is traced once (JAX's rule): the first value."""
    net = Layer(W)
    cfg = {"s": 1.0}
    counter = types.SimpleNamespace(count=0)

    def count(m, a, out):
        counter.count += 1

    runs = (
        maybe_jit(lambda x: jhooks.run_with_hooks(net, x)),
        maybe_jit(lambda x: jhooks.run_with_cache(net, x)[0]),
    )
    with (
        net.register_forward_hook(lambda m, a, out: out * cfg["s"]),
        net.register_forward_hook(count),
    ):
        for i in range(3):
            cfg["s"] = 1.0 + i
            read = 1.0 if maybe_jit is jax.jit else cfg["s"]
            for run in runs:
                close(run(X), jnp.tanh(X @ W) * read)
    assert counter.count == (2 if maybe_jit is jax.jit else 6)


def test_python_numbers_keep_python_arithmetic(maybe_jit):
    a, n = 1 + 1e-9, 100000

    def tiny(h, name):
        return h * ((a - 1.0) * 1e9)  # ~1 in Python, 0 in float32

    def modular(h, name):
        return h * (n * n % 7)  # 4 in Python, 3 in int32

    for hook, factor in ((tiny, (a - 1.0) * 1e9), (modular, 4)):
        for _ in range(2):
            out = maybe_jit(lambda x: jhooks.run_with_hooks(f, W, x, fwd_hooks=[("h", hook)]))(X)  # noqa: B023
            close(out, f(W, X) * factor**2)


def test_a_hook_counts_its_calls_in_the_list_it_closes_over_every_call():
    calls: list = []
    count = [0]

    def counting(h, name):
        calls.append(name)
        count[0] += 1
        return h * 1.5

    TRACES.clear()
    for _ in range(3):
        close(jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", counting)]), by_hand(counting))
    # Once per call, as in PyTorch (by_hand adds one per call); the model is traced at
    # most once (a hook of the same structure may have compiled it already).
    assert len(TRACES) <= 1
    assert count == [3 + 3] and calls == ["h"] * 6


COUNTER = {"n": 0}


def counted(w, x):
    COUNTER["n"] += 1
    return f(w, x) * (1.0 if COUNTER else 0.0)


def test_a_function_that_writes_a_global_dict_it_reads_does_not_retrace():
    expected = by_hand(lambda h, n: None)
    TRACES.clear()
    for _ in range(5):
        close(jhooks.run_with_hooks(counted, W, X, fwd_hooks=[("h", lambda h, n: h)]), expected)
    assert len(TRACES) == 1  # once, as under jax.jit
    assert COUNTER["n"] == 1


def test_numpy_arrays_of_python_objects_are_read_as_python():
    objects = np.array([1.0, "a"], dtype=object)

    def hook(h, name):
        return h * float(objects[0])

    for value in (1.0, 2.5):
        objects[0] = value
        close(jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", hook)]), by_hand(hook))

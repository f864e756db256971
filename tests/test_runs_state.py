"""What a run's function reads outside its arguments, changed between calls (round 5's
breaks, 2026-12-02): never stale.

Each case calls a run three or four times, changing the state between calls as eager
code may, and compares every call with the same function called eagerly, the hook
applied by hand (the oracle). In a jit, the run is traced inline and `jax.jit`'s rule
holds: the oracle there is a fresh `jax.jit` of the by-hand twin, called alike.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import warnings
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

X = jnp.arange(1.0, 4.0)


def double(z, name):
    return z * 2.0


def calls(fn, steps, maybe_jit, *args):
    """`fn(x, *args)` as a run doubling point `h` and as its by-hand twin, after each
    step of `steps` (which changes the state): the pairs of outputs."""
    pairs = []
    for step in steps:
        step()

        def run(x):
            return jhooks.run_with_hooks(fn, x, *args, fwd_hooks=[("h", double)])

        def by_hand(x):  # outside a run, a point is the identity; `h` is the output
            return fn(x, *args) * 2.0

        pairs.append((maybe_jit(run)(X), maybe_jit(by_hand)(X)))
    return pairs


def assert_pairs(pairs):
    for got, want in pairs:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


# Distinct objects equal in content: their class's equality is identity, so is their key


class Token:
    """An object with no attributes: two of them are equal in content, not `==`."""


A, B = Token(), Token()
SCALE = {A: 2.0, B: 3.0}
BY_ID = {id(A): 2.0, id(B): 3.0}
WEAK = weakref.WeakKeyDictionary({A: 2.0, B: 3.0})
ACTIVE = {A}
current = [A]


LOOKUPS = {
    "a dict": lambda g: SCALE[g],
    "id()": lambda g: BY_ID[id(g)],
    "a WeakKeyDictionary": lambda g: WEAK[g],
    "a set": lambda g: 2.0 if g in ACTIVE else 3.0,
}


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("form", ["argument", "global"])
def test_objects_equal_in_content_looked_up_by_identity(maybe_jit, lookup, form):
    scale = LOOKUPS[lookup]

    def model(x, *g):
        return jhooks.hook_point(x * scale(g[0] if g else current[0]), "h")

    seen = []
    for token in (A, B, A, B):
        current[0] = token
        args = (token,) if form == "argument" else ()
        got, want = calls(model, [lambda: None], maybe_jit, *args)[0]
        np.testing.assert_allclose(got, want)
        seen.append(float(got[0]))
    assert seen == [2.0 * scale(A), 2.0 * scale(B)] * 2  # the lookups told them apart


class Scale(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x * self.w


def test_a_registered_hook_looking_an_object_up_by_identity(maybe_jit):
    model = jhooks.hookable(Scale(jnp.float32(1.0)))
    handle = model.register_forward_hook(lambda m, args, out: out * SCALE[current[0]])
    try:
        for token in (A, B, A):
            current[0] = token
            got = maybe_jit(lambda x: jhooks.run_with_cache(model, x)[0])(X)
            np.testing.assert_allclose(got, X * SCALE[token])
    finally:
        handle.remove()


# An entry the model's trace wrote, changed afterwards by the user: read again


class Lazy:
    scale = None

    def __call__(self, x):
        if self.scale is None:
            self.scale = 2.0  # a lazy default, written by the first trace
        return jhooks.hook_point(x * self.scale, "h")


def test_a_lazy_default_the_trace_wrote_then_the_user_set(maybe_jit):
    lazy = Lazy()
    if maybe_jit is not jax.jit:
        assert_pairs(calls(lambda x: lazy(x), [lambda: None], maybe_jit))
    steps = [lambda: setattr(lazy, "scale", 5.0), lambda: None, lambda: delattr(lazy, "scale")]
    pairs = calls(lambda x: lazy(x), steps, maybe_jit)
    assert_pairs(pairs)
    assert [float(got[0]) for got, _ in pairs] == [10.0, 10.0, 4.0]


def test_a_memo_the_trace_filled_then_the_user_changed_or_emptied(maybe_jit):
    memo: dict = {}

    def model(x):
        if "k" not in memo:
            memo["k"] = 2.0
        return jhooks.hook_point(x * memo["k"], "h")

    steps = [lambda: None, lambda: memo.update(k=5.0), lambda: None, memo.clear]
    pairs = calls(model, steps, maybe_jit)
    assert_pairs(pairs)
    assert [float(got[0]) for got, _ in pairs] == [4.0, 10.0, 10.0, 4.0]


def test_a_list_the_trace_appended_to_then_the_user_cleared(maybe_jit):
    log: list = []

    def model(x):
        log.append("called")
        return jhooks.hook_point(x * len(log), "h")

    pairs = []
    for _ in range(3):
        log.clear()  # eager code then appends once: len(log) == 1
        pairs.append(calls(model, [lambda: None], maybe_jit)[0])
        log.clear()
    for got, _ in pairs:
        np.testing.assert_allclose(got, X * 2.0)


def test_a_counter_the_trace_writes_is_still_once_per_trace():
    """JAX's rule for the model's own side effects, kept: a counter the model's trace
    increments, untouched by the user, counts traces, and the warm calls reuse the
    program."""

    class Counter:
        n = 0

    counter = Counter()

    def model(x):
        counter.n += 1
        return jhooks.hook_point(x * 3.0, "h")

    for _ in range(4):
        out = jhooks.run_with_hooks(model, X, fwd_hooks=[("h", double)])
        np.testing.assert_allclose(out, X * 6.0)
    assert counter.n == 1
    counter.n = 0  # the user resets it: read again, traced again, written once more
    jhooks.run_with_hooks(model, X, fwd_hooks=[("h", double)])
    assert counter.n == 1


# Library objects whose state a model reads


def steps_of(*changes):
    return [lambda: None, *changes]


def test_an_iterator_the_model_consumes_runs_every_call(maybe_jit):
    counter = itertools.count(1)
    numbers = iter([1.0, 2.0, 3.0])

    def model(x):
        return jhooks.hook_point(x * next(counter) * next(numbers), "h")

    seen = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            seen.append(
                float(
                    maybe_jit(lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("h", double)]))(
                        X
                    )[0]
                )
            )
    assert seen == [2.0 * 1 * 1, 2.0 * 2 * 2, 2.0 * 3 * 3]  # eager's: every call advances
    if maybe_jit is not jax.jit:
        messages = [str(w.message) for w in said]
        assert any("closure variable `counter` (count)" in m for m in messages), messages
        assert any("traced again on every call" in m for m in messages), messages


STATE = {
    "threading.Event": (threading.Event, lambda e: 2.0 if e.is_set() else 1.0, lambda e: e.set()),
    "bytearray": (lambda: bytearray(b"\x01"), lambda b: b[0], lambda b: b.__setitem__(0, 3)),
    "memoryview": (
        lambda: memoryview(np.ones(1, np.float32)),
        lambda m: float(np.frombuffer(m, np.float32)[0]),
        lambda m: np.frombuffer(m, np.float32).__setitem__(0, 3.0),
    ),
    "a defaultdict's factory": (
        lambda: collections.defaultdict(lambda: 1.0),
        lambda d: d["missing"],  # the first trace writes the factory's value there
        lambda d: (d.clear(), setattr(d, "default_factory", lambda: 3.0)),
    ),
    "a masked array's mask": (
        lambda: np.ma.masked_array([2.0, 5.0], mask=[False, True]),
        lambda a: float(a.sum()),
        lambda a: a.mask.__setitem__(1, False),
    ),
    "a NumPy array of strings": (
        lambda: np.array(["a", "bb"]),
        lambda a: float(len(a[1])),
        lambda a: a.__setitem__(1, "c"),
    ),
}


@pytest.mark.parametrize("kind", STATE)
def test_library_state_the_model_reads_changed_in_place(maybe_jit, kind):
    make, read, change = STATE[kind]
    obj = make()

    def model(x):
        return jhooks.hook_point(x * read(obj), "h")

    before = read(obj)
    pairs = calls(model, steps_of(lambda: None, lambda: change(obj), lambda: None), maybe_jit)
    assert_pairs(pairs)
    after = float(pairs[-1][0][0]) / float(X[0]) / 2.0
    assert before != after  # the change was seen: not the first value again


def test_eval_reads_what_it_names_every_call(maybe_jit):
    namespace = {"s": 1.0}

    def model(x):
        return jhooks.hook_point(x * eval("s", namespace), "h")

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        pairs = calls(model, steps_of(lambda: namespace.update(s=3.0)), maybe_jit)
    assert_pairs(pairs)
    assert [float(got[0]) for got, _ in pairs] == [2.0, 6.0]
    if maybe_jit is not jax.jit:
        assert any("eval" in str(w.message) for w in said)


def test_a_numpy_array_of_objects_read_is_never_cached(maybe_jit):
    boxes = np.array([1.0, None], dtype=object)

    def model(x):
        return jhooks.hook_point(x * boxes[0], "h")

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        pairs = calls(model, steps_of(lambda: boxes.__setitem__(0, 4.0)), maybe_jit)
    assert_pairs(pairs)
    assert [float(got[0]) for got, _ in pairs] == [2.0, 8.0]
    if maybe_jit is not jax.jit:
        assert any("a NumPy array of Python objects" in str(w.message) for w in said)


def test_a_fresh_object_compared_by_identity_each_call_is_told_once():
    """Keyed by identity, an object made afresh for each call traces again each call
    (never stale); the second such trace says so, naming it and the way out. A frozen
    dataclass (equality by content) made afresh shares one program."""

    class Settings:
        def __init__(self):
            self.scale = 2.0

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        scale: float = 2.0

    traces = []
    holder: dict = {}

    def model(x):
        traces.append(1)
        return jhooks.hook_point(x * holder["settings"].scale, "h")

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            holder["settings"] = Settings()
            out = jhooks.run_with_hooks(model, X, fwd_hooks=[("h", double)])
            np.testing.assert_allclose(out, X * 4.0)
    assert len(traces) == 3
    told = [str(w.message) for w in said if "traced and compiled again" in str(w.message)]
    assert len(told) == 1, told
    assert "an object whose class compares by identity" in told[0]
    assert "model: closure variable `holder`)" in told[0], told[0]
    assert "give its class an `__eq__` and `__hash__`" in told[0]

    traces.clear()
    for _ in range(3):
        holder["settings"] = Frozen()
        out = jhooks.run_with_hooks(model, X, fwd_hooks=[("h", double)])
        np.testing.assert_allclose(out, X * 4.0)
    assert len(traces) == 1


def test_a_written_attribute_deleted_on_an_object_whose_getattr_raises(maybe_jit):
    """What the trace left in an attribute is read again through `getattr`: an object's
    `__getattr__` that raises `KeyError` for a missing name (a config over a dict) must
    read as 'not there', not fail the run."""

    class Config:
        def __init__(self):
            self.store = {}

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self.store[name]  # KeyError for a name it does not hold

    cfg = Config()

    def model(x):
        try:
            scale = cfg.scale
        except KeyError:
            scale = cfg.scale = 2.0  # a lazy default, written by the first trace
        return jhooks.hook_point(x * scale, "h")

    steps = [lambda: None, lambda: setattr(cfg, "scale", 5.0), lambda: delattr(cfg, "scale")]
    pairs = calls(model, steps, maybe_jit)
    assert_pairs(pairs)
    assert [float(got[0]) for got, _ in pairs] == [4.0, 10.0, 4.0]


def test_a_counter_the_trace_uses_and_the_user_sets_runs_the_new_trace_after():
    """A counter the model's trace increments and computes with: JAX's rule, one trace,
    until the user sets it; then one trace more, whose program the later calls run (they
    ran the first trace's program again, x * 1 after x * 11)."""

    class Counter:
        def __init__(self):
            self.n = 0

        def __call__(self, x):
            self.n += 1
            return jhooks.hook_point(x * self.n, "h")

    counter = Counter()
    seen = [
        float(jhooks.run_with_hooks(counter, X, fwd_hooks=[("h", double)])[0]) for _ in range(3)
    ]
    assert seen == [2.0, 2.0, 2.0] and counter.n == 1
    counter.n = 10
    seen = [
        float(jhooks.run_with_hooks(counter, X, fwd_hooks=[("h", double)])[0]) for _ in range(3)
    ]
    assert seen == [22.0, 22.0, 22.0] and counter.n == 11


def test_a_lazy_default_set_by_the_user_beside_a_counter_the_trace_writes(maybe_jit):
    """Two entries the trace wrote (a trace counter and a lazy default): the user's new
    default was used once, then the first program (the old default) came back. Under
    the user's jit, `jax.jit`'s rule: its cache of `run` holds the first trace."""

    class Lazy:
        def __init__(self):
            self.scale = None
            self.traces = 0

        def __call__(self, x):
            self.traces += 1
            if self.scale is None:
                self.scale = 2.0
            return jhooks.hook_point(x * self.scale, "h")

    lazy = Lazy()

    def run(x):
        return jhooks.run_with_hooks(lazy, x, fwd_hooks=[("h", double)])

    seen = [float(maybe_jit(run)(X)[0])]
    lazy.scale = 4.0
    seen += [float(maybe_jit(run)(X)[0]) for _ in range(3)]
    if maybe_jit is jax.jit:
        assert seen == [4.0] * 4 and lazy.traces == 1  # as plain jax.jit of `run`
        return
    assert seen == [4.0, 8.0, 8.0, 8.0] and lazy.traces == 2  # eager code's: 2 * x * scale


def test_an_iterator_or_the_time_module_the_run_never_advances_is_cached():
    """What the walk reaches but the code cannot advance stays cached: an iterator held
    on the object (no walked code names `next`) and `time` used in `__init__` only (a
    trainer's start time). Each made every call trace again."""

    class Trainer:
        def __init__(self):
            self.started = time.time()
            self.batches = iter(range(3))
            self.traces = 0

        def forward(self, x):
            self.traces += 1
            return jhooks.hook_point(x * 2.0, "h")

    trainer = Trainer()
    for _ in range(5):
        out = jhooks.run_with_hooks(trainer.forward, X, fwd_hooks=[("h", double)])
        np.testing.assert_allclose(out, X * 4.0)
    assert trainer.traces == 1

"""A warm run's fast path (issue 26): the guards of its last walk, checked again, select
its program; every change of what the hook read is followed, in place or reassigned.

The oracle is the hook applied by hand, eagerly, after each change; each test runs the
run eagerly and inside `jax.jit` (where it is traced inline, once per trace of the
user's function).
"""

import collections
import functools
import gc
import weakref

import jax
import numpy as np
from test_runs_reads import TABLE_TRACES as TRACES
from test_runs_reads import W, X, by_hand, close
from test_runs_reads import counted as f

import jhooks


def run(maybe_jit, hook, x=X):
    return maybe_jit(lambda w, x: jhooks.run_with_hooks(f, w, x, fwd_hooks=[("h", hook)]))(W, x)


def test_an_in_place_change_to_a_numpy_array_the_hook_read_is_followed(maybe_jit):
    arrays = [np.full(3, float(i), np.float32) for i in range(100)]

    def hook(h, name):
        return h + arrays[3]

    TRACES.clear()
    for i in range(6):  # warm from the third call: the device copy is compared, not kept
        arrays[3][0] = 10.0 + i  # read: in place
        arrays[7][:] = -1.0 - i  # not read
        close(run(maybe_jit, hook), by_hand(hook))
    arrays[3] = np.full(3, -4.0, np.float32)  # read: replaced
    close(run(maybe_jit, hook), by_hand(hook))
    arrays[3].shape = (1, 3)  # read: reshaped in place
    close(run(maybe_jit, hook), by_hand(hook))
    arrays[3] = arrays[3].reshape(3)
    close(run(maybe_jit, hook, x=2 * X), by_hand(hook, x=2 * X))  # a new argument
    if maybe_jit is jax.jit:
        return
    # Traced while what it reads of the list was learned, and for the new shape.
    assert len(TRACES) <= 4


def test_a_warm_call_follows_each_kind_of_change_of_what_it_read(maybe_jit):
    state = {"scale": 1.0, "mode": "mul"}
    box = [2.0]

    class Scaler:
        shift = 0.0

        def __init__(self):
            self.factor = 1.0

        def __call__(self, h, name):
            out = h * self.factor * state["scale"] * box[0] + Scaler.shift
            return out if state["mode"] == "mul" else -out

    hook = Scaler()
    changes = [
        lambda: setattr(hook, "factor", 3.0),
        lambda: state.__setitem__("scale", 0.5),
        lambda: state.__setitem__("mode", "neg"),
        lambda: box.__setitem__(0, -1.0),
        lambda: setattr(Scaler, "shift", 0.25),
        lambda: state.update({"mode": "mul", "scale": -0.0}),
    ]
    close(run(maybe_jit, hook), by_hand(hook))
    for change in changes:
        change()
        for _ in range(2):  # the first call after a change walks; the second is warm
            close(run(maybe_jit, hook), by_hand(hook))


def test_a_bound_method_hook_taken_again_each_call_finds_its_program(maybe_jit):
    class Counter:
        def __init__(self):
            self.scale = 2.0

        def hook(self, h, name):
            return h * self.scale

    counter = Counter()
    TRACES.clear()
    for i in range(4):
        counter.scale = 2.0 if i < 2 else 3.0
        close(run(maybe_jit, counter.hook), by_hand(counter.hook))
    if maybe_jit is not jax.jit:
        assert len(TRACES) <= 3  # 2.0, 3.0 (and once more as a traced number)


def test_keys_of_a_dict_are_guarded_not_only_its_values(maybe_jit):
    table = {"a": "x", "b": "y"}

    def hook(h, name):
        return h * (2.0 if table["a"] == "x" else 3.0)

    close(run(maybe_jit, hook), by_hand(hook))
    table.clear()
    table.update({"b": "x", "a": "y"})  # the same values, under the other keys
    close(run(maybe_jit, hook), by_hand(hook))
    hook2 = functools.partial(lambda h, name, k: h * k, k=2.0)
    close(run(maybe_jit, hook2), by_hand(hook2))
    hook2.keywords["k"] = 5.0  # a partial's keywords, changed in place
    close(run(maybe_jit, hook2), by_hand(hook2))


# 9. Classes and namedtuples defined per call: keyed by what they hold, not who they are.
def test_a_class_defined_per_call_compiles_once_per_content(maybe_jit):
    TRACES.clear()
    for i in range(6):

        class Scale:
            factor = 2.0 if i < 3 else 3.0  # the class's content changes once

            def __call__(self, h, name):
                return h * self.factor

        hook = Scale()
        close(run(maybe_jit, hook), by_hand(hook))
    if maybe_jit is not jax.jit:
        assert len(TRACES) <= 3  # 2.0, 3.0 (and once more as a traced number)


def test_a_namedtuple_defined_per_call_compiles_once_per_content(maybe_jit):
    TRACES.clear()
    for i in range(6):
        Settings = collections.namedtuple("Settings", ["scale", "mode"])
        settings = Settings(2.0, "mul" if i < 3 else "neg")

        def hook(h, name, settings=settings):
            return h * settings.scale if settings.mode == "mul" else -h

        close(run(maybe_jit, hook), by_hand(hook))
    if maybe_jit is not jax.jit:
        assert len(TRACES) <= 2


def test_classes_equal_in_content_but_not_the_same_keep_isinstance_right(maybe_jit):
    def make():
        class Tag:
            pass

        return Tag

    first, second = make(), make()
    for cls in (first, second, first):
        obj = first()

        def hook(h, name, obj=obj, cls=cls):
            return h * (2.0 if isinstance(obj, cls) else 3.0)

        close(run(maybe_jit, hook), by_hand(hook))


def test_a_warm_run_keeps_neither_its_hook_nor_its_function_alive():
    class Hook:
        def __call__(self, h, name):
            return h * 2.0

    def fn(w, x):
        return f(w, x)

    hook = Hook()
    refs = [weakref.ref(hook), weakref.ref(fn)]
    for _ in range(3):  # the second and third calls are warm
        jhooks.run_with_hooks(fn, W, X, fwd_hooks=[("h", hook)])
    del hook, fn
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_sweep_over_a_number_follows_every_value_on_the_fast_path(maybe_jit):
    knob = {"scale": 0.5}
    offsets = [0.0]

    def hook(h, name):
        return h * knob["scale"] + offsets[0]

    TRACES.clear()
    for i in range(6):
        knob["scale"] = 0.5 + i  # traced from its second value on
        offsets[0] = float(i % 2)
        close(run(maybe_jit, hook), by_hand(hook))
        close(run(maybe_jit, hook), by_hand(hook))  # warm
    if maybe_jit is not jax.jit:
        assert len(TRACES) <= 5

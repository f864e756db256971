"""An object of the user's class is keyed by the attributes traces read of it (issue 26,
break 9): a bound-method hook whose `self` collects results between calls compiles once,
and every attribute the hook reads, however it reads it, is still followed.

The oracle is the hook applied by hand, eagerly, after each change; each test runs the
run eagerly and inside `jax.jit` (where it is traced inline, once per trace of the
user's function).
"""

import copy
import dataclasses
import enum
import pickle
import warnings

import jax
import numpy as np
import pytest
from test_runs_reads import TABLE_TRACES as TRACES
from test_runs_reads import W, X, by_hand, close
from test_runs_reads import counted as f

import jhooks


def run(maybe_jit, hook, x=X):
    return maybe_jit(lambda w, x: jhooks.run_with_hooks(f, w, x, fwd_hooks=[("h", hook)]))(W, x)


class Collector:
    def __init__(self):
        self.scale = 2.0
        self.results = []
        self.log = {}

    def hook(self, h, name):
        return h * self.scale


def test_a_bound_method_whose_self_collects_results_compiles_once(maybe_jit):
    probe = Collector()
    TRACES.clear()
    for i in range(8):
        out = run(maybe_jit, probe.hook)
        close(out, by_hand(probe.hook))
        probe.results.append(out)  # arrays, one more each call: not read by the hook
        probe.log[i] = np.asarray(out)
    if maybe_jit is not jax.jit:
        assert len(TRACES) <= 1  # a hook of the same structure may have compiled it
    for scale in (3.0, -0.5, 3.0):  # what the hook reads is still followed
        probe.scale = scale
        close(run(maybe_jit, probe.hook), by_hand(probe.hook))
        probe.results.append(0)


class Branchy:
    def __init__(self):
        self.scale = 1.0
        self.mode = "add"
        self.bias = np.ones(3, np.float32)
        self.unread = []

    def hook(self, h, name):
        if self.scale > 5:  # `mode` and `bias` are read only on this branch
            return h + self.bias if self.mode == "add" else h - self.bias
        return h * self.scale


def test_an_attribute_read_only_on_a_later_branch_is_followed(maybe_jit):
    probe = Branchy()
    changes = [
        lambda: setattr(probe, "mode", "sub"),  # not read yet: no new program needed
        lambda: setattr(probe, "scale", 6.0),  # the branch that reads mode and bias
        lambda: setattr(probe, "mode", "add"),
        lambda: probe.bias.__setitem__(0, -4.0),  # in place
        lambda: setattr(probe, "bias", np.full(3, 0.25, np.float32)),
        lambda: setattr(probe, "mode", "sub"),
        lambda: setattr(probe, "scale", 2.0),
        lambda: setattr(probe, "scale", 7.0),
    ]
    close(run(maybe_jit, probe.hook), by_hand(probe.hook))
    for change in changes:
        change()
        probe.unread.append(len(probe.unread))
        for _ in range(2):  # the first call after a change walks; the second is warm
            close(run(maybe_jit, probe.hook), by_hand(probe.hook))


class Computed:
    def __init__(self):
        self.which = "a"
        self.a = 2.0
        self.b = 3.0
        self.extra = []

    def __call__(self, h, name):
        return h * getattr(self, self.which)


def test_attributes_read_by_computed_name_are_followed(maybe_jit):
    hook = Computed()
    close(run(maybe_jit, hook), by_hand(hook))
    for change in (("b", 4.0), ("which", "b"), ("a", 5.0), ("b", -1.0), ("which", "a")):
        setattr(hook, *change)
        hook.extra.append(0)
        close(run(maybe_jit, hook), by_hand(hook))


@dataclasses.dataclass
class Settings:
    scale: float = 2.0
    shift: float = 0.0
    notes: list = dataclasses.field(default_factory=list)


def test_reads_of_the_whole_object_key_all_of_it(maybe_jit):
    """`vars`, `dataclasses.asdict`, `copy.copy`, `pickle` and `repr` read every attribute;
    `copy` and `pickle` make an object of the user's class."""
    settings = Settings()
    hooks = [
        lambda h, n: h * sum(v for k, v in vars(settings).items() if k != "notes"),
        lambda h, n: h * dataclasses.asdict(settings)["shift"] + settings.scale,
        lambda h, n: h * copy.copy(settings).shift + 1.0,
        lambda h, n: h * (2.0 if "notes=[]" in repr(settings) else 3.0),
        lambda h, n: h * pickle.loads(pickle.dumps(settings)).shift - 1.0,
        lambda h, n: h * (1.0 if type(copy.copy(settings)) is Settings else 0.0) * settings.shift,
    ]
    for hook in hooks:
        for i in range(3):
            settings.shift = float(i)
            close(run(maybe_jit, hook), by_hand(hook))
        settings.notes.append(1)
        close(run(maybe_jit, hook), by_hand(hook))
        settings.notes.clear()


class Base:
    def factor(self):
        return self.scale


class Child(Base):
    def __init__(self):
        self.scale = 2.0
        self.history = []

    def __call__(self, h, name):
        assert isinstance(self, Child) and self.__class__ is Child
        same = dataclasses.is_dataclass(self) or type(self).__name__ == "Child"
        return h * super().factor() * (1.0 if same else 0.0)


def test_the_copy_a_trace_gets_is_still_an_instance_of_its_class(maybe_jit):
    hook = Child()
    for i in range(3):
        hook.scale = 2.0 + i
        hook.history.append(i)
        close(run(maybe_jit, hook), by_hand(hook))


class Marker:
    def __init__(self):
        self.history = []

    def hook(self, h, name):
        if hasattr(self, "bias"):
            return h + self.bias
        return h


def test_an_attribute_added_after_the_trace_read_its_absence_is_followed(maybe_jit):
    probe = Marker()
    close(run(maybe_jit, probe.hook), by_hand(probe.hook))
    probe.history.append(1)
    probe.bias = 5.0
    close(run(maybe_jit, probe.hook), by_hand(probe.hook))
    probe.bias = -1.0
    close(run(maybe_jit, probe.hook), by_hand(probe.hook))
    del probe.bias
    close(run(maybe_jit, probe.hook), by_hand(probe.hook))


class Tally:
    def __init__(self):
        self.seen = None
        self.unread = []

    def hook(self, h, name):
        self.seen = "traced"  # written, never read
        return h


def test_an_attribute_only_written_still_reaches_each_fresh_object(maybe_jit):
    """TransformerLens' counters, written and not read: every fresh object is written."""
    for i in range(3):
        probe = Tally()
        probe.unread.append(i)
        run(maybe_jit, probe.hook)
        assert probe.seen == "traced"


class Layout:
    __slots__ = ("scale", "results")

    def __init__(self):
        self.scale = 2.0
        self.results = []

    def __call__(self, h, name):
        return h * self.scale


def test_a_class_with_slots_is_keyed_by_what_is_read(maybe_jit):
    hook = Layout()
    TRACES.clear()
    for i in range(5):
        hook.results.append(i)
        close(run(maybe_jit, hook), by_hand(hook))
    if maybe_jit is not jax.jit:
        assert len(TRACES) <= 1  # a hook of the same structure may have compiled it
    hook.scale = 4.0
    close(run(maybe_jit, hook), by_hand(hook))


class Keeper:
    def __init__(self):
        self.kept = []

    def hook(self, h, name):
        self.kept.append(h)  # PyTorch's habit: keep the activation
        return h


def test_a_value_kept_in_the_users_object_is_concrete_or_named(maybe_jit):
    keeper = Keeper()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        close(run(maybe_jit, keeper.hook), by_hand(Keeper().hook))
    # Under the user's jit, only the note that a hook with side effects runs once per
    # compilation (tests/test_runs_values.py tests it).
    caught = [w for w in caught if "once per compilation" not in str(w.message)]
    assert len(keeper.kept) == 1 and caught == []
    if maybe_jit is jax.jit:
        # Traced inline in the user's jit: JAX's own rules (a tracer of that trace).
        assert isinstance(keeper.kept[0], jax.core.Tracer)
        return
    # As in PyTorch: the activation itself, after the call.
    close(keeper.kept[0], jax.numpy.tanh(X @ W))
    # Under the user's own vmap the program cannot give it back: named, every call.
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.vmap(lambda x: run(maybe_jit, keeper.hook, x))(X[None])
        leaks = [str(w.message) for w in caught if "leaked tracer" in str(w.message)]
        assert len(leaks) == 1
        assert "hook Keeper.hook at point 'h'" in leaks[0] and "Keeper.kept" in leaks[0]
        assert "jhooks.run_with_cache, jhooks.emit or jhooks.host" in leaks[0]
        assert caught[0].filename == __file__


class Sneaky:
    def __init__(self):
        self.scale = 2.0
        self.history = []

    def hook(self, h, name):
        return h * object.__getattribute__(self, "scale")  # past the record


def test_an_object_read_past_the_record_is_keyed_whole(maybe_jit):
    probe = Sneaky()
    for i in range(4):
        probe.scale = 2.0 + i
        probe.history.append(i)
        close(run(maybe_jit, probe.hook), by_hand(probe.hook))


class Mode(enum.Enum):
    ONE = 1.0
    TWO = 2.0


class CopiesItself:
    """A class whose `__copy__` returns the object itself."""

    def __init__(self, k):
        self.k = k

    def __copy__(self):
        return self


def test_the_models_enum_and_self_copying_objects_are_read_never_rewritten(maybe_jit):
    """Issue 43: an enum member the model reads got a tracer in `_value_` for good once
    its members were switched, and an object whose `__copy__` returns itself got its
    class replaced for good. jhooks gives a trace no copy of them: they are keyed by
    content, and left as they are. The oracle: plain `jax.jit` of the function with
    the hook applied by hand (a fresh jit per value: what a run's key tells apart)."""
    state = {"mode": Mode.ONE}
    box = CopiesItself(2.0)

    def model(x):
        return jhooks.hook_point(x * state["mode"].value * box.k, "p")

    def plus_one(z, name):
        return z + 1.0

    for mode, k in [(Mode.ONE, 2.0), (Mode.TWO, 2.0), (Mode.ONE, 3.0), (Mode.TWO, 5.0)]:
        state["mode"], box.k = mode, k
        out = maybe_jit(lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("p", plus_one)]))(X)
        close(out, jax.jit(lambda x: plus_one(model(x), "p"))(X))
        assert type(Mode.ONE._value_) is float and type(Mode.TWO._value_) is float
        assert Mode.ONE.value == 1.0 and Mode.TWO.value == 2.0
        assert type(box) is CopiesItself and type(box.k) is float


def test_a_traced_value_the_model_writes_in_its_own_dict_is_taken_back():
    """Issue 43: a memo dict the model fills (`memo["k"] = src["s"] * 2`, `src["s"]` a
    number that changes, so traced) held a tracer for good. The model's own writes
    happen once per trace (JAX's rule); a traced value written there is taken out
    again, with a warning naming it: the dict holds a concrete value or nothing.

    Since the trace runs on the user's objects (issue 43), a number read outside the
    arguments (`src["s"]`) is keyed by value, not traced once it changes: each value is
    a trace of its own, which writes its own concrete `memo["k"]`. The traced value
    written is `memo["t"]`, made from the argument `x`."""
    src, memo = {"s": 1.0}, {}

    def model(x):
        memo["k"] = src["s"] * 2
        memo["t"] = x[0] * 2
        return jhooks.hook_point(x * src["s"], "p")

    said = []
    for s in (1.0, 2.0, 3.0, 4.0):
        src["s"] = s
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = jhooks.run_with_hooks(model, X, fwd_hooks=[("p", lambda z, n: z + 1.0)])
        close(out, X * s + 1.0)
        assert all(not isinstance(v, jax.core.Tracer) for v in memo.values()), memo
        assert memo["k"] == 2 * s and "t" not in memo, memo  # this value's trace wrote it
        said += [str(w.message) for w in caught if "'t'" in str(w.message)]
    assert said and all("put back what was there" in m for m in said), said


def test_a_kept_value_is_named_without_a_search_of_the_heap(monkeypatch):
    """Issue 43: naming where a hook kept a value the program cannot give back searched
    the heap (`gc.get_referrers`, 193-605 ms a call with a large heap). It is named
    from what the hook's own code reaches: its `self`, closure variables and globals."""
    import gc

    def searched(*objects):
        raise AssertionError("gc.get_referrers was called")

    monkeypatch.setattr(gc, "get_referrers", searched)
    keeper, kept = Keeper(), []

    def closure_hook(h, name):
        kept.append(h)

    for hook, place in [(keeper.hook, "Keeper.kept (a list)"), (closure_hook, "`kept` (a list)")]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.vmap(lambda x: run(lambda f: f, hook, x))(X[None])  # noqa: B023
        leaks = [str(w.message) for w in caught if "leaked tracer" in str(w.message)]
        assert len(leaks) == 1 and place in leaks[0], leaks


# A module of its own, run in a fresh process, whose globals the walk reads.
LAZY_SINGLETON = """
import enum
import jax.numpy as jnp
import jhooks


class Mode(enum.Enum):
    A = 1.0
    B = 2.0


class Single:
    _inst = None

    def __new__(cls):  # made on first use, inside the first trace
        if cls._inst is None:
            cls._inst = super().__new__(cls)
            cls._inst.w = jnp.float32(3.0)
        return cls._inst


state = {"mode": Mode.A}


def model(x):
    w = Single().w  # made before the mode is read (read first, the mode is seen)
    return jhooks.hook_point(x * state["mode"].value * w, "a")


for m in (Mode.A, Mode.B, Mode.A):
    state["mode"] = m
    out = jhooks.run_with_hooks(model, jnp.ones(1), fwd_hooks=[("a", lambda z, n: None)])
    print(float(out[0]))
"""


def test_a_singleton_made_lazily_in_the_first_trace_leaves_other_globals_read(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "lazy_singleton.py"
    script.write_text(LAZY_SINGLETON)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True
    )
    printed = [float(v) for v in done.stdout.split()]
    assert printed == [1.0 * 3.0, 2.0 * 3.0, 1.0 * 3.0]  # by hand: the mode's value times w


class _MadeInTheTrace:
    _inst = None

    def __new__(cls):  # made on first use, inside the model's first trace
        if cls._inst is None:
            cls._inst = super().__new__(cls)
            cls._inst.w = jax.numpy.float32(3.0)
        return cls._inst


def test_an_object_made_in_the_first_trace_holds_no_tracer_afterwards():
    def model(x):
        return jhooks.hook_point(x * _MadeInTheTrace().w, "a")

    for _ in range(2):
        out = jhooks.run_with_hooks(model, jax.numpy.ones(3), fwd_hooks=[("a", lambda z, n: None)])
        np.testing.assert_allclose(out, np.full(3, 3.0))
    assert not isinstance(_MadeInTheTrace().w, jax.core.Tracer)


def plus_one(z, name):
    return z + 1.0


def _lazy_singleton():
    """A fresh lazy singleton, made on first use inside the first trace, holding a
    Python number (no traced value)."""

    class Single:
        _inst = None

        def __new__(cls):
            if cls._inst is None:
                cls._inst = super().__new__(cls)
                cls._inst.k = 3.0
            return cls._inst

    return Single


def test_an_object_the_trace_makes_early_in_the_walk_leaves_later_reads_keyed(maybe_jit):
    """The root cause of the stale run above, in one process: the walks before and after
    a trace compared each entry by its deep key, whose back-references are numbered in
    the walk's order. An object the trace made, read before the mode (`Single` is the
    function's first closure variable), renumbered them in every entry walked after it,
    which then read as written by the trace: out of the key for good, the mode's change
    unseen. An entry is compared by its own value now. The oracle: by hand."""
    Single, traces = _lazy_singleton(), []
    state = {"mode": Mode.ONE}

    def model(x):
        traces.append(1)
        k = Single().k
        return jhooks.hook_point(x * state["mode"].value * k, "a")

    for mode in (Mode.ONE, Mode.TWO, Mode.ONE):
        state["mode"] = mode
        out = maybe_jit(lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("a", plus_one)]))(X)
        close(out, X * mode.value * 3.0 + 1.0)
    assert maybe_jit is jax.jit or len(traces) == 2  # eager: the first program again


def test_a_write_deep_inside_a_dict_leaves_the_entries_on_the_way_read(maybe_jit):
    """A write inside a dict held by others (`cfg["run"]["memo"]["k"] = ...`) is the
    innermost dict's: it made every entry on the way to it (`cfg`'s `"run"`, that dict's
    `"memo"`) read as written, out of the key: `cfg["run"]` was no longer read, and
    `cfg["run"]["scale"]`'s changes went unseen (the first value, silently)."""
    cfg = {"run": {"memo": {}, "scale": 2.0}}

    def model(x):
        cfg["run"]["memo"]["k"] = cfg["run"]["scale"] * 2
        return jhooks.hook_point(x * cfg["run"]["scale"], "a")

    for scale in (2.0, 3.0, 4.0, 3.0):
        cfg["run"]["scale"] = scale
        out = maybe_jit(lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("a", plus_one)]))(X)
        close(out, X * scale + 1.0)
        assert type(cfg["run"]["memo"]["k"]) is float


def test_a_traced_value_left_anywhere_is_its_concrete_value_or_taken_out():
    """A traced value the trace leaves in the user's objects, in an object it made (a
    singleton made lazily), a class attribute or a list: one the program computed from
    constants alone is the same on every call, and is its concrete value afterwards, as
    eager code leaves it; one computed from the arguments is taken out, with a warning
    naming the place. The oracle: the same values computed eagerly."""
    log: list = []

    class Lazy:
        _inst = None
        table = None

        def __new__(cls, x):
            if cls._inst is None:
                cls._inst = super().__new__(cls)
                cls._inst.w = jax.numpy.zeros(3) * 2 + W[0]
                cls._inst.first = x[0] * 2  # from the argument
                cls.table = jax.random.normal(jax.random.key(0), (2,))
            return cls._inst

    def model(x):
        log.append(jax.numpy.float32(5.0))
        log.append(x[0])
        return jhooks.hook_point(x * Lazy(x).w, "a")

    with pytest.warns(UserWarning, match="the trace wrote a traced value in") as caught:
        out = jhooks.run_with_hooks(model, X, fwd_hooks=[("a", plus_one)])
    said = " ".join(str(w.message) for w in caught)
    assert "a list (1 item left)" in said and "the attribute 'first' of a Lazy" in said, said
    close(out, X * W[0] + 1.0)
    close(jhooks.run_with_hooks(model, X, fwd_hooks=[("a", plus_one)]), X * W[0] + 1.0)
    inst = Lazy._inst
    assert not hasattr(inst, "first") and len(log) == 1  # once per trace: one trace
    for value, eager in [(inst.w, W[0]), (Lazy.table, jax.random.normal(jax.random.key(0), (2,)))]:
        assert isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
        close(value, eager)
    assert float(log[0]) == 5.0 and not isinstance(log[0], jax.core.Tracer)


def _is_traced(value):
    return any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(value))


class FailedHolder:
    last = None


def test_a_call_that_raises_takes_back_what_its_trace_wrote():
    """Break r4: a function that raised after writing a traced value (`s.last = y`, a
    list append) left a tracer in the user's object; only a trace that ended took them
    back. Now the failed call's writes are taken back too: a value computed from
    constants alone is its concrete value, as eager code leaves it; any other is taken
    out (what was there before put back), with a warning naming the place."""
    s, log = FailedHolder(), []
    s.last = "before"

    def model(x):
        y = x * 2
        s.last = y
        log.append(jax.numpy.arange(3.0) * 2)  # from constants alone
        log.append(y)
        raise ValueError("late")

    with pytest.warns(UserWarning, match="the attribute 'last' of a FailedHolder"):
        with pytest.raises(ValueError, match="late"):
            jhooks.run_with_hooks(model, X)
    assert s.last == "before" and len(log) == 1 and not _is_traced(log), (s.last, log)
    close(log[0], jax.numpy.arange(3.0) * 2)


def test_a_value_a_hook_kept_in_a_differentiated_run_that_raises_is_taken_out():
    """Break r4: a forward hook's `store["z"] = z` under `jax.grad`, the model raising
    after it, left the hook's tracer in `store`. The run failed, so it has no value:
    taken out, with the warning naming the place (and saying so)."""
    store = {"z": "before"}
    fail = {"now": True}

    def model(x):
        out = jhooks.hook_point(jax.numpy.tanh(x @ W), "h")
        if fail["now"]:
            raise ValueError("model late")
        return out

    def keep_z(z, name):
        store["z"] = z

    def loss(x):
        return jhooks.run_with_hooks(model, x, fwd_hooks=[("h", keep_z)]).sum()

    with pytest.warns(UserWarning, match=r"closure variable `store` \(a dict\).*took it out"):
        with pytest.raises(ValueError, match="model late"):
            jax.grad(loss)(X)
    assert "z" not in store and not _is_traced(store), store
    fail["now"] = False
    close(jax.grad(loss)(X), jax.grad(lambda x: jax.numpy.tanh(x @ W).sum())(X))
    close(store["z"], jax.numpy.tanh(X @ W))  # given the concrete forward value
    assert not _is_traced(store)


class TupleHolder:
    pass


def test_a_traced_value_inside_a_tuple_a_deque_or_a_cell_is_taken_back():
    """Break r5: a tracer inside a tuple in an attribute (`h.v = (y,)`), in a list of
    tuples, in a deque, or in the function's own nonlocal cell was not taken back. Every
    holder the walk reads is looked into, and a tuple there is made again around the
    concrete value (computed from constants alone, as eagerly) or taken out."""
    import collections

    h, acc, dq = TupleHolder(), [], collections.deque()
    h.v, h.c = None, None
    cell = None

    def model(x):
        nonlocal cell
        y = x * 2
        h.v = (y,)
        h.c = (jax.numpy.arange(3.0) * 2, "tag")
        acc.append((y, 1))
        acc.append((jax.numpy.ones(2) + 1, 2))
        dq.append(y)
        dq.append(jax.numpy.ones(1) * 4)
        cell = (y, 3)
        return jhooks.hook_point(y, "p")

    with pytest.warns(UserWarning, match="the trace wrote a traced value in") as caught:
        out = jhooks.run_with_hooks(model, X)
    said = " ".join(str(w.message) for w in caught)
    assert "the attribute 'v' of a TupleHolder" in said and "closure variable `cell`" in said
    close(out, X * 2)
    assert h.v is None and cell is None  # what was there before
    assert not _is_traced((h.c, acc, list(dq), cell))
    close(h.c[0], jax.numpy.arange(3.0) * 2)
    assert h.c[1] == "tag" and [k for _, k in acc] == [2] and len(dq) == 1
    close(acc[0][0], jax.numpy.ones(2) + 1)
    close(dq[0], jax.numpy.ones(1) * 4)


def _keepers():
    kept = None
    box = TupleHolder()
    box.t = None

    def keep_cell(z, name):
        nonlocal kept
        kept = z

    def keep_tuple(z, name):
        box.t = (z, "h")

    def read():
        try:
            return kept
        except NameError:  # taken out: the cell is empty
            return "empty"

    return keep_cell, keep_tuple, read, box


@pytest.mark.parametrize("outer_jit", [False, True])
def test_a_hook_keeping_in_a_closure_cell_or_a_tuple_gets_the_forward_value(outer_jit):
    """Break r6: a forward hook keeping its value in a closure cell (`nonlocal kept;
    kept = z`) or in a tuple on an object, under `jax.grad`, left a tracer. Now it
    gets the concrete forward value, as in PyTorch (the grad jitted too)."""
    keep_cell, keep_tuple, read, box = _keepers()

    def loss(x):
        return jhooks.run_with_hooks(f, W, x, fwd_hooks=[("h", keep_cell), ("h", keep_tuple)])

    grad = jax.grad(loss)
    if outer_jit:
        grad = jax.jit(grad)
        with pytest.warns(UserWarning, match="on tracers once per compilation"):
            close(grad(X), jax.grad(lambda x: jax.numpy.sum(jax.numpy.tanh(x @ W) ** 2))(X))
        return  # traced inline in the user's jit: JAX's rule (said, left to JAX)
    close(grad(X), jax.grad(lambda x: jax.numpy.sum(jax.numpy.tanh(x @ W) ** 2))(X))
    eager = jax.numpy.tanh(X @ W)
    close(read(), eager)
    close(box.t[0], eager)
    assert box.t[1] == "h" and not _is_traced((read(), box.t))


def test_under_vmap_a_value_kept_in_a_cell_or_a_tuple_is_really_taken_out():
    """Break r6: under the user's `jax.vmap`, a value kept in a closure cell or a tuple
    stayed there while the warning said jhooks took it out. Now it is taken out (the
    cell empty, the attribute removed), and the warning says so only then."""
    keep_cell, keep_tuple, read, box = _keepers()
    run_ = jax.vmap(
        lambda x: jhooks.run_with_hooks(f, W, x, fwd_hooks=[("h", keep_cell), ("h", keep_tuple)])
    )
    with pytest.warns(UserWarning, match="took it out of there again") as caught:
        out = run_(X[:, None])
    close(out, jax.vmap(lambda x: jax.numpy.sum(jax.numpy.tanh(x @ W) ** 2))(X[:, None]))
    said = [str(w.message) for w in caught if "kept a traced value" in str(w.message)]
    assert len(said) == 2 and all("took it out of there again" in m for m in said), said
    assert any("closure variable `kept`" in m for m in said), said
    assert read() == "empty" and not hasattr(box, "t")

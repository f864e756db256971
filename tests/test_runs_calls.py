"""How a run calls its hooks (issue 34): every call, on the user's objects; what a hook
keeps gets its concrete value; backward hooks only when differentiated; the one
shortcut (a pure hook is not called again) and where it does not apply.

The oracle is the hook applied by hand, eagerly."""

import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks
from jhooks._runs import _hookcall

X = jnp.arange(4.0) - 1.25
TRACES: list = []


def f(x):
    TRACES.append(1)
    a = jhooks.hook_point(jnp.tanh(x), "a")
    b = jhooks.hook_point(a * 2.0, "b")
    return jnp.sum(b**2)


def by_hand(hook_a=None, hook_b=None, x=X):
    a = jnp.tanh(x)
    a = a if hook_a is None or (n := hook_a(a, "a")) is None else n
    b = a * 2.0
    b = b if hook_b is None or (n := hook_b(b, "b")) is None else n
    return jnp.sum(b**2)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


class Recorder:
    def __init__(self):
        self.calls = []

    def hook(self, g, name):
        self.calls.append(str(name))
        return g * 3.0


@pytest.mark.parametrize("jit", [False, True])
def test_backward_hooks_run_only_when_the_run_is_differentiated(jit):
    rec = Recorder()
    hooks = [("a", rec.hook)]

    def run(x):
        return jhooks.run_with_hooks(f, x, bwd_hooks=hooks)

    wrap = jax.jit if jit else (lambda fn: fn)
    close(wrap(run)(X), by_hand())
    assert rec.calls == []  # nothing differentiated: not called
    grad = wrap(jax.grad(run))
    for i in range(3):
        a = jnp.tanh(X)
        expected = 3.0 * 8.0 * a * (1 - a**2)  # d/dx sum((2a)^2) = 8a a', scaled by 3
        close(grad(X), expected)
        # Called once per call eagerly; once per trace of the user's jit.
        assert rec.calls == ["a"] * (1 if jit else i + 1)


def test_what_a_hook_keeps_gets_the_concrete_value_every_call():
    acts, by_name = [], {}

    def keep(v, name):
        acts.append(v)
        by_name[str(name)] = v * 1.0

    for i in range(3):
        out = jhooks.run_with_hooks(f, X + i, fwd_hooks=[("a", keep), ("b", keep)])
        close(out, by_hand(x=X + i))
        a = jnp.tanh(X + i)
        assert len(acts) == 2 * (i + 1)
        close(acts[-2], a)
        close(acts[-1], 2.0 * a)
        close(by_name["b"], 2.0 * a)
    assert not any(isinstance(v, jax.core.Tracer) for v in [*acts, *by_name.values()])


def scanned(x):
    def body(c, _):
        c = jhooks.hook_point(jnp.tanh(c), "h")
        return c, None

    return jnp.sum(jax.lax.scan(body, x, None, length=2)[0])


def test_a_value_kept_in_a_loop_is_each_iterations_concrete_value():
    # The hook writes (it appends), so it runs on values where the program reaches it:
    # once per iteration, in order, as PyTorch's eager loop would call it.
    kept = []
    for call in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jhooks.run_with_hooks(scanned, X, fwd_hooks=[("h", lambda v, n: kept.append(v))])
        assert caught == []
        assert len(kept) == 2 * (call + 1)
        assert not any(isinstance(v, jax.core.Tracer) for v in kept)
        close(kept[-2], jnp.tanh(X))
        close(kept[-1], jnp.tanh(jnp.tanh(X)))


@pytest.mark.parametrize("jit", [False, True])
def test_a_hook_reads_what_another_kept_in_the_same_call(jit):
    # Path patching in one forward: the hook at "a" keeps its value, the hook at "b"
    # adds it. Eagerly they run on values in program order; under the user's jit they
    # are traced in its trace, as any Python there.
    store = {}

    def save(v, name):
        store["a"] = v

    def use(v, name):
        return v + store["a"]

    def run(x):
        return jhooks.run_with_hooks(f, x, fwd_hooks=[("a", save), ("b", use)])

    for i in range(3):
        x = X + i
        a = jnp.tanh(x)
        close((jax.jit(run) if jit else run)(x), jnp.sum((2.0 * a + a) ** 2))
    if not jit:
        close(store["a"], jnp.tanh(X + 2))


def test_a_hook_reading_what_another_kept_in_a_differentiated_call_is_told_how():
    store = {}

    def save(v, name):
        store["a"] = v

    def use(v, name):
        return v + store["a"]

    kept = r"save at point 'a' kept a traced value in the closure variable `store`"
    with pytest.warns(UserWarning, match=kept):  # the call failed: taken out again
        with pytest.raises(ValueError, match=r"hook .*use at point 'b' read a traced value"):
            jax.grad(lambda x: jhooks.run_with_hooks(f, x, fwd_hooks=[("a", save), ("b", use)]))(X)
    assert "a" not in store
    # Across calls it works, as in PyTorch: the first call left the concrete value.
    store.clear()
    jhooks.run_with_hooks(f, X, fwd_hooks=[("a", save)])
    close(jhooks.run_with_hooks(f, X, fwd_hooks=[("b", use)]), by_hand(None, use))


def test_a_pure_hook_is_traced_once_and_an_impure_one_runs_on_values_every_call(monkeypatch):
    traced = []
    real = _hookcall.trace_hook
    monkeypatch.setattr(_hookcall, "trace_hook", lambda *a, **k: traced.append(1) or real(*a, **k))
    scale = 1.5

    def pure(v, name):
        return v * scale + jnp.float32(0.25)

    class Impure:
        def __init__(self):
            self.scale = 1.5
            self.seen = []

        def __call__(self, v, name):
            self.seen.append(v)
            return v * self.scale + 0.25

    impure = Impure()
    for hook in (pure, impure):
        traced.clear()
        for i in range(4):
            source = jnp.full(4, float(i))  # a fresh array each call, a fresh closure

            def with_source(v, name, source=source):
                return v + source

            out = jhooks.run_with_hooks(f, X, fwd_hooks=[("a", hook), ("b", with_source)])
            close(out, by_hand(pure if hook is pure else Impure(), with_source))
        if hook is pure:
            # The pure hook and the fresh closures over fresh arrays are traced once
            # each (the first time their key is seen, then found again).
            assert len(traced) == 2
    # The instance writes: it runs on values, once per call (the closure after it too).
    assert len(impure.seen) == 4
    for v in impure.seen:
        assert not isinstance(v, jax.core.Tracer)
        close(v, jnp.tanh(X))


def test_a_pure_hook_sees_a_patched_library_function(monkeypatch):
    def hook(v, name):
        return jax.nn.relu(v)

    close(jhooks.run_with_hooks(f, X, fwd_hooks=[("a", hook)]), by_hand(hook))
    monkeypatch.setattr(jax.nn, "relu", lambda v: -v)
    close(jhooks.run_with_hooks(f, X, fwd_hooks=[("a", hook)]), by_hand(lambda v, n: -v))


def test_threads_calling_runs_with_their_own_hooks_get_their_own_values():
    results, errors = {}, []

    def work(k):
        try:
            calls = []

            def hook(v, name):
                calls.append(1)
                return v * float(k)

            for _ in range(5):
                results[k] = jhooks.run_with_hooks(f, X, fwd_hooks=[("a", hook)])
            assert len(calls) == 5
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    # Compiled once before the threads (they share its structure): threads compiling one
    # program at once would race on the test session's persistent compilation cache.
    jhooks.run_with_hooks(f, X, fwd_hooks=[("a", lambda v, name: v * 0.5)])
    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for k in range(1, 5):
        close(results[k], by_hand(lambda v, n, k=k: v * float(k)))


def test_a_hook_that_raises_on_a_warm_call_is_called_once_and_its_error_raised():
    calls = []

    def flaky(v, name):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("flaky hook failed")
        return v * 2.0

    twice = by_hand(lambda v, n: v * 2.0)
    close(jhooks.run_with_hooks(f, X, fwd_hooks=[("a", flaky)]), twice)
    with pytest.raises(RuntimeError, match="flaky hook failed"):
        jhooks.run_with_hooks(f, X, fwd_hooks=[("a", flaky)])
    assert len(calls) == 2  # once: a hook's error is not a reason to trace again
    close(jhooks.run_with_hooks(f, X, fwd_hooks=[("a", flaky)]), twice)


SCALE = 2.0
TABLE = {"scale": 1.0}


def helper(v):
    return v * SCALE


def via_helper(v, name):
    return helper(v) + TABLE["scale"]


@pytest.mark.parametrize("jit", [False, True])
def test_a_pure_hook_follows_every_change_of_what_it_reads(jit):
    """Whatever a pure hook reads is read again on every call: a global number, a dict
    held by a global, a closure's list changed in place, a NumPy default changed in place,
    a helper function redefined, a partial's numbers."""
    global SCALE, helper
    box = [1.0]
    weights = np.ones(4, np.float32)

    def reads(v, name, w=weights):
        return v * box[0] + w * SCALE

    def run(hook):
        call = lambda x: jhooks.run_with_hooks(f, x, fwd_hooks=[("a", hook)])  # noqa: E731
        return (jax.jit(call) if jit else call)(X)

    original = helper
    try:
        for i in range(3):
            SCALE, TABLE["scale"], box[0] = 2.0 + i, 1.0 - i, 0.5 * i
            weights[:] = float(i)
            close(run(reads), by_hand(reads))
            close(run(via_helper), by_hand(via_helper))
            partial = functools.partial(lambda v, name, k: v * k, k=1.5 + i)
            close(run(partial), by_hand(partial))
        helper = lambda v: v - SCALE  # noqa: E731  (redefined: the hook calls the new one)
        close(run(via_helper), by_hand(via_helper))
    finally:
        SCALE, TABLE["scale"], helper = 2.0, 1.0, original


def test_a_model_that_is_not_hookable_is_named_as_the_reason():
    import equinox as eqx

    plain = eqx.nn.MLP(4, 2, 3, 1, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"no hook point named 'layers.0'\. The points reached: none\. A model's modules "
        r"are points only once it is hookable: `model = jhooks.hookable\(model\)`",
    ):
        jhooks.run_with_hooks(plain, X, fwd_hooks=[("layers.0", lambda v, n: v)])
    hooked = jhooks.hookable(plain)
    out = jhooks.run_with_hooks(hooked, X, fwd_hooks=[("layers.0", lambda v, n: v * 2.0)])
    close(out, plain.layers[1](jax.nn.relu(2.0 * plain.layers[0](X))))


@pytest.mark.parametrize("jit", [False, True])
def test_incl_bwd_differentiates_the_loss_of_a_loss_and_aux_output(jit):
    def with_aux(x):
        a = jhooks.hook_point(jnp.tanh(x), "a")
        return jnp.sum(a**2), {"logits": a * 3.0}

    def as_dict(x):
        loss, aux = with_aux(x)
        return {"loss": loss, "aux": aux}

    def logits_and_cache(x):
        return jnp.tanh(x) * 3.0, jnp.zeros(2)

    wrap = jax.jit if jit else (lambda fn: fn)
    a = jnp.tanh(X)
    for fn in (with_aux, as_dict):
        out, cache = wrap(lambda x, fn=fn: jhooks.run_with_cache(fn, x, incl_bwd=True))(X)
        close(cache["a_grad"], 2.0 * a)  # d sum(a^2) / da
        close(cache["a"], a)
        loss = out[0] if fn is with_aux else out["loss"]
        close(loss, jnp.sum(a**2))
    with pytest.raises(
        ValueError, match=r"fn returned \(float32\[4\], float32\[2\]\)\. Return the scalar"
    ):
        wrap(lambda x: jhooks.run_with_cache(logits_and_cache, x, incl_bwd=True))(X)


def test_a_kept_value_moved_by_a_later_hook_is_not_written_back_out_of_place():
    acts = []

    def keep(v, name):
        acts.append(v)

    def drop(v, name):
        acts.pop()  # the list no longer holds what `keep` kept

    out = jhooks.run_with_hooks(f, X, fwd_hooks=[("a", keep), ("b", drop)])
    close(out, by_hand())
    assert acts == []


def test_a_number_passed_as_an_argument_is_an_input_from_the_first_call(maybe_jit):
    """Issue 43: at a point made from Python-number arguments, the hook got a Python
    float on the first call (and its replacement was dropped: 6.0, not 12.0), then an
    array once the number was seen to change. Numbers passed as arguments are inputs
    from the first call, as under `jax.jit`: one kind of value every call, one trace."""
    traces = []

    def scaled(x, s):
        traces.append(1)
        return jhooks.hook_point(x * s, "p")

    kinds = []

    def double(z, name):
        kinds.append(type(z))
        return z * 2.0

    @maybe_jit
    def call(s):
        return jhooks.run_with_hooks(scaled, 2.0, s, fwd_hooks=[("p", double)])

    outs = [call(3.0 + i) for i in range(3)]
    np.testing.assert_allclose([float(o) for o in outs], [2.0 * (3.0 + i) * 2.0 for i in range(3)])
    # Under the user's jit the run is traced once, as its Python is (JAX's rule).
    assert len(set(kinds)) == 1 and len(kinds) == (1 if maybe_jit is jax.jit else 3), kinds
    assert issubclass(kinds[0], jax.core.Tracer if maybe_jit is jax.jit else jax.Array), kinds
    assert len(traces) == 1, traces


def test_a_predicate_is_asked_once_per_point_on_every_call(maybe_jit):
    """Issue 43: a name predicate drawing random numbers kept its first selection.
    TransformerLens asks a name filter once per hook point on every call: so does a
    run (a new selection records the run's layout again). Under the user's jit it is
    asked when the run is traced (JAX's rule)."""
    import random

    draws = random.Random(0)
    asked: list = []

    def coin(name):
        choice = draws.random() < 0.5
        asked.append((name, choice))
        return choice

    called: list = []

    def mark(z, name):
        called.append(str(name))

    call = maybe_jit(lambda x: jhooks.run_with_hooks(f, x, fwd_hooks=[(coin, mark)]))
    for _ in range(12):
        asked.clear()
        called.clear()
        call(X)
        if maybe_jit is jax.jit:
            assert len(asked) <= 2  # asked at the trace only (first call)
            continue
        assert sorted(n for n, _ in asked) == ["a", "b"], asked  # once per point
        assert called == [n for n, chosen in asked if chosen], (asked, called)


def branches(x):
    return jax.lax.cond(
        jnp.sum(x) > 0,
        lambda x: jhooks.hook_point(jnp.tanh(x), "p"),
        lambda x: jhooks.hook_point(x * 3.0, "p"),
        x,
    )


@pytest.mark.parametrize("differentiated", [False, True])
def test_a_point_in_both_branches_of_a_cond_runs_its_hook_once_per_call(maybe_jit, differentiated):
    """Issue 43: a point in both branches of a `lax.cond` ran a traced hook's Python
    twice per call (and kept two tracers): one reach of a point per call, as PyTorch
    runs a module's hook once per call. A kept value there is concrete or absent."""
    calls, kept = [], []

    def hook(z, name):
        calls.append(str(name))  # a side effect
        kept.append(z)
        return z * 2.0

    def run(x):
        return jnp.sum(jhooks.run_with_hooks(branches, x, fwd_hooks=[("p", hook)]))

    def by_hand(x):
        return jnp.sum(jax.lax.cond(jnp.sum(x) > 0, jnp.tanh, lambda x: x * 3.0, x) * 2.0)

    step = maybe_jit(jax.grad(run) if differentiated else run)
    oracle = jax.grad(by_hand) if differentiated else by_hand
    for i in range(3):
        x = X + (i - 1) * 2.0  # both signs of the sum: both branches
        calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a traced kept value is named: tested elsewhere
            close(step(x), oracle(x))
        if maybe_jit is jax.jit:
            # Traced inline once, as any Python under plain jax.jit: once per branch.
            assert len(calls) == (2 if i == 0 else 0)
            continue
        assert calls == ["p"], calls
    if maybe_jit is not jax.jit:
        assert all(not isinstance(k, jax.core.Tracer) for k in kept)


def test_predicate_choices_seen_before_trace_nothing_again():
    """A predicate whose choice alternates between calls: each choice's layout is kept,
    so once both were seen no call traces again (measured before the mend: 894 traces
    in 1,800 calls, one per change of choice)."""
    import random

    draws = random.Random(1)
    TRACES.clear()
    hooks = [(lambda name: name == "b" and draws.random() < 0.5, lambda z, n: z + 1.0)]
    for _ in range(20):  # warm-up: both choices, surely (2**-20 otherwise)
        jhooks.run_with_hooks(f, X, fwd_hooks=hooks)
    warm = len(TRACES)
    for _ in range(40):
        jhooks.run_with_hooks(f, X, fwd_hooks=hooks)
    assert len(TRACES) == warm, (warm, len(TRACES))

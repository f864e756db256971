"""Runs never leak: a sweep of fresh hooks compiles once per structure in flat memory.

Issue 15's cases 10-12 and its four sweep styles, and issue 26's hook over a large dict,
with fewer calls than the benchmark (`python -m benchmarks.run_overhead` runs 2,000 of
each): the resident memory grows by
less than a bound, and the trace count stays at the number of distinct structures.
"""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

import jhooks
from jhooks._runs import _programs

CALLS = 250
MIB = 1 << 20
TRACES: list = []
W = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32))
X = jnp.ones((4, 8), jnp.float32)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def f(w, x):
    TRACES.append(1)
    return jnp.sum(jhooks.hook_point(jnp.tanh(x @ w), "h") ** 2)


class Layer(jhooks.Module):
    w: jax.Array

    def __call__(self, x):
        TRACES.append(1)
        return jnp.tanh(x @ self.w)


class Patch:
    def __init__(self, source):
        self.source = source

    def __call__(self, h, name):
        return h + self.source


def sweep(step, calls=CALLS):
    """Runs `step(i)` `calls` times: the RSS growth after a warm-up, and the traces."""
    for i in range(20):
        step(i)
    gc.collect()
    before, traces = rss(), len(TRACES)
    for i in range(calls):
        step(i)
    gc.collect()
    return (rss() - before) / MIB, len(TRACES) - traces


def fresh_lambda(i):
    source = jnp.full((4, 8), float(i))
    return jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", lambda h, n: h + source)])


def callable_instance(i):
    return jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", Patch(jnp.full((4, 8), float(i))))])


def backward_hook(i):
    scale = jnp.full((4, 8), float(i))

    def loss(x):
        return jhooks.run_with_hooks(f, W, x, bwd_hooks=[("h", lambda g, n: g * scale)])

    return jax.grad(loss)(X)


def large_table(i):
    table = {f"w{k}": 0.5 for k in range(100)}  # fresh, of which the hook reads one entry
    table["w1"] = float(i % 3)
    return jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", lambda h, n: h * table["w1"])])


NET = Layer(W)
STEP = jax.jit(lambda net, x: jnp.sum(net(x) ** 2))


def module_hook(i):
    small = np.full(8, 0.5, np.float32)  # fresh, and equal, every step
    with NET.register_forward_hook(lambda m, a, out: out + small):
        return STEP(NET, X)


def test_each_sweep_style_compiles_once_and_stays_flat():
    for step in (fresh_lambda, callable_instance, backward_hook, module_hook, large_table):
        grown, traces = sweep(step)
        assert traces == 0, step.__name__  # the warm-up compiled the one structure
        assert grown < 20, (step.__name__, grown)


def test_values_follow_every_call():
    for i in (0, 3):
        source = jnp.full((4, 8), float(i))
        np.testing.assert_allclose(fresh_lambda(i), jnp.sum((jnp.tanh(X @ W) + source) ** 2))
        np.testing.assert_allclose(
            callable_instance(i), jnp.sum((jnp.tanh(X @ W) + source) ** 2), rtol=1e-6
        )
        h = jnp.tanh(X @ W)
        np.testing.assert_allclose(
            backward_hook(i), ((2 * h * i) * (1 - h**2)) @ W.T, rtol=1e-5, atol=1e-6
        )


def test_fresh_hooks_of_one_structure_share_one_program():
    def make():
        lock = threading.Lock()  # a C object the hook holds: not part of any key

        def throwaway(h, name):
            with lock:
                return h * 2.0

        return throwaway

    jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", make())])
    before = len(_programs._programs)
    for _ in range(20):
        out = jhooks.run_with_hooks(f, W, X, fwd_hooks=[("h", make())])
    # Programs are keyed by what hooks compute, not by the hooks: nothing to free.
    assert len(_programs._programs) == before
    h = jnp.tanh(X @ W)
    np.testing.assert_allclose(out, jnp.sum((2.0 * h) ** 2), rtol=1e-6)


def test_a_backward_hooks_constants_leave_no_tracer(frozen_gc, maybe_jit):
    """A run's backward hook whose computation has a constant (`grad * 2.0`, an argument
    of the program) at a point and at an operation address, under `jax.grad`: no tracer
    of the program's trace is left behind (the rule took the constants by closure and
    every jaxpr holding it kept the trace alive; a warm call's hook pass kept the
    constants it replayed), and the gradient is doubled."""

    def scale(grad, name):
        return grad * 2.0

    plain = jax.grad(lambda w: f(w, X))(W)
    fresh_lambda(0)  # runs of `f` before: the runs below find its program and replay
    backward_hook(1)
    for name in ("h", "/tanh"):

        def loss(w, name=name):
            return jhooks.run_with_hooks(f, w, X, bwd_hooks=[(name, scale)])

        for _ in range(2):  # the first call traces the hooks, the second replays them
            with jax.checking_leaks():
                grad = maybe_jit(jax.grad(loss))(W)
            # float32, gradients up to 6: 1.9e-6 apart seen.
            np.testing.assert_allclose(grad, 2.0 * plain, rtol=1e-5, atol=1e-5)


REBOUND = jnp.ones(3)


def test_a_global_array_rebound_every_call_is_not_kept_alive(recwarn):
    """A model read as a global and replaced at every step (`model = update(model)`):
    each new array traces the run again (issue 43), and the programs of the arrays
    replaced do not keep them alive: at most the live array and the last walk's are held.
    Eager only: under the user's `jax.jit` the run is traced inline, and what the jit
    keeps is JAX's."""
    global REBOUND

    def model(x):
        return jhooks.hook_point(x * REBOUND, "a")

    refs = []
    for i in range(40):
        REBOUND = jnp.full(3, float(i))
        refs.append(weakref.ref(REBOUND))
        out = jhooks.run_with_hooks(model, jnp.ones(3), fwd_hooks=[("a", lambda z, n: z + 1)])
        np.testing.assert_allclose(out, np.full(3, i + 1.0))  # never stale
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= 2, f"{alive} of 40 replaced arrays kept alive"
    told = [str(w.message) for w in recwarn if "was traced and compiled again" in str(w.message)]
    assert len(told) == 1 and "REBOUND" in told[0]  # said once, naming the global

"""An evicted program is freed at eviction, by reference counting, not at the cyclic
GC's next full collection: each holds its XLA executable (about 1.4 MB on CPU), and
hundreds of evicted programs awaiting the GC doubled a retracing loop's memory."""

import gc
import weakref

import jax.numpy as jnp
import numpy as np

import jhooks
from jhooks._runs import _programs


def test_an_evicted_program_is_freed_at_once(monkeypatch):
    monkeypatch.setattr(_programs._programs, "size", 2)
    G = np.zeros(2, np.float32)
    f = lambda x: x * 2 + G  # noqa: E731
    x = jnp.ones(2)
    refs = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(6):
            G[0] = i  # edited in place: traced and compiled again
            jhooks.run_with_hooks(f, x)
            refs.append(weakref.ref(next(reversed(_programs._programs.values()))))
        assert [r() is None for r in refs] == [True] * 4 + [False] * 2
    finally:
        if enabled:
            gc.enable()

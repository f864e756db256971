"""A training loop whose hooks on values compute with JAX never hangs (`_runs/_waits.py`).

A hook on values runs in a host callback while its program executes; JAX work in it
(`float(g.mean())`) is one more XLA execution. Had the main thread gone on dispatching
(the next steps of a `jax.grad` loop), the executions queued behind the program filled
the CPU client's in-flight limit and the callback's execution waited for a slot
forever: the loop hung within a few hundred steps (every run of 300 steps before the
fix). The loop runs in a subprocess, so that a hang fails the test (its traceback
dumped) instead of blocking the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jhooks

LOOP = textwrap.dedent(
    """
    import faulthandler, sys
    faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)
    import jax, jax.numpy as jnp, numpy as np, jhooks

    W, X = jnp.ones((32, 64)) * 0.01, jnp.ones((16, 32))

    def model(w, x):
        return jhooks.hook_point(jnp.tanh(x @ w), "h")

    kept, seen = {}, []

    def keep(z, name):
        kept["a"] = z

    def mean(g, name):  # docs/semantics.md: a hook on values may call jax.numpy
        seen.append(float(g.mean()))

    def numpy(g, name):  # NumPy only, on the gradient and on a kept forward value
        seen.append(float(np.sum(np.asarray(g) * np.asarray(kept["a"]))))

    def inner(w, x):  # a nested run's backward hook, a host call of the outer program
        return jhooks.run_with_hooks(model, w, x, bwd_hooks=[("h", mean)])

    runs = {
        "backward, jax.numpy": (300, lambda w, x: jhooks.run_with_hooks(
            model, w, x, bwd_hooks=[("h", mean)])),
        "backward, NumPy": (300, lambda w, x: jhooks.run_with_hooks(
            model, w, x, fwd_hooks=[("h", keep)], bwd_hooks=[("h", numpy)])),
        "forward under grad": (300, lambda w, x: jhooks.run_with_hooks(
            model, w, x, fwd_hooks=[("h", mean)])),
        "nested run": (60, lambda w, x: jhooks.run_with_hooks(inner, w, x)),
    }
    for name, (steps, run) in runs.items():
        seen.clear()
        w = W
        for i in range(steps):
            g = jax.grad(lambda w: jnp.sum(run(w, X + i % 7) ** 2))(w)
            w = w - 1e-3 * g  # the next step reads this one's gradient, as training does
        assert len(seen) == steps, (name, len(seen))
        print("OK", name, flush=True)
    """
)


def test_a_training_loop_whose_hooks_on_values_compute_with_jax_does_not_hang():
    root = str(Path(jhooks.__file__).resolve().parents[1])  # this jhooks, in the child too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        result = subprocess.run(
            [sys.executable, "-c", LOOP, "90"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired as e:  # faulthandler exits first: not expected
        raise AssertionError(f"the loop hung: {e.stdout!r}") from None
    assert result.returncode == 0, (
        f"the loop hung or failed after {result.stdout!r}:\n{result.stderr[-4000:]}"
    )
    assert result.stdout.count("OK") == 4, result.stdout

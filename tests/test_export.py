"""Hooked programs exported with `jax.export` run where jhooks is not installed.

Hooks, caches and value hooks are traced into the program: once exported, it is plain
StableHLO. Each test exports a hooked program (its arrays as flat arguments), serializes it,
and runs it in a fresh Python process that deserializes it without importing jhooks (asserted
there); the results must equal the ones computed in this process. A host hook
(`jhooks.host`, a `jax.debug.callback`) cannot be serialized: `jax.export` refuses it.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jhooks

# The process that loads the programs: no jhooks, only JAX and NumPy.
LOADER = textwrap.dedent(
    """
    import sys

    import jax
    import numpy as np
    from jax import export

    folder = sys.argv[1]
    with open(f"{folder}/program.bin", "rb") as f:
        program = export.deserialize(bytearray(f.read()))
    args = np.load(f"{folder}/args.npz")
    outs = program.call(*[args[f"a{i}"] for i in range(len(args.files))])
    leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(outs)]
    np.savez(f"{folder}/outs.npz", **{f"o{i}": leaf for i, leaf in enumerate(leaves)})
    assert "jhooks" not in sys.modules, "the loader imported jhooks"
    print("loaded without jhooks")
    """
)


def run_elsewhere(exported, args, tmp_path):
    """Serializes `exported`, runs it on `args` in a fresh process, returns its output leaves."""
    (tmp_path / "program.bin").write_bytes(exported.serialize())
    np.savez(tmp_path / "args.npz", **{f"a{i}": np.asarray(a) for i, a in enumerate(args)})
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing that could bring jhooks in by accident
    result = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"loader failed:\n{result.stdout}\n{result.stderr}"
    assert "loaded without jhooks" in result.stdout
    outs = np.load(tmp_path / "outs.npz")
    return [outs[f"o{i}"] for i in range(len(outs.files))]


def check_same(exported, args, expected, tmp_path):
    got = run_elsewhere(exported, args, tmp_path)
    want = [np.asarray(leaf) for leaf in jax.tree.leaves(expected)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def mlp(w1, w2, x):
    h = jhooks.hook_point(jnp.tanh(x @ w1), "hook_h")
    return h @ w2


def weights():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w1 = jax.random.normal(k1, (4, 8), jnp.float32) / 2
    w2 = jax.random.normal(k2, (8, 3), jnp.float32) / 3
    x = jax.random.normal(k3, (5, 4), jnp.float32)
    return w1, w2, x


def test_steering_run_exports_with_its_vector_and_coefficient_as_arguments(tmp_path):
    def steered(w1, w2, x, vector, coeff):
        def add(h, name):
            return h + coeff * vector

        return jhooks.run_with_hooks(mlp, w1, w2, x, fwd_hooks=[("hook_h", add)])

    w1, w2, x = weights()
    vector = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    coeff = jnp.float32(0.7)
    exported = export.export(jax.jit(steered))(w1, w2, x, vector, coeff)
    expected = steered(w1, w2, x, vector, coeff)
    assert not np.allclose(expected, mlp(w1, w2, x))  # the hook steers
    check_same(exported, (w1, w2, x, vector, coeff), expected, tmp_path)
    # The vector and coefficient are arguments, not constants baked into the program.
    other = (w1, w2, x, -vector, jnp.float32(2.0))
    check_same(exported, other, steered(*other), tmp_path)


def test_cache_run_exports(tmp_path):
    def cached(w1, w2, x):
        return jhooks.run_with_cache(mlp, w1, w2, x, names_filter=["hook_h"])

    w1, w2, x = weights()
    exported = export.export(jax.jit(cached))(w1, w2, x)
    out, cache = cached(w1, w2, x)
    np.testing.assert_allclose(cache["hook_h"], jnp.tanh(x @ w1), rtol=1e-6)
    check_same(exported, (w1, w2, x), (out, cache), tmp_path)


def test_training_step_with_a_clamping_value_hook_exports(tmp_path):
    def loss(w1, w2, x, clamp):
        h = jnp.tanh(x @ w1)
        if clamp:
            h = jhooks.register_hook(h, lambda g: jnp.clip(g, -0.1, 0.1))
        return jnp.sum((h @ w2) ** 2)

    def train_step(w1, w2, x, clamp=True):
        value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x, clamp)
        return value, w1 - 0.1 * g1, w2 - 0.1 * g2

    w1, w2, x = weights()
    exported = export.export(jax.jit(train_step))(w1, w2, x)
    expected = jax.jit(train_step)(w1, w2, x)
    unhooked = train_step(w1, w2, x, clamp=False)
    assert not np.allclose(expected[1], unhooked[1])  # the hook clamped w1's gradient
    np.testing.assert_allclose(expected[2], unhooked[2], rtol=1e-6)  # w2's is upstream of it
    check_same(exported, (w1, w2, x), expected, tmp_path)


def test_clipped_grad_step_exports(tmp_path):
    def example_loss(params, x, y):
        w1, w2 = params
        return jnp.sum((jnp.tanh(x @ w1) @ w2 - y) ** 2)

    clipped = jhooks.clipped_grad(example_loss, max_norm=0.5)

    def dp_step(w1, w2, xs, ys):
        (g1, g2), norms = clipped((w1, w2), xs, ys)
        return w1 - 0.1 * g1, w2 - 0.1 * g2, norms

    w1, w2, xs = weights()
    ys = jnp.ones((5, 3), jnp.float32)
    exported = export.export(jax.jit(dp_step))(w1, w2, xs, ys)
    expected = jax.jit(dp_step)(w1, w2, xs, ys)
    assert np.all(np.asarray(expected[2]) > 0.5)  # every example was clipped
    check_same(exported, (w1, w2, xs, ys), expected, tmp_path)


def test_host_hook_is_refused_by_export():
    """A host hook is a Python callback: the exported program could not call it."""

    def logged(w1, w2, x):
        hook = jhooks.host(lambda h, name: None)
        return jhooks.run_with_hooks(mlp, w1, w2, x, fwd_hooks=[("hook_h", hook)])

    w1, w2, x = weights()
    with pytest.raises(NotImplementedError, match="serialization of host_callbacks"):
        export.export(jax.jit(logged))(w1, w2, x)
    # Without it the same run exports: a hook that returns values (jhooks.emit, a cache)
    # is the way to get them out of an exported program.
    export.export(jax.jit(lambda *a: jhooks.run_with_cache(mlp, *a)))(w1, w2, x)

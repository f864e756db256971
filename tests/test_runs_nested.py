"""A run inside another run's function (issue 42): the inner run's hooks run their
Python on every call, on values, as TransformerLens and PyTorch call them.

The inner run is traced inline in the outer run's program, which is reused: its hooks
with side effects are host calls there (`_runs/_nested.py`). The oracles: the counts
derived from the structure (TransformerLens' nested-hooks test: one point reached by
the outer run alone and once inside the inner run, so 1 + 2 calls), and the hooks
applied by hand in plain JAX. Under the user's `jax.jit` the whole of it is traced once
(JAX's rule): the counts are those of one trace.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

X = jnp.arange(3.0) - 0.5


def g(x):
    return jhooks.hook_point(jnp.sin(x), "a")


class Counter:  # TransformerLens' own
    def __init__(self):
        self.count = 0

    def inc(self, *args, **kwargs):
        self.count += 1


def test_outer_and_inner_hooks_both_run_every_call_as_transformer_lens_counts(maybe_jit):
    c = Counter()

    def outer(x):
        return g(x) + jhooks.run_with_hooks(g, x, fwd_hooks=[("a", c.inc)])

    call = maybe_jit(lambda x: jhooks.run_with_hooks(outer, x, fwd_hooks=[("a", c.inc)]))
    for i in range(1, 4):
        out = call(X + i)
        np.testing.assert_allclose(out, 2 * jnp.sin(X + i), rtol=1e-6)
        # Outer hook at both reaches, inner hook at the inner one: 3 per call.
        assert c.count == (3 if maybe_jit is jax.jit else 3 * i), (i, c.count)


def test_inner_hooks_that_replace_values_and_read_them_concretely(maybe_jit):
    seen = []

    def triple_and_log(z, name):
        if maybe_jit is not jax.jit:
            seen.append(float(z.sum()))  # a value: the hook runs on the host
        return z * 3.0

    def outer(x):
        return g(x) + jhooks.run_with_hooks(g, x, fwd_hooks=[("a", triple_and_log)])

    call = maybe_jit(
        lambda x: jhooks.run_with_hooks(outer, x, fwd_hooks=[("a", lambda z, n: z * 2.0)])
    )
    for i in range(3):
        x = X + i
        # By hand: the outer hook doubles both reaches, the inner one then triples.
        np.testing.assert_allclose(call(x), 2 * jnp.sin(x) + 6 * jnp.sin(x), rtol=1e-6)
    if maybe_jit is not jax.jit:
        expected = [float(2 * jnp.sin(X + i).sum()) for i in range(3)]
        np.testing.assert_allclose(seen, expected, rtol=1e-6)


def test_an_inner_backward_hook_runs_in_every_backward_pass_on_the_users_list(maybe_jit):
    grads = []

    def record(grad, name):
        grads.append(grad if maybe_jit is jax.jit else np.asarray(grad))

    def outer(x):
        return jnp.sum(jhooks.run_with_hooks(g, x, bwd_hooks=[("a", record)]) ** 2)

    grad = maybe_jit(jax.grad(lambda x: jhooks.run_with_hooks(outer, x)))
    for i in range(3):
        x = X + i
        by_hand = jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x)
        np.testing.assert_allclose(grad(x), by_hand, rtol=1e-6)
        if maybe_jit is not jax.jit:
            assert len(grads) == i + 1
            np.testing.assert_allclose(grads[-1], 2 * jnp.sin(x), rtol=1e-6)


def test_an_inner_hooks_own_error_is_raised_on_the_call_it_fails():
    calls = []

    def fails_third(z, name):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("the third call")

    def outer(x):
        return jhooks.run_with_hooks(g, x, fwd_hooks=[("a", fails_third)])

    for _ in range(2):
        jhooks.run_with_hooks(outer, X)
    with pytest.raises(KeyError, match="the third call"):
        jhooks.run_with_hooks(outer, X)
    np.testing.assert_allclose(jhooks.run_with_hooks(outer, X), jnp.sin(X), rtol=1e-6)
    assert len(calls) == 4


def test_generate_inside_a_run_gives_its_hooks_values_every_call():
    from benchmarks.decode_models import Config, make_gpt, step

    model = make_gpt(Config())
    prompt = jnp.asarray([1, 5, 7, 2], jnp.int32)
    sums: list = []
    hooks = [("blocks.0.hook_resid_post", lambda z, n: sums.append(float(z.sum())))]
    decode = dict(max_new_tokens=3, fwd_hooks=hooks)
    direct = jhooks.generate(step, model, model.init_cache(), prompt, **decode)
    per_call = len(sums)
    assert per_call > 0
    for i in range(2):
        tokens = jhooks.run_with_hooks(
            lambda m, c: jhooks.generate(step, m, c, prompt, **decode).tokens,
            model,
            model.init_cache(),
        )
        np.testing.assert_array_equal(tokens, direct.tokens)
        assert len(sums) == per_call * (i + 2)
        np.testing.assert_allclose(sums[-per_call:], sums[:per_call], rtol=1e-5)

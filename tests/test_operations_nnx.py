"""Operation addresses on a Flax NNX model: the module call's named scope names them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jhooks


class Attn(nnx.Module):
    def __init__(self, rngs):
        self.qk = nnx.Linear(4, 8, rngs=rngs)

    def __call__(self, x):
        q, k = jnp.split(self.qk(x), 2, -1)
        return jax.nn.softmax(q @ k.T, axis=-1) @ x


class Net(nnx.Module):
    def __init__(self, rngs):
        self.attn = Attn(rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(x + self.attn(x))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_nnx_operations_are_cached_and_patched(jit):
    model = jhooks.hookable(Net(nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32))
    assert {"attn/softmax", "attn.qk/dot_general", "/add"} <= {
        op.address for op in jhooks.ops(model, x)
    }
    wrap = nnx.jit if jit else (lambda f: f)

    @wrap
    def run(m, x):
        _, cache = jhooks.run_with_cache(m, x, names_filter="attn/softmax")
        patched = jhooks.run_with_hooks(
            m, x, fwd_hooks=[("attn/softmax", lambda p, name: jnp.zeros_like(p))]
        )
        return cache["attn/softmax"], patched

    pattern, patched = run(model, x)
    q, k = jnp.split(model.attn.qk(x), 2, -1)
    np.testing.assert_allclose(pattern, jax.nn.softmax(q @ k.T, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(patched, model.out(x), rtol=1e-6)  # attention zeroed

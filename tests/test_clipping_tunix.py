"""`jhooks.clipped_grad` on tunix's published LLMs (google-tunix 0.1.7, Flax NNX),
unmodified, in tiny random-initialised configurations (`tunix_models.py`): Llama 3,
Qwen 3 with a mixture of experts (4 experts, 2 per token) and Gemma 3, a next-token loss
on a batch of 3 sequences.

Against the oracle: per-example gradients by `jax.vmap(jax.grad)` of the loss of the
model's `nnx.Param`s, clipped by hand and summed; eagerly and under `nnx.jit`, with
warnings as errors (no per-example fallback). What each model takes: Gemma's norms
`x * (1 + scale)` (a shift), every projection an `Einsum` or `nnx.Linear` (a site), the
embedding a row lookup tied to the output layer (Gemma); Qwen 3's experts, on the route
tunix takes without a device mesh (every CPU run): a one-hot dispatch and a Python loop
over the experts, `gate_proj[i]` (a static slice: a region of the stacked weight). The
compiled memory of the clipped step is held against the plain gradient's (1.2x).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tunix_models import (
    FAMILIES,
    build,
    standard_promotion,  # noqa: F401  (autouse)
)

import jhooks

# tunix 0.1.7's own code uses what JAX 0.8.2 and Flax 0.12 deprecate (the mesh of
# `pxla.thread_resources`, a parameter's `.value`): the warnings its lines raise.
pytestmark = pytest.mark.filterwarnings(r"ignore::DeprecationWarning:tunix\.")

RTOL = 1e-5
MOE = dict(num_experts=4, num_experts_per_tok=2)  # Qwen 3's experts (Qwen3-30B-A3B's kind)


def configured(family: str) -> dict:
    return MOE if family == "qwen3" else {}


def next_token_loss(model, tokens):
    """The loss of ONE sequence: the mean cross-entropy of each next token, causal mask."""
    length = tokens.shape[0]
    positions = jnp.arange(length)[None]
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    logits, _ = model(tokens[None], positions, None, mask)
    logp = jax.nn.log_softmax(logits[0, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[1:, None], axis=1))


def per_example_reference(model, ids):
    """Per-example gradients of the model's `nnx.Param`s by `jax.vmap(jax.grad)` (jitted)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def params_loss(params, tokens):
        return next_token_loss(nnx.merge(graphdef, params, rest), tokens)

    per = jax.jit(jax.vmap(jax.grad(params_loss), in_axes=(None, 0)))(params, ids)
    leaves = jax.tree.leaves(per)
    norms = jnp.sqrt(sum(jnp.sum(g**2, axis=tuple(range(1, g.ndim))) for g in leaves))
    return per, norms


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, model, token ids, the per-example reference): built once per family, shared
    by the eager and the jitted run."""
    name = request.param
    with jax.numpy_dtype_promotion("standard"):
        _, model = build(name, layers=1, hookable=False, **configured(name))
        ids = jax.random.randint(jax.random.PRNGKey(7), (3, 6), 0, 32)
        per, norms = per_example_reference(model, ids)
    return name, model, ids, per, norms


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_clipped_grad_equals_vmap_grad_clipped_by_hand(family, jit):
    name, model, ids, per, ref_norms = family
    max_norm = float(np.median(ref_norms))  # some examples clipped, some not
    w = jnp.minimum(1.0, max_norm / ref_norms)
    assert float(jnp.min(w)) < 1.0 and float(jnp.max(w)) == 1.0
    step = jhooks.clipped_grad(next_token_loss, max_norm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a ghost rule for every parameter: no fallback
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"tunix\.")
        grads, norms = (nnx.jit(step) if jit else step)(model, ids)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
    got = jax.tree.leaves_with_path(grads)
    want = jax.tree.leaves_with_path(per)
    assert [jax.tree_util.keystr(p) for p, _ in got] == [jax.tree_util.keystr(p) for p, _ in want]
    for (path, g), (_, p) in zip(got, want):
        clipped = jnp.tensordot(w, p, 1)
        scale = float(jnp.max(jnp.abs(clipped))) or 1.0
        np.testing.assert_allclose(
            g, clipped, rtol=RTOL, atol=RTOL * scale, err_msg=jax.tree_util.keystr(path)
        )

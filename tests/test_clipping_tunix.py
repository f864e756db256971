"""`jhooks.clipped_grad` on tunix's published LLMs (google-tunix 0.1.7, Flax NNX),
unmodified, in small random-initialised configurations (`tunix_models.py`; one layer,
width 128): Llama 3, Qwen 3 with a mixture of experts (4 experts, 2 per token) and Gemma 3,
a next-token loss on a batch of 3 sequences.

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

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clipping_reference import nnx_reference
from flax import nnx
from tunix_models import (
    FAMILIES,
    build,
    standard_promotion,  # noqa: F401  (autouse)
    tunix_module,
)

import jhooks

# tunix 0.1.7's own code uses what JAX 0.8.2 and Flax 0.12 deprecate (the mesh of
# `pxla.thread_resources`, a parameter's `.value`): the warnings its lines raise.
pytestmark = pytest.mark.filterwarnings(r"ignore::DeprecationWarning:tunix\.")

RTOL = 1e-5
MOE = dict(num_experts=4, num_experts_per_tok=2)  # Qwen 3's experts (Qwen3-30B-A3B's kind)
# One model per family for every test: large enough for the memory test (1.1-2.7 MB of
# parameters), built once.
SIZES = dict(embed_dim=128, hidden_dim=256, num_heads=4, head_dim=32, num_kv_heads=2)
VOCAB = 1024


def configured(family: str) -> dict:
    return MOE if family == "qwen3" else {}


def built(family: str, **config) -> nnx.Module:
    """The family's model, one layer, the sizes `SIZES`, Qwen 3 with experts."""
    _, model = build(
        family, vocab=VOCAB, layers=1, hookable=False, **SIZES, **configured(family), **config
    )
    return model


@contextlib.contextmanager
def no_fallback():
    """Warnings as errors (a ghost rule for every parameter: no per-example fallback's
    `UserWarning`), but for the deprecations tunix's own lines raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"tunix\.")
        yield


def next_token_loss(model, tokens):
    """The loss of ONE sequence: the mean cross-entropy of each next token, causal mask."""
    length = tokens.shape[0]
    positions = jnp.arange(length)[None]
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    logits, _ = model(tokens[None], positions, None, mask)
    logp = jax.nn.log_softmax(logits[0, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[1:, None], axis=1))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, model, token ids, the per-example reference): built once per family, shared
    by the eager and the jitted run."""
    name = request.param
    with jax.numpy_dtype_promotion("standard"):
        model = built(name)
        ids = jax.random.randint(jax.random.PRNGKey(7), (3, 6), 0, VOCAB)
        per, norms = nnx_reference(next_token_loss, model, ids)
    return name, model, ids, per, norms


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_clipped_grad_equals_vmap_grad_clipped_by_hand(family, jit):
    name, model, ids, per, ref_norms = family
    max_norm = float(np.median(ref_norms))  # some examples clipped, some not
    assert float(jnp.min(ref_norms)) < max_norm < float(jnp.max(ref_norms))
    step = jhooks.clipped_grad(next_token_loss, max_norm)
    with no_fallback():
        grads, norms = (nnx.jit(step) if jit else step)(model, ids)
    assert_clipped(grads, norms, per, ref_norms, max_norm)


def assert_clipped(grads, norms, per, ref_norms, max_norm):
    """`grads, norms` of `clipped_grad` against the per-example gradients `per` (and
    their norms) clipped by hand and summed; the same parameters, by path."""
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
    w = jnp.minimum(1.0, max_norm / ref_norms)
    got = jax.tree.leaves_with_path(grads)
    want = jax.tree.leaves_with_path(per)
    assert [jax.tree_util.keystr(p) for p, _ in got] == [jax.tree_util.keystr(p) for p, _ in want]
    for (path, g), (_, p) in zip(got, want):
        clipped = jnp.tensordot(w, p, 1)
        scale = float(jnp.max(jnp.abs(clipped))) or 1.0
        np.testing.assert_allclose(
            g, clipped, rtol=RTOL, atol=RTOL * scale, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("family", ["qwen3"], indirect=True)
def test_checkpointed_layers_take_the_two_pass_route_exactly(family):
    # tunix's `remat_config=RematConfig.DECODER`: each decoder layer under `nnx.remat`, so
    # the norms are computed in the backward pass and the clipped sum in a second one.
    # The same parameters as the family's model without it (the same seed), so the same
    # reference. Qwen 3 alone, for time: its experts' regions and its q/k norms under the
    # checkpoint (Llama 3 and Gemma 3 with DECODER and BLOCK remat were measured exact,
    # with no warning, when this test was written).
    name, plain_model, ids, per, ref_norms = family
    remat = tunix_module(name).RematConfig.DECODER
    model = built(name, remat_config=remat)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(plain_model))):
        np.testing.assert_array_equal(a, b)
    max_norm = float(np.median(ref_norms))
    with no_fallback():
        grads, norms = nnx.jit(jhooks.clipped_grad(next_token_loss, max_norm))(model, ids)
    assert_clipped(grads, norms, per, ref_norms, max_norm)


def temp_bytes(fn, model, ids):
    """XLA's compiled temporary memory of `fn(model, ids)`, jitted over the parameters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    run = jax.jit(lambda params, ids: fn(nnx.merge(graphdef, params, rest), ids))
    return run.lower(params, ids).compile().memory_analysis().temp_size_in_bytes


def plain_grad(model, ids):
    """The gradient of the batch's summed loss: what a step without clipping computes."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def total(params):
        merged = nnx.merge(graphdef, params, rest)
        return jnp.sum(jax.vmap(next_token_loss, in_axes=(None, 0))(merged, ids))

    return jax.grad(total)(params)


def test_compiled_memory_within_1_2x_of_the_plain_gradient(family):
    # Issue 35's target, at 1.1-2.7 MB of parameters (1 layer, width 128, 1024 tokens; Qwen
    # 3's experts 1.5 MB), 8 sequences of 32 tokens: measured 1.00x (Llama 3, Gemma 3) and
    # 1.02x (Qwen 3). A fallback exceeds it: the experts' `gate_proj` through a random 0/1
    # mask (`gate_proj * mask`, no ghost rule) measured 2.34x, the embedding through one
    # 2.10x; warnings as errors besides.
    # `pytest tests/test_clipping_tunix.py -k memory -s` prints the figures.
    name, model = family[:2]
    ids = jax.random.randint(jax.random.PRNGKey(0), (8, 32), 0, VOCAB)
    with no_fallback():
        clipped = temp_bytes(jhooks.clipped_grad(next_token_loss, 1.0), model, ids)
    base = temp_bytes(plain_grad, model, ids)
    print(f"\n{name}: clipped_grad {clipped} B, plain gradient {base} B: {clipped / base:.3f}x")
    assert clipped <= 1.2 * base, (clipped, base)

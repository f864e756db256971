"""The clipping tests' oracle: per-example gradients by `jax.vmap` of `eqx.filter_grad`,
their norms, and the weighted sum (what `jhooks.clipped_grad` avoids materialising),
and the comparison of `clipped_grad` against it."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jhooks

RTOL = 1e-5


def hard(norms, c):
    return jnp.minimum(1, c / norms)


def reference(loss, max_norm, in_axes=(None, 0, 0), weigh=hard, group_of=None, padding=None):
    """Per-example gradients, their norms, and the weighted sum: what clipped_grad avoids.
    `group_of(path)` names each leaf's group (norms per group, a dict), `padding` marks
    examples weighed 0."""

    def run(model, *batch):
        per = jax.vmap(eqx.filter_grad(loss), in_axes=in_axes)(model, *batch)
        flat, tree = jax.tree_util.tree_flatten_with_path(per)
        names = [None if group_of is None else group_of(jax.tree_util.keystr(p)) for p, _ in flat]
        sq: dict = {}
        for name, (_, g) in zip(names, flat):
            sq[name] = sq.get(name, 0) + jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)))
        norms = {k: jnp.sqrt(v) for k, v in sq.items()}
        limits = max_norm if isinstance(max_norm, dict) else {k: max_norm for k in norms}
        w = {k: weigh(norms[k], limits[k]) for k in norms}
        if padding is not None:
            w = {k: jnp.where(padding, 0.0, v) for k, v in w.items()}
        out = [jnp.tensordot(w[k], g, 1) for k, (_, g) in zip(names, flat)]
        return jax.tree.unflatten(tree, out), (norms[None] if group_of is None else norms)

    return run


def assert_close(got, want, rtol=RTOL):
    """Same structure, shapes and dtypes, every number finite, equal to `rtol` (of the
    largest magnitude of each leaf, too)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.all(np.isfinite(a))
        scale = float(jnp.max(jnp.abs(b))) or 1.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def assert_matches(
    loss,
    model,
    batch,
    max_norm,
    maybe_jit,
    in_axes=(None, 0, 0),
    *,
    rtol=RTOL,
    norm_atol=0.0,
    passes=None,
    ghost=True,
):
    """clipped_grad against the reference: norms to `rtol` (plus `norm_atol` times the
    largest norm), clipped sums to `rtol`, every number finite; with `ghost`, no warning
    (a ghost rule, no per-example fallback). Returns clipped_grad's `(grads, norms)`."""
    with warnings.catch_warnings():
        if ghost:
            warnings.simplefilter("error")
        fn = jhooks.clipped_grad(loss, max_norm, in_axes=in_axes, passes=passes)
        grads, norms = maybe_jit(fn)(model, *batch)
    ref_grads, ref_norms = eqx.filter_jit(reference(loss, max_norm, in_axes))(model, *batch)
    assert np.all(np.isfinite(norms)), norms
    atol = norm_atol * float(jnp.max(ref_norms))
    np.testing.assert_allclose(norms, ref_norms, rtol=rtol, atol=atol)
    assert_close(grads, ref_grads, rtol)
    return grads, norms


def nnx_reference(loss, model, batch):
    """A Flax NNX model's per-example gradients of its `nnx.Param`s by
    `jax.vmap(jax.grad)` (jitted) over `batch`'s leading axis, and their norms."""
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def params_loss(params, example):
        return loss(nnx.merge(graphdef, params, rest), example)

    per = jax.jit(jax.vmap(jax.grad(params_loss), in_axes=(None, 0)))(params, batch)
    leaves = jax.tree.leaves(per)
    norms = jnp.sqrt(sum(jnp.sum(g**2, axis=tuple(range(1, g.ndim))) for g in leaves))
    return per, norms

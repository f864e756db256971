"""Hooks at operation addresses and the user's `jax.vmap`: one meaning of a hook's value.

`jhooks.ops(model, x)` lists one example's operations. A hook at an address sees that
value when the vmap is around the run (`jax.vmap(lambda x: jhooks.run_with_hooks(...))`),
and is refused where it would see the batched operation instead (a model called under a
vmap inside the run's function), with the message a point's hook gets where it would see
one example: never a patch of one index on the wrong axis. The oracle is a twin with the
edit written into the model's code by hand.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stacks import Looped, Scanned

import jhooks

T, D = 5, 8


class Attn(eqx.Module):
    qkv: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    zero_head: int | None = eqx.field(static=True, default=None)  # the hand-edited twin

    def __call__(self, x):
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        q, k, v = (a.reshape(T, self.heads, D // self.heads) for a in (q, k, v))
        pattern = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k), axis=-1)
        if self.zero_head is not None:
            pattern = pattern.at[self.zero_head].set(0.0)
        return jnp.einsum("hqk,khd->qhd", pattern, v).reshape(T, D)


class Layer(eqx.Module):
    attn: Attn

    def __call__(self, x):
        return x + self.attn(x)


def models(heads, zero_head=None):
    attn = Attn(eqx.nn.Linear(D, 3 * D, key=jax.random.PRNGKey(heads)), heads, zero_head)
    stacked = jax.tree.map(lambda a: a[None] if eqx.is_array(a) else a, Layer(attn))
    return Looped([Layer(attn)]), Scanned(stacked)


def xs_data(batch):
    return jnp.asarray(np.random.default_rng(batch).normal(size=(batch, T, D)).astype(np.float32))


# (batch, heads): 3 examples of 2 heads, and 4 of 4, where an index on the wrong axis
# would not raise.
SHAPES = [(3, 2), (4, 4)]


ADDRESSES = {"plain": "layers.0.attn/softmax", "scanned": "layers.attn/softmax"}


@pytest.mark.parametrize("kind", ["plain", "scanned"])
@pytest.mark.parametrize("batch,heads", SHAPES)
def test_with_the_vmap_around_the_run_an_address_hook_sees_one_example(
    batch, heads, kind, maybe_jit
):
    xs = xs_data(batch)
    which = 0 if kind == "plain" else 1
    model = jhooks.hookable(models(heads)[which])
    twin = models(heads, zero_head=1)[which]
    address = ADDRESSES[kind]
    listed = {op.address: op.shape for op in jhooks.ops(model, xs[0])}
    assert listed[address] == (heads, T, T)
    seen = []

    def zero_head_1(pattern, name):
        seen.append(pattern.shape)
        return pattern.at[1].set(0.0)

    def run(x):
        return jhooks.run_with_hooks(model, x, fwd_hooks=[(address, zero_head_1)])

    out = maybe_jit(jax.vmap(run))(xs)
    assert seen == [(heads, T, T)]  # as jhooks.ops lists it
    np.testing.assert_allclose(out, jax.vmap(twin)(xs), rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, jax.vmap(model)(xs), atol=1e-3)  # the patch did something


def _per_example(model, address, hooks_kind, hook):
    """The run with the vmap around it: the reference meaning of a hook."""
    return jax.vmap(lambda x: jhooks.run_with_hooks(model, x, **{hooks_kind: [(address, hook)]}))


@pytest.mark.parametrize("kind", ["plain", "scanned"])
@pytest.mark.parametrize("batch,heads", SHAPES)
def test_under_the_users_vmap_around_the_model_a_hook_sees_one_example(
    batch, heads, kind, maybe_jit
):
    """`run_with_hooks(jax.vmap(model), xs)`: hooks at an address, at a module's point
    and at a point under the model's own vmap see what they see with the vmap around
    the run (one example, as `jhooks.ops(model, x)` lists it); forward hooks equal the
    hand-edited twin, backward hooks the per-example run's gradient, and the cache is
    the per-example cache stacked."""
    xs = xs_data(batch)
    which = 0 if kind == "plain" else 1
    model = jhooks.hookable(models(heads)[which])
    twin = models(heads, zero_head=1)[which]
    layer = "layers.0" if kind == "plain" else "layers"
    address = ADDRESSES[kind]
    seen = []

    def zero_head_1(value, name):
        seen.append((str(name), value.shape))
        return value.at[1].set(0.0)

    out = maybe_jit(
        lambda xs: jhooks.run_with_hooks(jax.vmap(model), xs, fwd_hooks=[(address, zero_head_1)])
    )(xs)
    assert seen == [(address, (heads, T, T))]  # as jhooks.ops(model, x) lists it
    np.testing.assert_allclose(out, jax.vmap(twin)(xs), rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, jax.vmap(model)(xs), atol=1e-3)  # the patch did something
    # Backward hooks at the address, at the attention's output and at `qkv`'s output
    # (under the model's own vmap over positions: (T, 3D), as without the user's vmap).
    for name, shape in [
        (address, (heads, T, T)),
        (f"{layer}.attn", (T, D)),
        (f"{layer}.attn.qkv", (T, 3 * D)),
    ]:
        seen.clear()

        def loss(xs, name=name):
            return jhooks.run_with_hooks(jax.vmap(model), xs, bwd_hooks=[(name, zero_head_1)]).sum()

        grad = maybe_jit(jax.grad(loss))(xs)
        assert seen == [(name, shape)]
        expected = jax.grad(
            lambda xs, name=name: _per_example(model, name, "bwd_hooks", zero_head_1)(xs).sum()
        )(xs)
        np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-6)
        assert not np.allclose(grad, jax.grad(lambda xs: jax.vmap(model)(xs).sum())(xs), atol=1e-4)
    # The cache: the per-example cache, stacked along the batch (inside the scan, along
    # the layers first, as a scan's points are).
    names = [address, f"{layer}.attn", f"{layer}.attn.qkv"]
    _, cache = maybe_jit(lambda xs: jhooks.run_with_cache(jax.vmap(model), xs, names_filter=names))(
        xs
    )
    _, per_example = jax.vmap(lambda x: jhooks.run_with_cache(model, x, names_filter=names))(xs)
    for name in names:
        expected = per_example[name] if kind == "plain" else jnp.moveaxis(per_example[name], 0, 1)
        np.testing.assert_allclose(cache[name], expected, rtol=1e-6, atol=1e-7)


def test_nested_user_vmaps_and_unbatched_arguments(maybe_jit):
    """`jax.vmap(jax.vmap(model))`, and a vmap with an argument that is the same for
    every example (`in_axes=(0, None)`): hooks see one example."""
    model = jhooks.hookable(models(2)[0])
    xs = xs_data(6).reshape(2, 3, T, D)
    address = ADDRESSES["plain"]
    twin = models(2, zero_head=1)[0]

    def zero_head_1(pattern, name):
        assert pattern.shape == (2, T, T)
        return pattern.at[1].set(0.0)

    hooks = [(address, zero_head_1), ("layers.0.attn", lambda out, name: out * 2.0)]
    out = maybe_jit(
        lambda xs: jhooks.run_with_hooks(jax.vmap(jax.vmap(model)), xs, fwd_hooks=hooks)
    )(xs)
    expected = jax.vmap(jax.vmap(lambda x: x + 2.0 * twin.layers[0].attn(x)))(xs)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)

    def scaled(x, s):
        return model(x * s)

    out = maybe_jit(
        lambda xs, s: jhooks.run_with_hooks(
            jax.vmap(scaled, in_axes=(0, None)), xs, s, fwd_hooks=hooks
        )
    )(xs[0], 0.5)
    expected = jax.vmap(lambda x: x * 0.5 + 2.0 * twin.layers[0].attn(x * 0.5))(xs[0])
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "scanned"])
def test_ops_lists_one_example_of_a_model_under_the_users_vmap(which):
    """`jhooks.ops(jax.vmap(model), xs)` lists what a run's hooks see there: the
    operations of `jhooks.ops(model, x)`, one example's shapes."""
    model = jhooks.hookable(models(2)[which])
    xs = xs_data(3)
    one = [(op.address, op.shape) for op in jhooks.ops(model, xs[0])]
    assert ("layers.0.attn/softmax" if which == 0 else "layers.attn/softmax", (2, T, T)) in one
    assert [(op.address, op.shape) for op in jhooks.ops(jax.vmap(model), xs)] == one
    listed = [(op.address, op.shape) for op in jhooks.ops(lambda xs: jax.vmap(model)(xs) * 2.0, xs)]
    assert listed == [*one, ("/mul", (3, T, D))]


def _refusal(hook, address, why):
    return (
        rf"run_with_hooks: hook \S*{hook} selects operation '{re.escape(address)}', which is "
        rf"inside a jax.vmap in the function, {why}.* call the run inside the vmap "
        r"\(jax.vmap\(lambda x: jhooks.run_with_hooks\(...\)\)\), where hooks see one example."
    )


def test_where_an_address_is_not_one_example_the_hook_is_refused(maybe_jit):
    """An operation of a plain function under the user's vmap (no module to trace one
    example of), and an address that the model call under the vmap and the rest of the
    function both make (counted from the first in the model's call, as jhooks.ops does,
    and on from there in the function): refused, naming the hook; caching works."""
    xs = xs_data(3)

    def plain(x):
        return jax.nn.softmax(x, axis=-1) @ x.T

    def keep(value, name):
        return value

    with pytest.raises(
        ValueError, match=_refusal("keep", "/softmax", "outside every hookable module")
    ):
        maybe_jit(
            lambda xs: jhooks.run_with_hooks(jax.vmap(plain), xs, fwd_hooks=[("/softmax", keep)])
        )(xs)
    _, cache = maybe_jit(
        lambda xs: jhooks.run_with_cache(jax.vmap(plain), xs, names_filter="/softmax")
    )(xs)
    assert cache["/softmax"].shape == (3, T, D)
    model = jhooks.hookable(models(2)[0])

    def twice(xs):
        return jax.vmap(model)(xs) + model(xs[0])

    for address in (ADDRESSES["plain"], ADDRESSES["plain"] + ":1"):
        with pytest.raises(ValueError, match=_refusal("keep", address, "around a model's call")):
            maybe_jit(
                lambda xs, a=address: jhooks.run_with_hooks(twice, xs, fwd_hooks=[(a, keep)])
            )(xs)
    # Once under the vmap, and a module's point the rest of the function does not make:
    # one example, as above.
    out = maybe_jit(
        lambda xs: jhooks.run_with_hooks(
            lambda xs: jax.vmap(model)(xs) + jnp.tanh(xs),
            xs,
            fwd_hooks=[(ADDRESSES["plain"], keep)],
        )
    )(xs)
    np.testing.assert_allclose(out, jax.vmap(model)(xs) + jnp.tanh(xs), rtol=1e-6, atol=1e-6)


def test_what_a_hook_keeps_under_the_users_vmap_is_given_back_stacked():
    """`acts.append(value)` in a hook at a point under the user's vmap: the list gets
    every example's value stacked, batch axis first, as the cache holds it (in a run
    that selects no operation: where one does, points are hooked while the function is
    traced for addresses, and what they keep is warned of, as without a vmap)."""
    model = jhooks.hookable(models(2)[0])
    xs = xs_data(3)
    kept = []

    def keep(value, name):
        kept.append(value)
        return value * 1.0

    out = jhooks.run_with_hooks(jax.vmap(model), xs, fwd_hooks=[("layers.0.attn", keep)])
    np.testing.assert_allclose(out, jax.vmap(model)(xs), rtol=1e-6, atol=1e-6)
    _, cache = jax.vmap(lambda x: jhooks.run_with_cache(model, x, names_filter="layers.0.attn"))(xs)
    assert len(kept) == 1 and isinstance(kept[0], jax.Array)
    np.testing.assert_allclose(kept[0], cache["layers.0.attn"], rtol=1e-6, atol=1e-7)


def test_no_tracer_is_left_under_the_users_vmap(frozen_gc):
    model = jhooks.hookable(models(2)[1])
    xs = xs_data(3)
    hooks = [(ADDRESSES["scanned"], lambda v, name: v * 2.0), ("layers.attn", lambda v, n: -v)]
    with jax.checking_leaks():
        out = jhooks.run_with_hooks(jax.vmap(model), xs, fwd_hooks=hooks)
        grad = jax.grad(
            lambda xs: jhooks.run_with_hooks(jax.vmap(model), xs, bwd_hooks=hooks).sum()
        )(xs)
    expected = jax.vmap(lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=hooks))(xs)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    expected = jax.grad(
        lambda xs: jax.vmap(lambda x: jhooks.run_with_hooks(model, x, bwd_hooks=hooks))(xs).sum()
    )(xs)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-6)


class _Normed(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __call__(self, x, state):
        return self.bn(jax.nn.relu(self.lin(x)), state)


def test_a_stateful_layer_under_the_users_vmap_with_an_axis_name(maybe_jit):
    """Equinox's `BatchNorm` (a `pmean` over the vmap's axis name, its state unbatched:
    `in_axes=(0, None)`, `out_axes=(0, None)`): a hook at an address sees one example,
    and output and cache equal the run with the vmap around it."""
    model, state = eqx.nn.make_with_state(_Normed)(
        eqx.nn.Linear(D, 4, key=jax.random.PRNGKey(0)), eqx.nn.BatchNorm(4, "batch", mode="batch")
    )
    model = jhooks.hookable(model)
    xs = xs_data(3)[:, 0]
    shapes = []

    def square(value, name):  # not affine: the normalization does not undo it
        shapes.append(value.shape)
        return value**2

    def run(x, s):
        return jhooks.run_with_cache(
            lambda x, s: jhooks.run_with_hooks(model, x, s, fwd_hooks=[("/relu", square)]),
            x,
            s,
            names_filter=["/relu", "bn"],
        )

    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    (out, new_state), cache = maybe_jit(
        lambda x, s: jhooks.run_with_cache(
            lambda x, s: jhooks.run_with_hooks(batched, x, s, fwd_hooks=[("/relu", square)]),
            x,
            s,
            names_filter=["/relu", "bn"],
        )
    )(xs, state)
    assert shapes == [(4,)]
    (expected, _), per_example = jax.vmap(
        run, axis_name="batch", in_axes=(0, None), out_axes=((0, None), 0)
    )(xs, state)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cache["/relu"], per_example["/relu"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(cache["bn"][0], per_example["bn"][0], rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, batched(xs, state)[0], atol=1e-3)  # the hook did something


@pytest.mark.parametrize(
    "wrap",
    [
        lambda m: jax.jit(jax.vmap(m)),
        # `jax.jit(m)` itself is no function JAX can call here (it hashes the Equinox
        # list: TypeError, plain `jax.vmap(jax.jit(m))(xs)` too); the run calls the
        # user's own function since issue 43, where it used to rebuild it without the jit.
        lambda m: jax.vmap(jax.jit(lambda x: m(x))),
        lambda m: jax.checkpoint(jax.vmap(m)),
        lambda m: jax.vmap(jax.checkpoint(lambda x: m(x))),  # an Equinox list: no hash
    ],
    ids=["jit-vmap", "vmap-jit", "checkpoint-vmap", "vmap-checkpoint"],
)
def test_the_users_vmap_with_a_jit_or_checkpoint_around_or_inside(wrap):
    """The user's vmap inside or around a `jax.jit` or `jax.checkpoint` of the model, in
    the run's function: the hook at the address sees one example, as the twin."""
    model = jhooks.hookable(models(2)[0])
    twin = models(2, zero_head=1)[0]
    xs = xs_data(3)

    def zero_head_1(pattern, name):
        assert pattern.shape == (2, T, T)
        return pattern.at[1].set(0.0)

    out = jhooks.run_with_hooks(wrap(model), xs, fwd_hooks=[(ADDRESSES["plain"], zero_head_1)])
    np.testing.assert_allclose(out, jax.vmap(twin)(xs), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "scanned"])
def test_the_users_vmap_compiles_to_the_program_of_the_vmap_around_the_run(which):
    """Tracing the model's call on one example costs nothing in the program: the
    compiled operations of the run with the vmap inside equal those with it around."""
    model = jhooks.hookable(models(4)[which])
    xs = xs_data(4)
    address = ADDRESSES["plain" if which == 0 else "scanned"]

    def zero_head_1(pattern, name):
        return pattern.at[1].set(0.0)

    hooks = [(address, zero_head_1)]
    inside = jax.jit(lambda xs: jhooks.run_with_hooks(jax.vmap(model), xs, fwd_hooks=hooks))
    around = jax.jit(jax.vmap(lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=hooks)))

    def operations(fn):
        text = fn.lower(xs).compile().as_text()
        return sorted(re.findall(r"= \S+ (\w[\w-]*)\(", text))

    compiled = operations(inside)
    assert len(compiled) > 20 and compiled == operations(around)
    np.testing.assert_allclose(inside(xs), around(xs), rtol=1e-6, atol=1e-6)

"""Selecting operations: what a glob's `*` matches in an address, hooks at an operation
with several outputs (`split`), and the source line of a function JAX jitted.

The oracles are the model's own modules called by hand (the residual stream after each
layer) and the edit written out in plain JAX.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stacks import Looped

import jhooks

T, D = 5, 8


def rope(x):
    """Rotary embedding, a plain function the attention calls: an `add` of its own."""
    half = x.shape[-1] // 2
    pos = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None]
    angles = pos * (1.0 / 100.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate(
        [x1 * jnp.cos(angles) - x2 * jnp.sin(angles), x1 * jnp.sin(angles) + x2 * jnp.cos(angles)],
        -1,
    )


class Attn(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear

    def __call__(self, x):
        q, k = rope(jax.vmap(self.q)(x)), rope(jax.vmap(self.k)(x))
        return jax.nn.softmax(q @ k.T / np.sqrt(D), axis=-1) @ x


class Layer(eqx.Module):
    attn: Attn
    mlp: eqx.nn.Linear

    def __call__(self, x):
        x = x + self.attn(x)
        return x + jax.vmap(self.mlp)(jnp.tanh(x))


def model_and_x():
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 6))
    layers = [
        Layer(
            Attn(eqx.nn.Linear(D, D, key=next(keys)), eqx.nn.Linear(D, D, key=next(keys))),
            eqx.nn.Linear(D, D, key=next(keys)),
        )
        for _ in range(2)
    ]
    x = jnp.asarray(np.random.default_rng(1).normal(size=(T, D)).astype(np.float32))
    return jhooks.hookable(Looped(layers)), x


def test_a_star_in_an_address_matches_one_segment_of_the_path(maybe_jit):
    model, x = model_and_x()
    addresses = [op.address for op in jhooks.ops(model, x)]
    # The second `add` of a layer is its MLP's residual; the attention has one too, in the
    # second call of `rope` (on the keys), one module below.
    assert {"layers.0/add:1", "layers.0.attn/add:1", "layers.1/add:1"} <= set(addresses)

    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(model, x, names_filter="layers.*/add:1"))(
        x
    )
    assert sorted(cache) == ["layers.0/add:1", "layers.1/add:1"]
    residual = model.layers[0](x)  # the residual stream after each layer, by hand
    np.testing.assert_allclose(cache["layers.0/add:1"], residual, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cache["layers.1/add:1"], model.layers[1](residual), atol=1e-6)

    # A hook there edits the residual stream only, not the rotary embedding.
    def double(value, name):
        return 2.0 * value

    out = maybe_jit(
        lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("layers.*/add:1", double)])
    )(x)
    expected = 2.0 * model.layers[1](2.0 * model.layers[0](x))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)

    # `**` matches any part of the path: both adds, and every module's softmax.
    _, cache = maybe_jit(
        lambda x: jhooks.run_with_cache(model, x, names_filter=["layers.**/add:1", "**/softmax"])
    )(x)
    assert sorted(cache) == [
        "layers.0.attn/add:1",
        "layers.0.attn/softmax",
        "layers.0/add:1",
        "layers.1.attn/add:1",
        "layers.1.attn/softmax",
        "layers.1/add:1",
    ]
    # `*` alone is one segment: the root's operations and single-segment paths only.
    with pytest.raises(ValueError, match=r"no operation at address '\*/softmax'"):
        jhooks.run_with_cache(model, x, names_filter="*/softmax")


def halves(x):
    a, b = jnp.split(x, 2)
    c, d = jax.lax.split(x, (3, 5))
    return jnp.tanh(a) * b, c.sum() + d


@pytest.mark.parametrize("container", [list, tuple])
@pytest.mark.parametrize("address", ["/split", "/split:1"])
def test_a_hook_at_a_split_returns_a_list_or_a_tuple(address, container, maybe_jit):
    x = jnp.arange(1.0, 9.0, dtype=jnp.float32) / 8.0

    def edit(parts, name):
        assert isinstance(parts, list)
        if address == "/split":
            return container(reversed(parts))
        return container([2.0 * parts[0], parts[1]])

    out = maybe_jit(lambda x: jhooks.run_with_hooks(halves, x, fwd_hooks=[(address, edit)]))(x)
    if address == "/split":  # the halves swapped
        expected = (jnp.tanh(x[4:]) * x[:4], x[:3].sum() + x[3:])
    else:  # the first piece doubled
        expected = (jnp.tanh(x[:4]) * x[4:], 2.0 * x[:3].sum() + x[3:])
    for o, e in zip(out, expected):
        np.testing.assert_allclose(o, e, rtol=1e-6)


def test_a_wrong_return_at_a_split_names_the_hook_the_operation_and_what_was_expected():
    x = jnp.arange(8.0, dtype=jnp.float32)

    def first_only(parts, name):
        return parts[0]

    def one_short(parts, name):
        return (parts[0],)

    for hook in (first_only, one_short):
        expected = (
            rf"hook {re.escape(hook.__qualname__)} at operation '/split' returned .*, expected "
            r"None or a list or tuple of the operation's 2 outputs, like \[float32\[4\], "
            r"float32\[4\]\]"
        )
        with pytest.raises(ValueError, match=expected):
            jhooks.run_with_hooks(halves, x, fwd_hooks=[("/split", hook)])

    def wrong_shape(parts, name):
        return (parts[0], parts[1][:2])

    with pytest.raises(
        ValueError, match=r"hook .*\.wrong_shape at operation '/split' returned activation "
    ):
        jhooks.run_with_hooks(halves, x, fwd_hooks=[("/split", wrong_shape)])


def jitted_by_jax(x):
    a = jax.nn.silu(x)
    b = jax.nn.silu(a)  # the same function again, in a row: another operation
    c = jnp.clip(b, -0.5, 0.5)
    return jax.nn.gelu(c)


def test_a_function_jax_jitted_shows_the_users_line():
    listed = jhooks.ops(jitted_by_jax, jnp.ones(4, jnp.float32))
    first = jitted_by_jax.__code__.co_firstlineno
    where = {op.address: op.source for op in listed}
    assert where == {
        "/silu": f"tests/test_operations_select.py:{first + 1}",
        "/silu:1": f"tests/test_operations_select.py:{first + 2}",
        "/clip": f"tests/test_operations_select.py:{first + 3}",
        "/gelu": f"tests/test_operations_select.py:{first + 4}",
    }

"""`jhooks.attribution`'s scores come in the order the model reached its points (issue 44),
eagerly and under `jax.jit`, for every kind of node: hook points, hookable modules'
paths and operation addresses, mixed in one model.

The scores were once returned with their names sorted (the clean-equals-corrupt step
mapped the dict with `jax.tree.map`, and the caller's `jax.jit` sorts a dict's keys).
The expected order is the model's, read from `run_with_cache`'s cache, and written out.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import jhooks


class Block(jhooks.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        h = jhooks.hook_point(x, "hook_in")
        y = jnp.tanh(self.lin(h))
        return x + jhooks.hook_point(y, "hook_out")


class Net(jhooks.Module):
    embed: eqx.nn.Linear
    blocks: list
    unembed: eqx.nn.Linear

    def __call__(self, x):
        r = self.embed(x)
        for block in self.blocks:
            r = block(r)
        return self.unembed(jhooks.hook_point(r, "hook_final"))


_KEYS = jax.random.split(jax.random.PRNGKey(0), 4)
NET = Net(
    eqx.nn.Linear(3, 4, key=_KEYS[0]),
    [Block(eqx.nn.Linear(4, 4, key=k)) for k in _KEYS[1:3]],
    eqx.nn.Linear(4, 2, key=_KEYS[3]),
)
CLEAN = jnp.array([1.0, 2.0, 3.0])
CORRUPT = jnp.array([-1.0, 0.5, 2.0])

# Every kind of node, listed in an order that is neither the model's nor sorted.
MIXED = ["hook_final", "**/tanh", "blocks.*.lin", "blocks.*/add", "embed", "blocks.*.hook_in"]
MIXED_REACHED = [
    "embed",
    "blocks.0.hook_in",
    "blocks.0.lin",
    "blocks.0/tanh",
    "blocks.0/add",
    "blocks.1.hook_in",
    "blocks.1.lin",
    "blocks.1/tanh",
    "blocks.1/add",
    "hook_final",
]
# nodes=None: every point (hook points and modules' outputs; no operations).
EVERY_REACHED = [
    "embed",
    "blocks.0.hook_in",
    "blocks.0.lin",
    "blocks.0.hook_out",
    "blocks.0",
    "blocks.1.hook_in",
    "blocks.1.lin",
    "blocks.1.hook_out",
    "blocks.1",
    "hook_final",
    "unembed",
]


def metric(y):
    return y[0] - 2.0 * y[1]


def reached(nodes):
    """The names a cache of the clean run holds, in the order the model reached them."""
    _, cache = jhooks.run_with_cache(NET, CLEAN, names_filter=nodes)
    return list(cache)


def test_the_expected_orders_are_the_caches():
    assert reached(MIXED) == MIXED_REACHED
    assert reached(None) == EVERY_REACHED
    assert sorted(MIXED_REACHED) != MIXED_REACHED


ATP, LAYER_IG = dict(), dict(method="ig", steps=2)
INPUT_IG = dict(method="ig", steps=2, interpolate="embed")  # along the input's path


@pytest.mark.parametrize(
    "nodes, options",
    [
        ("mixed", ATP),
        ("mixed", LAYER_IG),
        ("mixed", INPUT_IG),
        ("mixed", dict(per_example=True)),
        ("every", ATP),
        ("every", INPUT_IG),
    ],
    ids=["atp", "layer_ig", "input_ig", "atp_per_example", "every_atp", "every_input_ig"],
)
def test_scores_come_in_the_order_the_points_were_reached(maybe_jit, nodes, options):
    select, expected = (MIXED, MIXED_REACHED) if nodes == "mixed" else (None, EVERY_REACHED)
    clean, corrupt = CLEAN, CORRUPT
    if options.get("per_example"):
        clean, corrupt = jnp.stack([CLEAN, CORRUPT + 1.0]), jnp.stack([CORRUPT, CLEAN])
    scores = maybe_jit(lambda c, k: jhooks.attribution(metric, NET, c, k, nodes=select, **options))(
        clean, corrupt
    )
    assert list(scores) == expected
    # A node's scores sum its features away: one number per node (and per example).
    shape = (2,) if options.get("per_example") else ()
    assert {name: jnp.shape(s) for name, s in scores.items()} == dict.fromkeys(expected, shape)


def test_edges_come_reader_by_reader_in_the_order_reached(maybe_jit):
    writers, readers = ["embed", "blocks.*.hook_out"], ["blocks.*.hook_in", "hook_final"]
    scores = maybe_jit(
        lambda c, k: jhooks.attribution(
            metric, NET, c, k, edges=True, writers=writers, readers=readers
        )
    )(CLEAN, CORRUPT)
    assert list(scores) == [
        ("embed", "blocks.0.hook_in"),
        ("embed", "blocks.1.hook_in"),
        ("blocks.0.hook_out", "blocks.1.hook_in"),
        ("embed", "hook_final"),
        ("blocks.0.hook_out", "hook_final"),
        ("blocks.1.hook_out", "hook_final"),
    ]

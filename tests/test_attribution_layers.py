"""`jhooks.attribution` on a model that scans over its layers, and exact zeros.

- a `lax.scan` over stacked layer weights against the same model unrolled (a Python loop
  over layers): AtP, integrated gradients with `interpolate`, layer integrated gradients
  (one layer patched at a time, `jhooks.loop_index` in the patch) and GradDrop (one
  layer's gradient dropped at a time) score every layer, stacked as caches are, equal to
  the unrolled model's layer by layer; AtP*'s queries and keys (one run patching every
  layer) and edges are refused, naming the node and the remedy, as is a GradDrop entry
  selecting points inside different loops;
- clean equal to corrupted gives exactly 0 for every method, on a GPT-2-shaped model
  whose two runs XLA rounds differently;
- AtP*'s keys shared by several query heads raise, naming the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks
from benchmarks.attribution_models import READERS, WRITERS, gpt, init_gpt

KEY = jax.random.PRNGKey(0)
LAYERS = 3
W = 0.4 * jax.random.normal(KEY, (LAYERS, 4, 4))
CLEAN = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
CORRUPT = jax.random.normal(jax.random.PRNGKey(2), (3, 4))


def layer(r, w, point):
    h = point(r, "in")
    return r + point(jnp.tanh(h @ w), "out")


def scanned(x):
    r = jhooks.hook_point(x, "embed")
    r, _ = jax.lax.scan(lambda r, w: (layer(r, w, jhooks.hook_point), None), r, W)
    return jhooks.hook_point(r, "final")


def unrolled(x):
    r = jhooks.hook_point(x, "embed")
    for i in range(LAYERS):
        r = layer(r, W[i], lambda v, name, i=i: jhooks.hook_point(v, f"{name}{i}"))
    return jhooks.hook_point(r, "final")


def total(y):
    return jnp.sum(y * jnp.arange(4.0))


UNROLLED_NODES = [f"{kind}{i}" for i in range(LAYERS) for kind in ("in", "out")]


def _scores_as_the_unrolled_model(maybe_jit, options, twin_options):
    """`attribution` of `scanned` with `options` equals that of `unrolled` with
    `twin_options`, stacked per layer (a scanned point is one layer per iteration)."""
    ours = maybe_jit(
        lambda c, k: jhooks.attribution(total, scanned, c, k, nodes=["in", "out"], **options)
    )(CLEAN, CORRUPT)
    twin = maybe_jit(
        lambda c, k: jhooks.attribution(total, unrolled, c, k, nodes=UNROLLED_NODES, **twin_options)
    )(CLEAN, CORRUPT)
    for kind in ("in", "out"):
        expected = np.stack([twin[f"{kind}{i}"] for i in range(LAYERS)])
        assert ours[kind].shape == expected.shape  # (layers, *the unrolled node's scores)
        assert not np.allclose(expected, 0.0)
        np.testing.assert_allclose(ours[kind], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [dict(), dict(method="ig", interpolate="embed", steps=3), dict(sum_axes=())],
    ids=["atp", "ig-inputs", "atp-every-element"],
)
def test_scanned_layers_score_as_the_unrolled_model_layer_by_layer(maybe_jit, options):
    _scores_as_the_unrolled_model(maybe_jit, options, options)


@pytest.mark.parametrize(
    "options",
    [
        dict(method="ig", steps=3),
        dict(method="ig", steps=2, rule="riemann_trapezoid", sum_axes=()),
        dict(graddrop=["out", "final"]),
        dict(graddrop=["in", "embed"], sum_axes=()),
    ],
    ids=["layer-ig", "layer-ig-every-element", "graddrop-out", "graddrop-in"],
)
def test_one_scanned_layer_at_a_time_as_the_unrolled_model(maybe_jit, options):
    """Layer integrated gradients patch layer i's node in iteration i only; GradDrop drops
    the gradient through one iteration at a time: the unrolled twin's numbers, per layer."""
    twin_options = dict(options)
    if "graddrop" in options:  # a scanned point is one layer per iteration
        twin_options["graddrop"] = [
            f"{name}{i}" if name in ("in", "out") else name
            for name in options["graddrop"]
            for i in (range(LAYERS) if name in ("in", "out") else [0])
        ]
    _scores_as_the_unrolled_model(maybe_jit, options, twin_options)


W4 = 0.4 * jax.random.normal(KEY, (2, 2, 4, 4))  # 2 groups of 2 layers


def nested(x):
    r = jhooks.hook_point(x, "embed")

    def group(r, ws):
        return jax.lax.scan(lambda r, w: (layer(r, w, jhooks.hook_point), None), r, ws)

    r, _ = jax.lax.scan(group, r, W4)
    return jhooks.hook_point(r, "final")


def flat(x):
    r = jhooks.hook_point(x, "embed")
    for i in range(4):
        r = layer(r, W4[i // 2, i % 2], lambda v, name, i=i: jhooks.hook_point(v, f"{name}{i}"))
    return jhooks.hook_point(r, "final")


def test_nested_scans_per_example_and_chunked_steps_as_the_unrolled_model(maybe_jit):
    """Two loops around a node (a row per layer is a pair of indices), examples under
    `jax.vmap` and the steps in a `lax.scan` over chunks of one (a loop of attribution's
    own around the model's): the unrolled twin's numbers, per layer."""
    nodes = [f"{kind}{i}" for i in range(4) for kind in ("in", "out")]
    for options, twin_options in [
        (dict(method="ig", steps=3), dict(method="ig", steps=3)),
        (dict(graddrop=["out", "final"]), dict(graddrop=[f"out{i}" for i in range(4)] + ["final"])),
    ]:
        ours = maybe_jit(
            lambda c, k, options=options: jhooks.attribution(
                total, nested, c, k, nodes=["in", "out"], **options
            )
        )(CLEAN, CORRUPT)
        twin = jhooks.attribution(total, flat, CLEAN, CORRUPT, nodes=nodes, **twin_options)
        for kind in ("in", "out"):
            expected = np.stack([twin[f"{kind}{i}"] for i in range(4)]).reshape(2, 2, -1)
            np.testing.assert_allclose(ours[kind], expected, rtol=1e-5, atol=1e-6)
    clean, corrupt = jnp.stack([CLEAN, CORRUPT]), jnp.stack([CORRUPT, CLEAN])
    options = dict(method="ig", steps=3, batch_size=1, per_example=True)
    ours = maybe_jit(
        lambda c, k: jhooks.attribution(total, scanned, c, k, nodes=["in", "out"], **options)
    )(clean, corrupt)
    twin = jhooks.attribution(total, unrolled, clean, corrupt, nodes=UNROLLED_NODES, **options)
    for kind in ("in", "out"):
        expected = np.stack([twin[f"{kind}{i}"] for i in range(LAYERS)], axis=1)
        assert ours[kind].shape == expected.shape == (2, LAYERS, 3)
        np.testing.assert_allclose(ours[kind], expected, rtol=1e-5, atol=1e-6)


def test_layer_ig_in_a_scan_sums_to_each_layers_own_patch():
    """Completeness, per layer: layer i's scores sum to the effect of patching layer i
    alone (a hook reading `loop_index`), not every layer at once."""
    ours = jhooks.attribution(
        total, scanned, CLEAN, CORRUPT, nodes="out", method="ig", steps=32,
        rule="riemann_trapezoid",
    )  # fmt: skip
    clean_out = jhooks.run_with_cache(scanned, CLEAN, names_filter="out")[1]["out"]

    def patched(i):
        def patch(value, name):
            (layer,) = jhooks.loop_index()
            return jnp.where(layer == i, clean_out[i], value)

        return total(jhooks.run_with_hooks(scanned, CORRUPT, fwd_hooks=[("out", patch)]))

    effects = np.array([patched(i) - total(scanned(CORRUPT)) for i in range(LAYERS)])
    np.testing.assert_allclose(ours["out"].sum(axis=-1), effects, rtol=0.01, atol=0.01)
    everywhere = total(jhooks.run_with_hooks(scanned, CORRUPT, fwd_hooks=[("out", lambda v, n: v)]))
    every_layer = total(
        jhooks.run_with_hooks(
            scanned, CORRUPT, fwd_hooks=[("out", lambda v, n: clean_out[jhooks.loop_index()[0]])]
        )
    )
    assert not np.allclose(effects.sum(), every_layer - everywhere, atol=0.1)


def test_edges_and_mixed_graddrop_entries_in_a_scan_are_refused_by_name(maybe_jit):
    def run(**kw):
        return maybe_jit(lambda c, k: jhooks.attribution(total, scanned, c, k, **kw))(
            CLEAN, CORRUPT
        )

    with pytest.raises(
        ValueError,
        match=r"edges=True\): reader 'in' is reached inside a loop .*stacked \(3,\).*cannot "
        r"tell the edges of one layer from another's.*write the layers unrolled",
    ):
        run(edges=True, writers=["embed", "out"], readers=["in", "final"])
    with pytest.raises(
        ValueError,
        match=r"graddrop=\): '\*' selects points inside different loops \('embed' \(\), "
        r"'final' \(\), 'in' \(3,\), 'out' \(3,\): the lengths of the loops around each\)"
        r".*Name the points of one loop in an entry of their own",
    ):
        run(nodes="in", graddrop=["*", "final"])


def head(r, w, point):
    """One saturated attention head: queries, keys, scores and pattern points."""
    q = point(r @ w, "q")
    k = point(r @ w.T, "k")
    scores = point(4.0 * q @ k.T, "scores")
    pattern = point(jax.nn.softmax(scores, axis=-1), "pattern")
    return r + pattern @ r


def scanned_heads(x):
    return jax.lax.scan(lambda r, w: (head(r, w, jhooks.hook_point), None), x, W[:2])[0]


def unrolled_heads(x):
    for i in range(2):
        x = head(x, W[i], lambda v, name, i=i: jhooks.hook_point(v, f"{name}{i}"))
    return x


def test_atp_star_inside_a_scan_scores_per_layer_and_refuses_queries(maybe_jit):
    with pytest.raises(
        ValueError,
        match=r"method='atp\*'\) patches each node of queries= and keys= in a run of its "
        r"own: 'q' is reached inside a loop .*\(2, 3, 4\).*\(3, 4\)\. .*every layer at once"
        r".*write the layers unrolled",
    ):
        maybe_jit(
            lambda c, k: jhooks.attribution(
                total, scanned_heads, c, k, nodes="q", method="atp*",
                softmax={"scores": "pattern"}, queries={"q": "scores"},
            )
        )(CLEAN, CORRUPT)  # fmt: skip
    # Its scores points are scored per element, per layer (no run of their own), as the
    # unrolled model's.
    star = maybe_jit(
        lambda c, k: jhooks.attribution(
            total, scanned_heads, c, k, nodes="scores", method="atp*",
            softmax={"scores": "pattern"}, sum_axes=(),
        )
    )(CLEAN, CORRUPT)  # fmt: skip
    twin = jhooks.attribution(
        total, unrolled_heads, CLEAN, CORRUPT, nodes=["scores0", "scores1"], method="atp*",
        softmax={"scores0": "pattern0", "scores1": "pattern1"}, sum_axes=(),
    )  # fmt: skip
    expected = np.stack([twin["scores0"], twin["scores1"]])
    assert star["scores"].shape == expected.shape == (2, 3, 3)
    np.testing.assert_allclose(star["scores"], expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected[0], 0.0)


# A GPT-2-shaped model: its clean run (a forward pass) and corrupted run (with its
# gradient) are two programs that XLA rounds differently.
GPT = init_gpt(jax.random.PRNGKey(3), layers=2, heads=2, d_model=8, d_head=4, d_mlp=16)
PROMPTS = jax.random.randint(jax.random.PRNGKey(4), (2, 6), 0, 11)
ANSWERS = jnp.stack([PROMPTS[:, 0], (PROMPTS[:, 0] + 1) % 11], axis=1)
NODES = ["hook_embed", "blocks.*.attn.hook_result", "blocks.*.hook_mlp_*", "hook_resid_final"]


def gpt_model(tokens):
    return gpt(GPT, tokens)


def answer_diff(logits, answers):
    return logits[-1, answers[0]] - logits[-1, answers[1]]


@pytest.mark.parametrize(
    "options",
    [
        dict(nodes=NODES),
        dict(nodes=["blocks.1.attn.hook_result", "hook_resid_final"], method="ig", steps=2),
        dict(nodes=NODES, method="ig", interpolate="hook_embed", steps=2),
        dict(edges=True, writers=WRITERS, readers=READERS),
        dict(edges=True, writers=WRITERS, readers=READERS, method="ig", steps=2),
    ],
    ids=["atp", "ig", "ig-inputs", "eap", "eap-ig"],
)
def test_clean_equal_to_corrupt_gives_exactly_zero_on_a_gpt(maybe_jit, options):
    # Row 0: clean equal to corrupted (two arrays, equal); row 1: one token changed.
    corrupt = PROMPTS.at[1, 2].set((PROMPTS[1, 2] + 3) % 11)
    clean = jnp.array(np.array(PROMPTS))
    scores = maybe_jit(
        lambda c, k, a: jhooks.attribution(
            answer_diff, gpt_model, c, k, metric_args=(a,), per_example=True, **options
        )
    )(clean, corrupt, ANSWERS)
    assert len(scores) >= 2
    for s in scores.values():
        assert np.all(np.asarray(s[0]) == 0.0)
    assert any(np.any(np.asarray(s[1]) != 0.0) for s in scores.values())
    if "method" not in options and "edges" not in options:  # one example, not mapped
        one = jhooks.attribution(
            answer_diff, gpt_model, clean[0], PROMPTS[0], metric_args=(ANSWERS[0],), **options
        )
        assert all(np.all(np.asarray(s) == 0.0) for s in one.values())


def grouped_query_head(x):
    """Two query heads sharing one key head (grouped-query attention)."""
    q = jhooks.hook_point(jnp.einsum("pd,hde->phe", x, jnp.stack([W[0], W[1]])), "q")
    k = jhooks.hook_point(jnp.einsum("pd,de->pe", x, W[2])[:, None], "k")  # [pos, 1, d]
    scores = jhooks.hook_point(jnp.einsum("qhe,kge->hqk", q, k), "scores")
    return jnp.einsum("hqk,kd->qhd", jhooks.hook_point(jax.nn.softmax(scores), "pattern"), x)


def test_keys_shared_by_query_heads_raise_naming_the_layout(maybe_jit):
    # docs/attribution.md: keys that several query heads share are not AtP*'s layout.
    with pytest.raises(
        ValueError,
        match=r"the key node 'k' has scores of shape \(3, 1\).*'scores' \(2, 3, 3\) gives "
        r"one score per key position and head, \(3, 2\)",
    ):
        maybe_jit(
            lambda c, k: jhooks.attribution(
                total, grouped_query_head, c, k, nodes="k", method="atp*",
                softmax={"scores": "pattern"}, keys={"k": "scores"},
            )
        )(CLEAN, CORRUPT)  # fmt: skip

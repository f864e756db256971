"""`jhooks.attribution` and `jhooks.splice`, against brute-force patching and PyTorch.

- exactness: on a linear residual network EAP's edges into the output sum to the change
  of the metric and each edge equals patching that edge alone; clean == corrupt gives
  zeros; layer integrated gradients add up to the patching effect of their node;
- AtP over every head and position ranks like jhooks' own patching sweep;
- AtP* on a saturated attention head, GradDrop on a constructed cancellation;
- per-example scores by `vmap` equal a loop; one compiled program per plan;
- EAP-IG on a GPT-2-shaped model equals a PyTorch twin scored by a re-implementation
  of the EAP-IG repository's algorithm (hannamw/EAP-IG, `attribute.py`);
- splicing an autoencoder: the output bit for bit, the features' attributions.
"""

from __future__ import annotations

import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks
from benchmarks.attribution_models import MASKED, READERS, WRITERS, gpt, init_gpt, repeats

KEY = jax.random.PRNGKey(0)


def assert_close(actual, expected, tol):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


# A residual network: each layer reads the stream at its own point and writes into it.
LAYER_W = [0.4 * jax.random.normal(k, (4, 4)) for k in jax.random.split(KEY, 3)]
WRITE = ["embed", "out0", "out1", "out2"]
READ = ["in0", "in1", "in2", "final"]


def residual_net(x, act=lambda h: h):
    r = jhooks.hook_point(x, "embed")
    for i, w in enumerate(LAYER_W):
        h = jhooks.hook_point(r, f"in{i}")
        r = r + jhooks.hook_point(act(h @ w), f"out{i}")
    return jhooks.hook_point(r, "final")


def total(y):
    return jnp.sum(y * jnp.arange(4.0))


CLEAN = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
CORRUPT = jax.random.normal(jax.random.PRNGKey(2), (3, 4))


def patched(fn, metric, clean, corrupt, name, select=lambda v: v):
    """metric(fn(corrupt)) with point `name` given its clean value (where `select` says)."""
    _, cache = jhooks.run_with_cache(fn, clean, names_filter=name)

    def patch(value, _):
        return select(value, cache[name])

    return metric(jhooks.run_with_hooks(fn, corrupt, fwd_hooks=[(name, patch)]))


def test_linear_edges_sum_to_the_change_and_equal_edge_patching(maybe_jit):
    edges = maybe_jit(
        lambda c, k: jhooks.attribution(
            total, residual_net, c, k, edges=True, writers=WRITE, readers=READ
        )
    )(CLEAN, CORRUPT)
    change = total(residual_net(CLEAN)) - total(residual_net(CORRUPT))
    into_output = sum(s for (u, v), s in edges.items() if v == "final")
    assert_close(into_output, change, 1e-6)
    assert len(edges) == 4 + 3 + 2 + 1
    _, clean_cache = jhooks.run_with_cache(residual_net, CLEAN)
    _, corrupt_cache = jhooks.run_with_cache(residual_net, CORRUPT)
    base = total(residual_net(CORRUPT))
    for (u, v), score in edges.items():
        # The edge alone: reader v sees writer u's clean value, everything else corrupted.
        delta = clean_cache[u] - corrupt_cache[u]

        def add(x, _, delta=delta):
            return x + delta

        out = jhooks.run_with_hooks(residual_net, CORRUPT, fwd_hooks=[(v, add)])
        assert_close(score, total(out) - base, 1e-5)


@pytest.mark.parametrize(
    "options",
    [
        dict(nodes=WRITE + READ),
        dict(nodes=WRITE + READ, method="ig", steps=3),
        dict(nodes=["in1"], method="ig", interpolate="embed", steps=3),
        dict(edges=True, writers=WRITE, readers=READ),
        dict(edges=True, writers=WRITE, readers=READ, method="ig", steps=3),
        dict(nodes=["out0", "out1"], graddrop=["out1", "out2"]),
    ],
    ids=["atp", "ig", "ig-inputs", "eap", "eap-ig", "graddrop"],
)
def test_clean_equal_to_corrupt_gives_exactly_zero(options):
    scores = jhooks.attribution(total, lambda x: residual_net(x, jnp.tanh), CLEAN, CLEAN, **options)
    assert scores
    for s in scores.values():
        assert np.all(np.asarray(s) == 0.0)


def test_layer_ig_adds_up_to_patching_its_node(maybe_jit):
    def net(x):
        return residual_net(x, jnp.tanh)

    nodes = ["out0", "in1", "out1", "final"]
    scores = maybe_jit(
        lambda c, k: jhooks.attribution(
            total, net, c, k, nodes=nodes, method="ig", steps=24, rule="riemann_trapezoid"
        )
    )(CLEAN, CORRUPT)
    base = total(net(CORRUPT))
    for name in nodes:
        effect = patched(net, total, CLEAN, CORRUPT, name, lambda v, c: c) - base
        assert abs(float(jnp.sum(scores[name]) - effect)) <= 0.01 * abs(float(effect))
    # EAP-IG's inputs: the embedding moves, every run follows; its scores add up to the
    # whole change.
    inputs = jhooks.attribution(
        total, net, CLEAN, CORRUPT, nodes=["embed"], method="ig", interpolate="embed",
        steps=24, rule="riemann_trapezoid", batch_size=5,
    )  # fmt: skip
    change = total(net(CLEAN)) - base
    assert abs(float(jnp.sum(inputs["embed"]) - change)) <= 0.01 * abs(float(change))


def spearman(a, b):
    ranks = [np.argsort(np.argsort(np.ravel(x))) for x in (a, b)]
    return np.corrcoef(*ranks)[0, 1]


def logit_diff(logits, answer=3, wrong=5):
    return logits[-1, answer] - logits[-1, wrong]


def test_atp_ranks_like_the_patching_sweep():
    # Every head at every position of a 2-layer attention-only model: AtP's magnitudes
    # rank the nodes as patching each one alone does (Kramar et al. rank by |effect|).
    params = init_gpt(KEY, layers=2, mlp=False, max_len=8, scale=0.3)
    clean = jnp.array([1, 4, 2, 7, 1, 4, 2, 9])
    corrupt = jnp.array([1, 6, 2, 8, 1, 6, 2, 9])

    def model(tokens):
        return gpt(params, tokens)

    scores = jhooks.attribution(logit_diff, model, clean, corrupt, nodes="blocks.*.attn.hook_z")
    atp = jnp.stack([scores[f"blocks.{i}.attn.hook_z"] for i in range(2)])  # [layer, pos, head]

    @jax.jit
    def sweep():
        _, cache = jhooks.run_with_cache(model, clean, names_filter="blocks.*.attn.hook_z")
        base = logit_diff(model(corrupt))

        def effect(index):
            layer, pos, head = index // 32, (index // 4) % 8, index % 4

            def patch(z, name):
                here = layer == int(name.split(".")[1])
                return z.at[pos, head].set(jnp.where(here, cache[name][pos, head], z[pos, head]))

            out = jhooks.run_with_hooks(model, corrupt, fwd_hooks=[("blocks.*.attn.hook_z", patch)])
            return logit_diff(out) - base

        return jax.lax.map(effect, jnp.arange(64)).reshape(2, 8, 4)

    exact = sweep()
    assert float(jnp.max(jnp.abs(exact))) > 0.1  # the prompts differ where it matters
    assert spearman(jnp.abs(atp), jnp.abs(exact)) >= 0.9


def saturated_attention(scores):
    s = jhooks.hook_point(scores, "scores")
    pattern = jhooks.hook_point(jax.nn.softmax(s, axis=-1), "pattern")
    return pattern @ jnp.array([1.0, -2.0, 0.5, 3.0])


def test_atp_star_recomputes_a_saturated_softmax(maybe_jit):
    # One head, two queries: the corrupted run attends to key 0 (saturated), the clean
    # run to key 1 (query 0) or key 3 (query 1).
    corrupt = jnp.array([[12.0, 0.0, 0.0, 0.0], [0.0, 0.0, 12.0, 1.0]])
    clean = jnp.array([[0.0, 12.0, 0.0, 0.0], [0.0, 0.0, 1.0, 12.0]])

    def metric(out):
        return jnp.sum(out * jnp.array([1.0, 0.5]))

    def scores_of(method, **kw):
        return maybe_jit(
            lambda c, k: jhooks.attribution(
                metric, saturated_attention, c, k, nodes="scores", method=method, sum_axes=(), **kw
            )["scores"]
        )(clean, corrupt)

    atp = scores_of("atp")
    star = scores_of("atp*", softmax={"scores": "pattern"})
    base = metric(saturated_attention(corrupt))
    exact = np.zeros((2, 4))
    for q, t in itertools.product(range(2), range(4)):
        patched_scores = corrupt.at[q, t].set(clean[q, t])
        exact[q, t] = metric(saturated_attention(patched_scores)) - base

    def error(estimate):
        return np.linalg.norm(np.asarray(estimate) - exact) / np.linalg.norm(exact)

    assert error(atp) >= 0.5
    assert error(star) <= 0.05


# Two heads over four positions whose softmax saturates (scores of tens), causally
# masked with -inf: a query or key patched moves the pattern from one key to another.
QK_KEYS = jax.random.split(jax.random.PRNGKey(7), 4)
WQ, WK, WV = (1.5 * jax.random.normal(k, (2, 4, 4)) for k in QK_KEYS[:3])
READOUT = jax.random.normal(QK_KEYS[3], (4, 2, 4))
CAUSAL = jnp.tril(jnp.ones((4, 4), bool))


def attend(q, k, v, point=jhooks.hook_point):
    s = point(jnp.where(CAUSAL, jnp.einsum("qhe,khe->hqk", q, k), -jnp.inf), "scores")
    return jnp.einsum("hqk,khe->qhe", point(jax.nn.softmax(s, -1), "pattern"), v)


def qkv(x):
    q = jnp.einsum("pd,hde->phe", x, WQ)
    k = jnp.einsum("pd,hde->phe", x, WK)
    return q, k, jnp.einsum("pd,hde->phe", x, WV)


def saturated_head(x):
    q, k, v = qkv(x)
    return attend(jhooks.hook_point(q, "q"), jhooks.hook_point(k, "k"), v)


def unnamed_head(x):  # the same, its values addressed by operation
    return attend(*qkv(x), point=lambda value, name: value)


def readout(out):
    return jnp.sum(out * READOUT)


HEAD_CLEAN = jax.random.normal(jax.random.PRNGKey(8), (4, 4))
HEAD_CORRUPT = jax.random.normal(jax.random.PRNGKey(9), (4, 4))


def qk_patching_effects(role):
    """`[position, head]`: the readout's change when the query (key) of one position
    and head takes its clean value in the corrupted run, everything else corrupted."""
    q, k, v = qkv(HEAD_CORRUPT)
    clean = qkv(HEAD_CLEAN)[role]
    base = readout(attend(q, k, v))
    effects = np.zeros((4, 2))
    for p, h in itertools.product(range(4), range(2)):
        patched = [q, k, v]
        patched[role] = patched[role].at[p, h].set(clean[p, h])
        effects[p, h] = readout(attend(*patched)) - base
    return effects


@pytest.mark.parametrize("named", [True, False], ids=["points", "addresses"])
def test_atp_star_recomputes_the_softmax_for_queries_and_keys(maybe_jit, named):
    # Points, or the operations of the same head: jhooks.ops lists /einsum (q),
    # /einsum:1 (k), /einsum:2 (v), /einsum:3 (q.k), /where (the scores), /softmax.
    fn, q, k, s, p = (
        (saturated_head, "q", "k", "scores", "pattern")
        if named
        else (unnamed_head, "/einsum", "/einsum:1", "/where", "/softmax")
    )
    star = dict(method="atp*", softmax={s: p}, queries={q: s}, keys={k: s})

    def scores_of(clean, corrupt, **kw):
        return maybe_jit(lambda c, x: jhooks.attribution(readout, fn, c, x, nodes=[q, k], **kw))(
            clean, corrupt
        )

    atp = scores_of(HEAD_CLEAN, HEAD_CORRUPT)
    exact = scores_of(HEAD_CLEAN, HEAD_CORRUPT, **star)
    for node, role in ((q, 0), (k, 1)):
        effects = qk_patching_effects(role)
        assert np.abs(effects).max() > 1.0

        def error(estimate, effects=effects):
            return np.linalg.norm(np.asarray(estimate) - effects) / np.linalg.norm(effects)

        assert error(atp[node]) >= 0.5
        assert error(exact[node]) <= 0.05
        # The readout is linear in the pattern: the recomputation is exact.
        assert_close(exact[node], effects, 1e-5)
    if not named:
        return
    # Heads summed: patching every head of a position at once.
    per_position = scores_of(HEAD_CLEAN, HEAD_CORRUPT, sum_axes=(-2, -1), **star)
    assert_close(per_position[q], qk_patching_effects(0).sum(1), 1e-5)
    # Clean equal to corrupted: exactly zero.
    same = scores_of(HEAD_CLEAN, HEAD_CLEAN, **star)
    assert all(np.all(np.asarray(x) == 0.0) for x in same.values())


def cancelling(x):
    """`n` reaches the output through two layers whose gradients cancel at the corrupted
    value; the second saturates, so the true effect does not cancel."""
    n = jhooks.hook_point(x[0], "n")
    layer0 = jhooks.hook_point(n, "layer0")
    layer1 = jhooks.hook_point(-jnp.minimum(n, 0.5), "layer1")
    layer2 = jhooks.hook_point(jnp.tanh(x[1]), "layer2")
    layer3 = jhooks.hook_point(2.0 * x[1], "layer3")
    return layer0 + layer1 + layer2 + layer3


def test_graddrop_recovers_a_cancelled_effect(maybe_jit):
    clean, corrupt = jnp.array([2.0, 0.3]), jnp.array([0.0, 0.3])

    def metric(y):
        return y

    def run(**kw):
        return maybe_jit(
            lambda c, k: jhooks.attribution(metric, cancelling, c, k, nodes="n", **kw)["n"]
        )(clean, corrupt)

    atp = float(run())
    dropped = float(run(graddrop=["layer0", "layer1", "layer2", "layer3"]))
    true = float(metric(cancelling(clean)) - metric(cancelling(corrupt)))
    missed = abs(true) - abs(atp)
    assert missed > 1.0  # AtP misses the effect
    assert dropped - abs(atp) >= 0.5 * missed
    assert abs(dropped - abs(true)) <= 0.5 * missed
    # By hand: AtP with each layer's gradient dropped is 2 * (-1), 2 * 1, 0, 0.
    assert_close(dropped, (2.0 + 2.0) / 3, 1e-6)


# A GPT-2-shaped model (layer norms, MLPs, heads split in and out) and four prompts.
GPT = init_gpt(jax.random.PRNGKey(3), layers=2, heads=2, d_model=8, d_head=4, d_mlp=16)
PROMPTS = jax.random.randint(jax.random.PRNGKey(4), (4, 6), 0, 11)
CORRUPTED = PROMPTS.at[:, 2].set((PROMPTS[:, 2] + 3) % 11)
ANSWERS = jnp.stack([PROMPTS[:, 0], (PROMPTS[:, 0] + 1) % 11], axis=1)


def gpt_model(tokens):
    return gpt(GPT, tokens)


def answer_diff(logits, answers):
    return logits[-1, answers[0]] - logits[-1, answers[1]]


def eap_ig(clean, corrupt, answers, steps=3, **kw):
    return jhooks.attribution(
        answer_diff, gpt_model, clean, corrupt, edges=True, method="ig", steps=steps,
        writers=WRITERS, readers=READERS, metric_args=(answers,), **kw,
    )  # fmt: skip


def eap(clean, corrupt, answers, **kw):
    return jhooks.attribution(
        answer_diff, gpt_model, clean, corrupt, edges=True, writers=WRITERS, readers=READERS,
        metric_args=(answers,), **kw,
    )  # fmt: skip


def float32_bound(delta, grad):
    """How far two float32 computations of one edge's score `sum_i delta_i grad_i` (n
    terms: positions x d_model) may differ: `2 n eps sum_i |delta_i grad_i|` per entry.

    Each program's sum of n products is within `gamma_n sum |terms|`, `gamma_n ~ n eps / 2`,
    of the exact one (Higham, Accuracy and Stability of Numerical Algorithms, 3.1): the
    two, summing in different orders, differ by up to `n eps sum |terms|`. Their factors
    come from two programs too (a `vmap`ped and a single forward and backward pass) and
    differ by their own rounding, which adds `sum |d delta| |grad| + |delta| |d grad|`: on
    this model at most 43 `eps sum |terms|` (n = 48), within another `n eps sum |terms|`.
    """
    d, g = np.asarray(delta, np.float64), np.asarray(grad, np.float64)
    d = d if d.ndim == 3 else d[:, None]
    g = g if g.ndim == 3 else g[:, None]
    terms = np.einsum("paz,pbz->ab", np.abs(d), np.abs(g))
    n = d.shape[0] * d.shape[-1]
    return 2 * n * np.finfo(np.float32).eps * terms


def test_per_example_scores_by_vmap_equal_a_loop():
    batched = eap(PROMPTS, CORRUPTED, ANSWERS, per_example=True)
    # Points: 5 writers, 9 readers; pairs of a writer and a later reader: 3*1 + 2 + 3*3 + 4 + 5.
    assert len(batched) == 23
    for i in range(len(PROMPTS)):
        one = eap(PROMPTS[i], CORRUPTED[i], ANSWERS[i])
        assert list(one) == list(batched)
        _, clean = jhooks.run_with_cache(gpt_model, PROMPTS[i])
        _, corrupt = jhooks.run_with_cache(
            lambda t, i=i: answer_diff(gpt_model(t), ANSWERS[i]), CORRUPTED[i], incl_bwd=True
        )
        for (u, v), score in one.items():
            bound = float32_bound(clean[u] - corrupt[u], corrupt[v + "_grad"])
            error = np.abs(np.asarray(batched[(u, v)][i]) - np.asarray(score))
            assert np.all(error.reshape(bound.shape) <= bound), (u, v, error, bound)


def test_one_program_per_plan():
    traced = []

    def metric(y, weights):
        traced.append(1)
        return jnp.sum(y * weights)

    def run(i, **kw):
        return jhooks.attribution(
            metric, residual_net, CLEAN + i, CORRUPT, nodes=["out0", "in2"],
            metric_args=(jnp.arange(4.0) + i,), **kw,
        )  # fmt: skip

    first = run(0)
    per_trace = len(traced)
    assert per_trace >= 1
    second = run(1)
    run(2)
    assert len(traced) == per_trace  # new arrays: the same program
    assert not np.allclose(first["out0"], second["out0"])
    run(1, method="ig", steps=2)
    with_ig = len(traced)
    assert with_ig > per_trace
    run(2, method="ig", steps=2)
    assert len(traced) == with_ig
    run(3, method="ig", steps=3)  # another number of steps: another program
    assert len(traced) > with_ig


# PyTorch: the same model, and the EAP-IG repository's algorithm (hannamw/EAP-IG,
# `src/eap/attribute.py`, `get_scores_eap_ig`, at commit 795f560): the activation
# differences (corrupted - clean) of the writers kept in one [position, writers, d_model]
# tensor by forward hooks, the input moved from corrupted to clean in `steps` runs, each
# reader's gradient contracted against the writers before it by backward hooks. The
# runs are at k / steps for `for step in range(0, steps)` since commit 13c0033
# (2025-02-23), k = 1..steps before it (2024).


class TorchGPT:
    def __init__(self, params, dtype=np.float64):
        self.p = jax.tree.map(lambda a: torch.from_numpy(np.array(a, dtype)), params)
        self.fwd, self.bwd = {}, {}

    def point(self, x, name):
        x = x.clone()  # as TransformerLens' hook_mlp_in(resid_mid.clone())
        if name in self.fwd:
            x = self.fwd[name](x)
        if name in self.bwd:
            x.register_hook(self.bwd[name])
        return x

    def __call__(self, tokens):
        p, seq = self.p, len(tokens)
        ln = torch.nn.functional.layer_norm
        x = self.point(p["wte"][tokens] + p["wpe"][:seq], "hook_embed")
        causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        for i, b in enumerate(p["blocks"]):
            heads, d, d_head = b["w_q"].shape
            qkv = []
            for kind in "qkv":  # a tensor per reader, as TransformerLens' split inputs
                h = self.point(x[:, None].expand(seq, heads, d), f"blocks.{i}.hook_{kind}_input")
                h = ln(h, (d,), b["ln1_g"], b["ln1_b"], eps=1e-5)
                qkv.append(torch.einsum("thd,hde->the", h, b[f"w_{kind}"]) + b[f"b_{kind}"])
            q, k, v = qkv
            scores = torch.einsum("qhe,khe->hqk", q, k) / math.sqrt(d_head)
            pattern = torch.where(causal, scores, torch.tensor(MASKED, dtype=scores.dtype))
            pattern = pattern.softmax(-1)
            z = torch.einsum("hqk,khe->qhe", pattern, v)
            result = self.point(
                torch.einsum("the,hed->thd", z, b["w_o"]), f"blocks.{i}.attn.hook_result"
            )
            x = x + result.sum(1) + b["b_o"]
            h = ln(self.point(x, f"blocks.{i}.hook_mlp_in"), (d,), b["ln2_g"], b["ln2_b"], eps=1e-5)
            h = torch.nn.functional.gelu(h @ b["w_in"] + b["b_in"], approximate="tanh")
            x = x + self.point(h @ b["w_out"] + b["b_out"], f"blocks.{i}.hook_mlp_out")
        x = self.point(x, "hook_resid_final")
        return ln(x, (x.shape[-1],), p["lnf_g"], p["lnf_b"], eps=1e-5) @ p["w_u"]


def reference_eap_ig(model, clean, corrupt, answers, steps, ks):
    """EAP-IG's scores, as the EAP-IG repository computes them, keyed like jhooks': the
    input at `k / steps` for each k in `ks` (`range(0, steps)` now)."""
    layers, heads = len(model.p["blocks"]), model.p["blocks"][0]["w_q"].shape[0]
    writers = [("hook_embed", None)]
    readers = []
    for i in range(layers):
        readers += [(f"blocks.{i}.hook_{k}_input", h) for k in "qkv" for h in range(heads)]
        writers += [(f"blocks.{i}.attn.hook_result", h) for h in range(heads)]
        readers += [(f"blocks.{i}.hook_mlp_in", None)]
        writers += [(f"blocks.{i}.hook_mlp_out", None)]
    readers += [("hook_resid_final", None)]
    seq, d = len(clean), model.p["wte"].shape[1]
    dtype = model.p["wte"].dtype
    difference = torch.zeros(seq, len(writers), d, dtype=dtype)
    scores = torch.zeros(len(writers), len(readers), dtype=dtype)
    scored = np.zeros(scores.shape, bool)
    first_of = {}
    for w, (name, _) in enumerate(writers):
        first_of.setdefault(name, w)

    def writer_hook(sign, name):
        def hook(x):
            start = first_of[name]
            acts = x if x.ndim == 3 else x[:, None]
            difference[:, start : start + acts.shape[1]] += sign * acts.detach()
            return x

        return hook

    # Corrupted run adds, clean run subtracts (`make_hooks_and_matrices`).
    inputs = {}
    for sign, tokens in ((1.0, corrupt), (-1.0, clean)):
        model.fwd = {name: writer_hook(sign, name) for name in first_of}
        with torch.no_grad():
            model(tokens)
        inputs[sign] = difference[:, 0].clone() if sign > 0 else None
    corrupt_input = inputs[1.0]
    clean_input = corrupt_input - difference[:, 0]

    def reader_hook(name):
        columns = [r for r, (n, _) in enumerate(readers) if n == name]
        # the writers before this reader: those reached before it in the forward pass
        before = {"hook_resid_final": len(writers)}
        for i in range(layers):
            before[f"blocks.{i}.hook_q_input"] = 1 + i * (heads + 1)
            before[f"blocks.{i}.hook_k_input"] = 1 + i * (heads + 1)
            before[f"blocks.{i}.hook_v_input"] = 1 + i * (heads + 1)
            before[f"blocks.{i}.hook_mlp_in"] = 1 + i * (heads + 1) + heads
        prev = before[name]

        def hook(grad):
            g = grad if grad.ndim == 3 else grad[:, None]
            s = torch.einsum("pfd,pbd->fb", difference[:, :prev], g)
            scores[:prev, columns] += s
            scored[:prev, columns] = True

        return hook

    for k in ks:

        def interpolate(x, k=k):
            new = corrupt_input + (k / steps) * (clean_input - corrupt_input)
            return new.requires_grad_(True)

        model.fwd = {"hook_embed": interpolate}
        model.bwd = {name: reader_hook(name) for name in dict.fromkeys(n for n, _ in readers)}
        logits = model(clean)
        (logits[-1, answers[0]] - logits[-1, answers[1]]).backward()
    model.fwd, model.bwd = {}, {}
    scores /= steps
    return scores, scored, writers, readers


@pytest.mark.parametrize(
    "rule, ks, other",
    [(None, range(0, 5), range(1, 6)), ("riemann_right", range(1, 6), range(0, 5))],
    ids=["default-as-the-repository-now", "riemann_right-as-in-2024"],
)
def test_eap_ig_equals_the_eap_ig_algorithm_on_a_pytorch_twin(maybe_jit, rule, ks, other):
    # The default reproduces the repository's current code (range(0, steps):
    # riemann_left); rule="riemann_right" its 2024 code (range(1, steps + 1)). The twin
    # runs in float64: the difference is jhooks' float32 rounding.
    steps = 5
    kw = {} if rule is None else dict(rule=rule)
    ours = maybe_jit(lambda c, k, a: eap_ig(c, k, a, steps=steps, **kw))(
        PROMPTS[0], CORRUPTED[0], ANSWERS[0]
    )
    twin = TorchGPT(GPT)
    logits = twin(torch.from_numpy(np.array(PROMPTS[0])))
    assert logits.dtype == torch.float64
    assert_close(gpt_model(PROMPTS[0]), logits.detach(), 1e-5)
    tokens = [torch.from_numpy(np.array(t)) for t in (PROMPTS[0], CORRUPTED[0])]
    answers = [int(a) for a in ANSWERS[0]]
    ref, scored, writers, readers = reference_eap_ig(twin, *tokens, answers, steps, ks)
    wrong = reference_eap_ig(twin, *tokens, answers, steps, other)[0]
    checked, apart = 0, 0.0
    for (u, v), score in ours.items():
        rows = [i for i, (n, _) in enumerate(writers) if n == u]
        cols = [j for j, (n, _) in enumerate(readers) if n == v]
        expected = ref[rows][:, cols].numpy()
        # EAP-IG's difference is corrupted - clean; jhooks' clean - corrupted.
        assert_close(np.reshape(score, expected.shape), -expected, 1e-5)
        apart = max(apart, float(np.max(np.abs(expected - wrong[rows][:, cols].numpy()))))
        checked += expected.size
    # every pair the reference scores (the writers before each reader) is in ours
    assert checked == int(np.count_nonzero(scored))
    # The other rule's scores are far outside that tolerance: the test tells them apart.
    assert apart > 100 * 1e-5


class SAE(eqx.Module):
    w_enc: jax.Array
    b_enc: jax.Array
    w_dec: jax.Array
    b_dec: jax.Array

    def encode(self, x):
        return jax.nn.relu((x - self.b_dec) @ self.w_enc + self.b_enc)

    def decode(self, features):
        return features @ self.w_dec + self.b_dec


def make_sae(key, d, width):
    k1, k2, k3 = jax.random.split(key, 3)
    return SAE(
        jax.random.normal(k1, (d, width)) / math.sqrt(d),
        -0.1 * jnp.ones(width),
        jax.random.normal(k2, (width, d)) / math.sqrt(width),
        0.1 * jax.random.normal(k3, (d,)),
    )


SAE_POINT = "blocks.0.hook_mlp_out"


def test_splice_keeps_the_output_bitwise(maybe_jit):
    sae = make_sae(jax.random.PRNGKey(5), 8, 24)
    point = SAE_POINT
    spliced = jhooks.splice(gpt_model, point, sae)
    clean = PROMPTS[0]
    # Bit for bit against the unspliced model compiled the same way (a run's program
    # takes the weights as arguments; jax.jit of a closure folds them in as constants).
    plain = maybe_jit(lambda t: jhooks.run_with_hooks(gpt_model, t))(clean)
    out = maybe_jit(spliced)(clean)
    assert np.array_equal(np.asarray(plain).view(np.uint32), np.asarray(out).view(np.uint32))
    # Without the error term, the reconstruction replaces the point's value.
    lossy = jhooks.splice(gpt_model, point, sae, error_term=False)(clean)
    assert not np.allclose(lossy, plain)
    _, cache = jhooks.run_with_cache(spliced, clean, names_filter=f"{point}.sae.*")
    assert list(cache) == [f"{point}.sae.{n}" for n in ("features", "recon", "error")]


def test_spliced_features_are_scored_as_activation_times_gradient():
    sae = make_sae(jax.random.PRNGKey(5), 8, 24)
    point = SAE_POINT
    spliced = jhooks.splice(gpt_model, point, sae)
    clean, corrupt = PROMPTS[0], CORRUPTED[0]

    def metric(logits):
        return answer_diff(logits, ANSWERS[0])

    features = f"{point}.sae.features"
    scores = jhooks.attribution(metric, spliced, clean, corrupt, nodes=features, sum_axes=())
    scores = scores[features]

    # By hand: the features of each run, and the metric's gradient with respect to the
    # features of the corrupted run (the error a constant), their product.
    def acts(tokens):
        return jhooks.run_with_cache(gpt_model, tokens, names_filter=point)[1][point]

    def with_features(f, error):
        def patch(x, _):
            return sae.decode(f) + error

        return metric(jhooks.run_with_hooks(gpt_model, corrupt, fwd_hooks=[(point, patch)]))

    x = acts(corrupt)
    f_corrupt, f_clean = sae.encode(x), sae.encode(acts(clean))
    grad = jax.grad(with_features)(f_corrupt, x - sae.decode(f_corrupt))
    assert_close(scores, (f_clean - f_corrupt) * grad, 1e-6)
    assert float(jnp.max(jnp.abs(scores))) > 1e-3


def test_errors_name_what_was_expected():
    with pytest.raises(ValueError, match="method must be one of"):
        jhooks.attribution(total, residual_net, CLEAN, CORRUPT, nodes="in0", method="eap")
    with pytest.raises(ValueError, match=r"edges=True\) needs writers= and readers="):
        jhooks.attribution(total, residual_net, CLEAN, CORRUPT, edges=True)
    with pytest.raises(ValueError, match="softmax= is AtP\\*'s"):
        jhooks.attribution(total, residual_net, CLEAN, CORRUPT, nodes="in0", softmax={"a": "b"})
    with pytest.raises(ValueError, match="queries= is AtP\\*'s"):
        jhooks.attribution(total, residual_net, CLEAN, CORRUPT, nodes="in0", queries={"a": "b"})
    with pytest.raises(
        ValueError, match=r"keys= maps 'k' to the scores point 'scores', which softmax="
    ):
        jhooks.attribution(
            readout, saturated_head, HEAD_CLEAN, HEAD_CORRUPT, nodes="k", method="atp*",
            keys={"k": "scores"},
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"the query node 'q' has scores of shape \(4, 2, 4\)"):
        jhooks.attribution(
            readout, saturated_head, HEAD_CLEAN, HEAD_CORRUPT, nodes="q", method="atp*",
            softmax={"scores": "pattern"}, queries={"q": "scores"}, sum_axes=(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="graddrop= needs at least two layers"):
        jhooks.attribution(total, residual_net, CLEAN, CORRUPT, nodes="in0", graddrop="out0")
    with pytest.raises(ValueError, match="no hook point named 'in9'"):
        jhooks.attribution(total, residual_net, CLEAN, CORRUPT, nodes=["in9"])
    with pytest.raises(TypeError, match="must have an `encode` method"):
        jhooks.splice(residual_net, "in0", object())


def test_training_data_repeats_with_a_random_period():
    # The notebook's training batches (NumPy, drawn at once): each sequence repeats its
    # first `period` tokens, the period in (half // 2, half], and the mask marks the
    # positions whose next token is a repeat.
    half = 8
    tokens, mask = repeats(np.random.default_rng(0), (3, 50), half, 16)
    assert tokens.shape == mask.shape == (3, 50, 2 * half) and tokens.dtype == np.int32
    periods = set()
    for seq, marks in zip(tokens.reshape(-1, 2 * half), mask.reshape(-1, 2 * half)):
        period = int(np.argmax(marks)) + 1  # the first position whose next token repeats
        periods.add(period)
        np.testing.assert_array_equal(seq, np.resize(seq[:period], 2 * half))
        np.testing.assert_array_equal(marks, np.arange(2 * half) + 1 >= period)
    assert periods == set(range(half // 2 + 1, half + 1))
    # Initial weights from a NumPy generator: the same structure as from a JAX key.
    kw = dict(vocab=16, max_len=16, mlp=False, ln=False)
    from_numpy = init_gpt(np.random.default_rng(0), **kw)
    from_key = init_gpt(KEY, **kw)
    assert jax.tree.structure(from_numpy) == jax.tree.structure(from_key)
    assert [a.shape for a in jax.tree.leaves(from_numpy)] == [
        a.shape for a in jax.tree.leaves(from_key)
    ]


def test_benchmark_linearity_from_rounds():
    # benchmarks/attribution.py: t(s) = fixed + s * step in every round, the rounds
    # scaled by the load: the time per step spreads by the fixed cost alone, the cost of
    # an added step is the same from 5 to 30 and from 30 to 50.
    from benchmarks.attribution import _linearity

    loads = [1.0, 1.7, 1.2, 3.0, 1.1]
    times = {f"{s} steps": [load * (2e-3 + s * 1e-3) for load in loads] for s in (5, 30, 50)}
    rows = _linearity(times, [5, 30, 50])
    assert_close(rows["added_step_ratio"], 1.0, 1e-9)
    assert_close(rows["added_step_spread"], 1.0, 1e-9)
    assert_close(rows["per_step_spread"], (2e-3 / 5 + 1e-3) / (2e-3 / 50 + 1e-3), 1e-9)
    assert_close(rows["ms_per_added_step"], [1.2, 1.2], 1e-9)  # the median load, 1.2
    # A step that costs nothing more is not linear growth: the target is missed.
    times["50 steps"] = times["30 steps"]
    assert _linearity(times, [5, 30, 50])["added_step_spread"] == math.inf

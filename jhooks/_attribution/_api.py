"""`jhooks.attribution`: AtP, AtP*, integrated gradients, EAP and EAP-IG in one program."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from .._core import check_callable
from .._runs import run_with_hooks
from .._staging import calls_model
from ._caches import zero_if_same
from ._edges import edge_scores
from ._nodes import node_scores
from ._plan import Plan, make_plan


@jax.tree_util.register_pytree_node_class
class _Program:
    """The traced body of one attribution call: what `run_with_hooks` compiles.

    A pytree, so that the run's guards read it by content: the plan (less its
    selectors) and `per_example` in its structure, the metric, the function and the
    selectors as children. One program per plan, metric, function and structure of
    the inputs; the arrays (the model's, the inputs) are its arguments.
    """

    def __init__(self, plan: Plan, metric: Callable, fn: Callable, per_example: bool):
        self.plan, self.metric, self.fn, self.per_example = plan, metric, fn, per_example

    def tree_flatten(self) -> tuple[list, tuple]:
        plan = self.plan
        bare = dataclasses.replace(plan, nodes=None, writers=None, readers=None)
        children = [self.metric, self.fn, plan.nodes, plan.writers, plan.readers]
        return children, (bare, self.per_example)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: list) -> _Program:
        bare, per_example = aux
        metric, fn, nodes, writers, readers = children
        plan = dataclasses.replace(bare, nodes=nodes, writers=writers, readers=readers)
        return cls(plan, metric, fn, per_example)

    def __call__(self, clean: Any, corrupt: Any, metric_args: tuple) -> tuple[dict, tuple]:
        # The names in the order reached (dicts come back from vmap and jit sorted).
        order: list[tuple] = []

        def one(clean: Any, corrupt: Any, metric_args: tuple) -> dict:
            scores = self.one(clean, corrupt, metric_args)
            order.append(tuple(scores))
            return scores

        if self.per_example:
            scores = jax.vmap(one)(clean, corrupt, metric_args)
        else:
            scores = one(clean, corrupt, metric_args)
        return scores, order[0]

    def one(self, clean: Any, corrupt: Any, metric_args: tuple) -> dict:
        metric, fn = self.metric, self.fn

        # It calls the model: operations that the model makes here are the model's, so
        # that runs of the objective select them by address. (A closure: with a
        # functools.partial here, benchmarks/attribution.py's AtP program ran 2x slower.)
        @calls_model
        def objective(x: Any) -> jax.Array:
            return metric(fn(x), *metric_args)

        scores = edge_scores if self.plan.edges else node_scores
        # Clean equal to corrupted: exactly 0, whatever the two programs' rounding.
        return zero_if_same(clean, corrupt, scores(self.plan, objective, fn, clean, corrupt))


def attribution(
    metric: Callable[..., Any],
    fn: Callable[[Any], Any],
    clean: Any,
    corrupt: Any,
    *,
    nodes: None | str | Sequence[str] | Callable[[str], bool] = None,
    method: str = "atp",
    edges: bool = False,
    writers: None | str | Sequence[str] | Callable[[str], bool] = None,
    readers: None | str | Sequence[str] | Callable[[str], bool] = None,
    steps: int = 5,
    rule: str = "riemann_left",
    batch_size: int | None = None,
    interpolate: str | None = None,
    sum_axes: None | int | Sequence[int] = (-1,),
    softmax: Mapping[str, str] | None = None,
    queries: Mapping[str, str] | None = None,
    keys: Mapping[str, str] | None = None,
    graddrop: None | str | Sequence[str] = None,
    per_example: bool = False,
    metric_args: tuple = (),
) -> dict:
    """Attribution scores of nodes (or edges) for the change from `corrupt` to `clean`.

    Attribution patching (AtP, Nanda; Kramar et al. 2024), AtP*, integrated gradients
    (captum's layer integrated gradients), edge attribution patching (EAP, Syed et al.)
    and EAP-IG (Hanna et al.), computed in one compiled program per plan.

    **Arguments:**

    - `metric`: `metric(output, *metric_args) -> scalar` (a logit difference...).
    - `fn`: the function (a model): `fn(clean)` and `fn(corrupt)` are its two runs.
    - `clean`, `corrupt`: the two inputs (any pytree; tokens). Each node must have one
        shape in both runs: prompts of different lengths raise a `ValueError` naming
        the node and its shapes (pad them to one length).
    - `nodes`: the points scored: names, glob patterns, a list of those or a predicate,
        as `run_with_cache`'s `names_filter` takes them: a [`jhooks.hook_point`][] or a
        hookable module's path is a node. `None`: every point. A point holding only
        integers (token ids, positions) has no score and is left out; a pytree point's
        integer leaves score `None`. A name matching no point raises
        `attribution (nodes): no hook point named ...` (likewise for the other options).
        A node inside a `lax.scan` over layers is scored per layer, stacked as in caches,
        by AtP, AtP*'s scores points, GradDrop and `"ig"` (without `interpolate`, one
        layer moved at a time); `queries`, `keys` and edges there raise a `ValueError`
        naming it.
    - `method`: `"atp"`: `(clean - corrupt) * dmetric/da` at the corrupted run;
        `"atp*"`: AtP with the attention softmax named in `softmax=` recomputed
        exactly for its scores, and for the queries and keys named in `queries=` and
        `keys=`; `"ig"`: the gradient integrated along the path from the
        corrupted to the clean value in `steps` points.
    - `edges`: score the edges from `writers` to `readers` instead of nodes
        (`"atp"`: EAP, `"ig"`: EAP-IG).
    - `writers`, `readers`: with `edges=True`, the points that write into the residual
        stream (`[position, ..., d_model]`: the embedding, each head's result, each MLP's
        output) and those that read it (each layer's input points, the unembedding's).
        An edge goes from a writer to each reader reached after it.
    - `steps`: `"ig"`'s number of points on the path (5 by default, as EAP-IG uses).
    - `rule`: where those points are: `"riemann_left"` (`k / steps`, k = 0..steps-1:
        the EAP-IG repository's `get_scores_eap_ig` since February 2025, the default),
        `"riemann_right"` (k = 1..steps: its 2024 code, and its node and activation
        IG), `"riemann_middle"` or `"riemann_trapezoid"`.
    - `batch_size`: how many points of the path run together (under `jax.vmap`, in a
        `lax.scan` over chunks): memory does not grow with `steps`. 1 by default.
    - `interpolate`: for `"ig"`, one point that moves along the path while the rest of
        the run follows (EAP-IG's inputs: the embedding), all nodes' gradients
        integrated along the same runs. `None` (nodes): each node moves alone (layer
        integrated gradients); with `edges=True`, the first writer reached.
    - `sum_axes`: the axes of a node's value its score sums over: the last (features,
        `d_model`, `d_head`) by default, so `[position, head, d_head]` scores
        `[position, head]`; `()` keeps every element, `None` sums everything.
    - `softmax`: for `"atp*"`, `{scores_point: pattern_point}`: points holding attention
        scores (`[..., query, key]`) and their softmax over the last axis. A scores
        point among `nodes` is scored per element by recomputing the softmax with that
        element patched.
    - `queries`, `keys`: for `"atp*"`, `{node: scores_point}`: points holding the
        queries (keys) of an attention, `[position, *heads, features]`, and the point
        of `softmax=` holding the scores they make, `[*heads, query, key]`. Such a node
        among `nodes` is scored per position and head by recomputing the scores with it
        patched (one run) and the softmax of each row exactly.
    - `graddrop`: for `"atp"`/`"atp*"`, points (each layer's output) through which the
        gradient is dropped in turn; the scores become Kramar et al.'s GradDrop
        magnitudes, `sum over layers |AtP with that gradient dropped| / (layers - 1)`.
        A point inside a `lax.scan` over `L` layers is `L` layers, dropped in turn.
    - `per_example`: `clean`, `corrupt` and `metric_args` have a leading axis of
        examples; the scores are computed for each, under `jax.vmap`, and stacked.
    - `metric_args`: extra arguments of `metric` (the answer tokens).

    **Returns:**

    A dict from node name to its scores (a dict from `(writer, reader)` to the edge's
    scores with `edges=True`), in the order the points were reached (an
    `OrderedDict`, so that the order holds under `jax.jit` and `jax.vmap` too); with
    `per_example=True`, each with a leading axis of examples. Scores sum to an estimate
    of `metric(clean) - metric(corrupt)` patched at that node: swap `clean` and
    `corrupt` for the other direction (Kramar et al.'s AtP patches the corrupted value
    into the clean run).

    **Example:**

    ```python
    def logit_diff(logits):
        return logits[-1, answer] - logits[-1, wrong]

    scores = jhooks.attribution(logit_diff, model, clean, corrupt, nodes="blocks.*.attn.hook_z")
    scores["blocks.1.attn.hook_z"]  # [position, head]
    ```
    """
    check_callable(metric, "the metric passed to jhooks.attribution")
    check_callable(fn, "the function passed to jhooks.attribution")
    if not isinstance(metric_args, tuple):
        raise TypeError(f"attribution: metric_args must be a tuple, got {metric_args!r}.")
    plan = make_plan(
        method,
        nodes,
        edges,
        writers,
        readers,
        steps,
        rule,
        batch_size,
        interpolate,
        sum_axes,
        softmax,
        queries,
        keys,
        graddrop,
    )
    program = _Program(plan, metric, fn, bool(per_example))
    try:
        scores, order = run_with_hooks(program, clean, corrupt, metric_args)
    except ValueError as error:
        options: dict[str, Any] = dict(nodes=nodes, writers=writers, readers=readers)
        options.update(interpolate=interpolate, softmax=softmax, queries=queries)
        options.update(keys=keys, graddrop=graddrop)
        renamed = _named_by_option(str(error), options)
        if renamed is None:
            raise
        raise ValueError(renamed) from None
    # An OrderedDict (a dict) keeps that order out of the caller's jax.jit or jax.vmap,
    # whose plain dicts come back with their keys sorted.
    return OrderedDict((name, scores[name]) for name in order)


# The refusal of a run whose filter or hook names no point: "run_with_cache
# (names_filter): no hook point named 'x'. ..." (or "no operation at address").
_REFUSAL = re.compile(
    r"^run_with_(?:cache|hooks) \((?:names_filter|hook [^)]*)\): "
    r"(no (?:hook point named|operation at address) ('(?:[^'\\]|\\.)*'|\"[^\"]*\"))"
)


def _named_by_option(message: str, options: dict[str, Any]) -> str | None:
    """A run's refusal of a name that matches no point, said of the option of
    `attribution` that holds the name (`"attribution (nodes): no hook point named ..."`),
    or `None` for any other error."""
    match = _REFUSAL.match(message)
    if match is None:
        return None
    name = ast.literal_eval(match.group(2))
    for option, spec in options.items():
        if isinstance(spec, Mapping):
            held = [*spec.keys(), *spec.values()]
        elif isinstance(spec, str) or spec is None or callable(spec):
            held = [spec]
        else:
            held = list(spec)
        if name in held:
            return f"attribution ({option}): {message[match.start(1) :]}"
    return None

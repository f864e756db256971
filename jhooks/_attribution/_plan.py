"""What one `jhooks.attribution` call computes, checked once: the options of its program.

Every field but the selectors (`nodes`, `writers`, `readers`) is a string, a tuple or a
number marked static: the plan is in the program's key, so a new plan compiles a new
program (a new method, number of steps), while new arrays do not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._core import static
from ._paths import RULES, alphas_and_weights

METHODS = ("atp", "atp*", "ig")


@dataclass(frozen=True)
class Plan:
    """The options of one attribution program (see `jhooks.attribution`)."""

    method: str
    nodes: Any
    edges: bool
    writers: Any
    readers: Any
    steps: int
    rule: str
    batch_size: int
    interpolate: str | None
    sum_axes: tuple[int, ...] | None
    softmax: tuple[tuple[str, str], ...]
    queries: tuple[tuple[str, str], ...]
    keys: tuple[tuple[str, str], ...]
    graddrop: tuple[str, ...]

    @property
    def exact_qk(self) -> bool:
        return self.method == "atp*"


def make_plan(
    method: str,
    nodes: Any,
    edges: bool,
    writers: Any,
    readers: Any,
    steps: int,
    rule: str,
    batch_size: int | None,
    interpolate: str | None,
    sum_axes: Any,
    softmax: Mapping[str, str] | None,
    queries: Mapping[str, str] | None,
    keys: Mapping[str, str] | None,
    graddrop: Any,
) -> Plan:
    """Checks the options of `jhooks.attribution` and makes its `Plan`."""
    if method not in METHODS:
        raise ValueError(f"attribution: method must be one of {METHODS}, got {method!r}.")
    if rule not in RULES:
        raise ValueError(f"attribution: rule must be one of {RULES}, got {rule!r}.")
    alphas_and_weights(steps, rule)  # checks steps
    if batch_size is None:
        batch_size = 1
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"attribution: batch_size must be a positive int, got {batch_size!r}.")
    if edges:
        if writers is None or readers is None:
            raise ValueError(
                "attribution(edges=True) needs writers= and readers=: the points that write "
                "into the residual stream (embedding, each head's and MLP's output) and those "
                "that read it (each layer's input points, the unembedding's input)."
            )
        if nodes is not None:
            raise ValueError(
                "attribution(edges=True) scores the edges between writers= and readers=; "
                "leave nodes= out."
            )
        if method == "atp*" or graddrop:
            raise ValueError("attribution(edges=True) takes method='atp' (EAP) or 'ig' (EAP-IG).")
    elif writers is not None or readers is not None:
        raise ValueError("attribution: writers= and readers= are for edges=True.")
    patterns = _pairs(softmax, "softmax", method, "attention scores", "their softmax (the pattern)")
    made = "the attention scores they make"
    query_pairs = _pairs(queries, "queries", method, "queries", made)
    key_pairs = _pairs(keys, "keys", method, "keys", made)
    for what, pairs in (("queries", query_pairs), ("keys", key_pairs)):
        for node, scores in pairs:
            if scores not in dict(patterns):
                raise ValueError(
                    f"attribution: {what}= maps {node!r} to the scores point {scores!r}, "
                    "which softmax= does not name: pass softmax={"
                    f"{scores!r}: <the point holding their softmax>}}."
                )
    graddrop = _names(graddrop, "graddrop")
    if graddrop and method == "ig":
        raise ValueError("attribution: graddrop= is for method='atp' or 'atp*'.")
    if len(graddrop) == 1:
        raise ValueError(
            "attribution: graddrop= needs at least two layers (the scores are divided by "
            "layers - 1)."
        )
    if interpolate is not None and method != "ig":
        raise ValueError("attribution: interpolate= is for method='ig'.")
    if sum_axes is not None:
        sum_axes = (sum_axes,) if isinstance(sum_axes, int) else tuple(sum_axes)
        if not all(isinstance(a, int) and not isinstance(a, bool) for a in sum_axes):
            raise TypeError(f"attribution: sum_axes must be ints or None, got {sum_axes!r}.")
        sum_axes = static(sum_axes) if sum_axes else ()
    return Plan(
        method=method,
        nodes=nodes,
        edges=bool(edges),
        writers=writers,
        readers=readers,
        steps=static(steps),
        rule=rule,
        batch_size=static(batch_size),
        interpolate=interpolate,
        sum_axes=sum_axes,
        softmax=patterns,
        queries=query_pairs,
        keys=key_pairs,
        graddrop=graddrop,
    )


def _pairs(
    spec: Mapping[str, str] | None, what: str, method: str, keys: str, values: str
) -> tuple[tuple[str, str], ...]:
    pairs = tuple(dict(spec or {}).items())
    if pairs and method != "atp*":
        raise ValueError(f"attribution: {what}= is AtP*'s; pass method='atp*'.")
    for key, value in pairs:
        if not (isinstance(key, str) and isinstance(value, str)):
            raise TypeError(
                f"attribution: {what}= maps the name of a point holding {keys} to the name "
                f"of the point holding {values}, got {key!r}: {value!r}."
            )
    return pairs


def _names(spec: Any, what: str) -> tuple[str, ...]:
    if spec is None:
        return ()
    names = (spec,) if isinstance(spec, str) else tuple(spec)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"attribution: {what}= takes point names, got {spec!r}.")
    return names

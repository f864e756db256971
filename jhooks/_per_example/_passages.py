"""How a parameter passes an equation that is neither a view nor a use.

- *region*: a static slice of the parameter (`W[:, :k]`, `E[i]` with a static `i`, one
  output of `jnp.split`), not already sliced, broadcast or derived: its uses are sites of
  their own (`_sites.Region`).
- *gathered*: whole matrices of the parameter picked by index (`W[expert_ids]`): a
  product that uses them is a site of its own (`_gathered`).
- *shift*: adding or subtracting a value that does not depend on the example (`1 + scale`,
  `scale - 1`, `1 - scale`): the gradient of `c + W` is that of `W` (of `c - W`, minus
  it), so the value keeps the parameter's rule, sites included (Gemma's `x * (1 + scale)`).
- *derived*: an elementwise function of the parameter alone (`exp`, `tanh`, a power...),
  or with values that do not depend on the example (`W * mask`, `max(W, 0)`), or a slice
  that is not a region: its uses are never sites (no ghost rule is linear through them),
  but an elementwise use that meets the example is cheap (Mamba's `exp(A_log) * dt`).
"""

from __future__ import annotations

from typing import Any

from ._gathered import Gathered, gathers_matrices
from ._sites import Region, region_of

DERIVED = frozenset(
    {
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "sqrt",
        "rsqrt",
        "square",
        "integer_pow",
        "abs",
        "erf",
        "slice",
        "split",
    }
)
SHIFTS = frozenset({"add", "sub", "add_any"})
WITH_CONSTANTS = frozenset({"mul", "div", "max", "min", "pow", "atan2", "rem", "clamp"})


def _of_constants(eqn: Any, tagged: list, intaints: list) -> bool:
    """Whether `eqn` is elementwise in its one tagged operand, the others constant."""
    return (
        len(tagged) == 1
        and len(eqn.outvars) == 1
        and eqn.outvars[0].aval.shape == eqn.invars[tagged[0]].aval.shape
        and not any(d for k, d in enumerate(intaints) if k != tagged[0])
    )


def passage(eqn: Any, tagged: list, tag: Any, intaints: list) -> str | None:
    """ "region", "gathered", "shift", "derived" or None (a scale, a use): how the parameter view
    `tag` (the one tagged operand, `tagged`) passes `eqn` (analysis)."""
    name = eqn.primitive.name
    if len(tagged) != 1:
        return None
    clean = not tag.derived and not any(
        isinstance(s, Region | Gathered)
        or getattr(getattr(s, "primitive", None), "name", "") == "broadcast_in_dim"
        for s in tag.chain
    )
    if name == "gather" and tagged[0] == 0 and clean and gathers_matrices(eqn):
        return "gathered"
    if name in ("slice", "split") and len(eqn.invars) == 1:
        regions = [region_of(eqn, k) for k in range(len(eqn.outvars))]
        return "region" if clean and all(r is not None for r in regions) else "derived"
    if name in DERIVED:
        return "derived"
    if name in SHIFTS and _of_constants(eqn, tagged, intaints):
        return "shift"
    return None


def with_constants(eqn: Any, tagged: list, intaints: list) -> bool:
    """Whether `eqn` combines the parameter view with constants elementwise (after
    scales: `W * 0.5` is a scale, `W * mask` is derived)."""
    return eqn.primitive.name in WITH_CONSTANTS and _of_constants(eqn, tagged, intaints)

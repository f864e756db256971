"""Values that vary with a loop's iteration, to anchor `jhooks.loop_index()` in the loop
(part of the fence, `__init__.py` beside this file).

`loop_index_p` computes nothing from its operands: with none, JAX's partial evaluation
sees an equation whose inputs are all known and evaluates it where it is, which, under
`jax.grad`, is outside the loop when a `lax.scan` hoists its loop-invariant residuals
(`_scan_known_hoisting`). Given an argument of each loop body around it (a carry or an
`xs` slice, which that hoisting treats as unknown), the equation stays in its loop.
"""

from __future__ import annotations

from typing import Any

import jax

try:  # jax 0.10
    from jax._src import core as _core
    from jax._src import source_info_util as _source_info
    from jax._src.interpreters import partial_eval as _pe
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"jhooks reads loop bodies' arguments through jax._src.interpreters.partial_eval, "
        f"which moved in this JAX ({jax.__version__}); jhooks supports jax 0.10. Please "
        "report it."
    ) from e


def body_argument(trace: Any) -> Any | None:
    """A tracer of the first argument of the function `trace` stages out (a loop body's
    carry or `xs` slice), or `None` where it takes none (or is not a staging trace)."""
    if not isinstance(trace, _pe.DynamicJaxprTrace):
        return None
    for var in trace.frame.invars:
        if isinstance(var.aval, _core.ShapedArray):
            return trace.var_to_tracer(var, _source_info.current())
    return None

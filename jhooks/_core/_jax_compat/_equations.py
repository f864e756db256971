"""Where an equation was made (part of the fence, `__init__.py` beside this file): its name
stack (the `jax.named_scope`s around it, which hookable module calls enter) and its Python
traceback (raw: code objects and their last instruction), for operation addresses
(`_staging/_addresses.py`).
"""

from __future__ import annotations

from typing import Any

import jax

try:  # jax 0.10
    from jax._src import custom_derivatives as _custom
    from jax._src import source_info_util as _source_info
    from jax._src.lax import control_flow as _control_flow
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"jhooks reads equations' name stacks through jax._src.source_info_util, which "
        f"moved in this JAX ({jax.__version__}); jhooks supports jax 0.10. Please report it."
    ) from e

WHILE = _control_flow.while_p
COND = _control_flow.cond_p
CUSTOM_CALLS = frozenset({_custom.custom_jvp_call_p, _custom.custom_vjp_call_p})


# Where `equation_scopes` puts a `jax.vmap` around the scopes after it (no scope's name).
VMAP_SCOPE = "\x00vmap"


def equation_scopes(eqn: Any) -> list[str]:
    """The names of the `jax.named_scope`s around `eqn` in its jaxpr, outermost first,
    with `VMAP_SCOPE` where a `jax.vmap` was entered (other transformations left out)."""
    stack = eqn.source_info.name_stack.stack
    return [
        s.name if isinstance(s, _source_info.Scope) else VMAP_SCOPE
        for s in stack
        if isinstance(s, _source_info.Scope) or s.name == "vmap"
    ]


def equation_frames(eqn: Any) -> tuple[list[Any], list[int]]:
    """The code objects of the Python frames that made `eqn`, innermost first, and the
    byte offset of the instruction each was at."""
    traceback = eqn.source_info.traceback
    if traceback is None:
        return [], []
    codes, lastis = traceback.raw_frames()
    return list(codes), list(lastis)


def custom_function_name(eqn: Any) -> str | None:
    """The name of the function a `custom_jvp` / `custom_vjp` call wraps, if known."""
    body = eqn.params.get("call_jaxpr")
    info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
    where = getattr(info, "func_src_info", None)
    return where.split(" ", 1)[0] if isinstance(where, str) and where else None


def with_source_of(eqn: Any) -> Any:
    """A context that makes equations bound inside it carry `eqn`'s traceback and name
    stack after the current one (as `jax.core.eval_jaxpr` does), so that a rewritten
    program keeps them, and a jaxpr evaluated inside a scope gets its scopes back."""
    return _source_info.user_context(
        eqn.source_info.traceback,
        name_stack=_source_info.current_name_stack() + eqn.source_info.name_stack,
    )

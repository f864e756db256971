"""Flax Linen and Haiku, registered when jhooks is imported; imports neither library.

Each library gets an interceptor, installed by `jhooks._runs` for the length of a run's
call of its function (`register_interceptor`), and a refusal for `hookable` and the
`register_*` functions (`register_refusal`). Both look the library up in `sys.modules`
first: a model of a library that was never imported cannot be running, so a run
installs nothing of it and `import jhooks` imports neither (`tests/test_nnx_packaging.py`).
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .._modules import register_refusal
from .._runs import register_interceptor

_ADVICE = (
    "{library} modules hold no hooks (their variables live in the dict that `{apply}` "
    "takes, not in the module), so jhooks cannot register any. Name the module's calls in "
    "a run instead: `jhooks.run_with_hooks({apply}, {arguments}, fwd_hooks=[(name, hook)])` "
    "or `jhooks.run_with_cache({apply}, {arguments})`, where each module call is the point "
    "named by the module's path ({example}) and the operations inside it are addresses "
    "(`{example_op}`); see 'Flax Linen and Haiku models' in docs/other_models.md."
)
LINEN_REFUSAL = _ADVICE.format(
    library="Flax Linen",
    apply="model.apply",
    arguments="variables, x",
    example='`"block_1.attn"`, from Linen\'s `module.path`',
    example_op="block_1.attn/softmax",
)
HAIKU_REFUSAL = _ADVICE.format(
    library="Haiku",
    apply="f.apply",
    arguments="params, rng, x",
    example='`"mlp.~.linear_0"` for Haiku\'s `mlp/~/linear_0`',
    example_op="mlp.~.linear_0/dot_general",
)


def _linen_module(obj: Any) -> bool:
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(obj, linen.Module)


def _haiku_module(obj: Any) -> bool:
    haiku = sys.modules.get("haiku")
    return haiku is not None and isinstance(obj, haiku.Module)


def _linen_installed() -> AbstractContextManager[object]:
    linen = sys.modules.get("flax.linen")
    if linen is None:
        return nullcontext()
    from ._linen import intercept

    return linen.intercept_methods(intercept)


def _haiku_installed() -> AbstractContextManager[object]:
    haiku = sys.modules.get("haiku")
    if haiku is None:
        return nullcontext()
    from ._haiku import intercept

    return haiku.intercept_methods(intercept)


register_interceptor(_linen_installed)
register_interceptor(_haiku_installed)
register_refusal(_linen_module, LINEN_REFUSAL)
register_refusal(_haiku_module, HAIKU_REFUSAL)

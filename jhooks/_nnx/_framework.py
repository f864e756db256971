"""Flax NNX as a `jhooks._modules.Framework`, registered when jhooks is imported.

Nothing here imports Flax: `owns` finds `flax.nnx` in `sys.modules` (an NNX module
cannot exist before Flax is imported), and the other methods, reached only with an
NNX module in hand, import this package's Flax code then. So `import jhooks` imports
no Flax (`tests/test_nnx_packaging.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from .._modules import register_framework


class NNX:
    """Flax NNX's modules, for `jhooks._modules` and `jhooks._per_example`."""

    name = "Flax NNX"

    def owns(self, obj: Any) -> bool:
        # A model, or its state (`nnx.state`, the gradients `nnx.grad` returns), which
        # `named_parameters` names as the model's parameters.
        nnx = sys.modules.get("flax.nnx")
        return nnx is not None and isinstance(obj, (nnx.Module, nnx.State))

    def hookable(self, model: Any) -> Any:
        from ._hookable import hookable

        return hookable(model)

    def named_modules(self, model: Any, remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        from ._names import named_modules

        return named_modules(model, remove_duplicate)

    def named_parameters(self, model: Any) -> Iterator[tuple[str, Any]]:
        from ._names import named_parameters

        return named_parameters(model)

    def parameters_hooked(
        self, module: Any, chains: dict[str, Callable[[Any], Any]]
    ) -> AbstractContextManager[Any]:
        from ._parameters import parameters_hooked

        return parameters_hooked(module, chains)

    def shapes(self, module: Any) -> Any:
        from ._parameters import shapes

        return shapes(module)

    def differentiable(self, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        from ._parameters import differentiable

        return differentiable(model)


register_framework(NNX())

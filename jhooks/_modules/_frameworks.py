"""Module libraries other than Equinox (Flax NNX): how `_modules` reaches code above it.

`_modules` knows Equinox modules. A library whose modules are not `eqx.Module`s plugs
in a `Framework` here, registered by a package above this one when jhooks is imported
(`jhooks/_nnx` registers Flax NNX's), so no lower layer ever imports it. A framework
must not import its library until it meets one of its objects: `owns` looks the
library up in `sys.modules` (an object of a library that was never imported cannot
exist), so `import jhooks` imports no Flax.

A library whose modules are not objects that could hold hooks (Flax Linen, Haiku: their
variables live outside the module, in the dict `apply` takes) registers a *refusal*
instead: `hookable`, every `register_*` call, `named_modules`, `named_parameters` and
`module_path` on one of its modules raise its message, which points at the runs that name
its module calls (`jhooks/_linen_haiku`).

Where `_modules` asks: `hookable`, `named_modules` / `named_parameters`,
`registry_of` (its error), the call pipeline (the parameters' hooks, the module given
to backward hooks), and `clipped_grad` (what is differentiated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Framework(Protocol):
    """What jhooks needs from a module library other than Equinox."""

    name: str  # how errors name the library: "Flax NNX"

    def owns(self, obj: Any) -> bool:
        """Whether `obj` is a module of this library (without importing it)."""
        ...

    def hookable(self, model: Any) -> Any:
        """`jhooks.hookable(model)` for a model of this library."""
        ...

    def named_modules(self, model: Any, remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        """Every module under `model`, itself first, with its dotted path (a shared
        module once, or under each of its paths)."""
        ...

    def named_parameters(self, model: Any) -> Iterator[tuple[str, Any]]:
        """Every parameter array under `model` with its dotted path."""
        ...

    def parameters_hooked(
        self, module: Any, chains: dict[str, Callable[[Any], Any]]
    ) -> AbstractContextManager[Any]:
        """Inside: the module to call, its parameter `name` wrapped by
        `jhooks.register_hook(value, chains[name])` for each name."""
        ...

    def shapes(self, module: Any) -> Any:
        """A copy of `module` with each array a `jax.ShapeDtypeStruct` (for backward hooks)."""
        ...

    def differentiable(self, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        """`(params, rebuild)`: the pytree of what `clipped_grad` differentiates (as the
        library's own `grad` does), and `rebuild(params)`, the model holding them."""
        ...


_FRAMEWORKS: list[Framework] = []


def register_framework(framework: Framework) -> None:
    """Adds a module library (done once, by the package that implements it)."""
    if all(f.name != framework.name for f in _FRAMEWORKS):
        _FRAMEWORKS.append(framework)


def framework_of(obj: Any) -> Framework | None:
    """The framework `obj` is a module of, or `None` (an Equinox module, anything else)."""
    for framework in _FRAMEWORKS:
        if framework.owns(obj):
            return framework
    return None


_REFUSALS: list[tuple[Callable[[Any], bool], str]] = []


def register_refusal(owns: Callable[[Any], bool], message: str) -> None:
    """Modules for which `owns(obj)` holds (without importing their library) cannot be
    hookable: `hookable`, `register_*`, `named_modules`, `named_parameters` and
    `module_path` on one raise a `TypeError` ending in `message`."""
    if (owns, message) not in _REFUSALS:
        _REFUSALS.append((owns, message))


def refusal_of(obj: Any) -> str | None:
    """Why `obj`, a module of a library registered with `register_refusal`, cannot be
    hookable; `None` for anything else."""
    for owns, message in _REFUSALS:
        if owns(obj):
            return message
    return None

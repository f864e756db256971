"""The hook registry of a hookable module, and how modules are named by it.

Every hookable module holds one `Registry` in its static `_jhooks` field. A static
field is part of the pytree structure, so every copy that JAX or Equinox makes of the
module (`jax.tree.map`, `eqx.apply_updates`, optax updates, `filter_jit`,
`tree_deserialise_leaves`) holds the same registry: copies share hooks, as the one
PyTorch module object would. The registry compares by identity, and stands for "the
same module" (see `_names.py`).

Pickling or deep-copying a registry gives a fresh, empty one with the same path: the
hooks stay with the original, whose handles refer to them (see `docs/semantics.md`).
"""

from __future__ import annotations

from typing import Any, cast

import equinox as eqx

from .._core import Hooks, field_values
from ._frameworks import framework_of
from ._kinds import ModuleHooks
from ._types import AnyModule


class Registry(ModuleHooks):
    """The hooks of one module, held in its static `_jhooks` field.

    Hashes and compares by identity (so jit caches key on which module it is, never
    on which hooks it holds: those are in the jit key of `_handles.py`).
    """

    def __init__(self, path: str = "") -> None:
        super().__init__()
        self.path = path  # from the root last given to `hookable`; "" for the root
        self.aliases: tuple[str, ...] = ()  # its other paths there (a shared module)
        self.parameters: dict[str, Hooks] = {}  # dotted name -> hooks on that parameter

    def active(self) -> bool:
        return super().active() or any(self.parameters.values())

    def __repr__(self) -> str:
        return f"<jhooks registry of module {self.path!r}>"

    # Pickle and deepcopy: a fresh registry with the same path and no hooks. Pickle's
    # memo keeps one registry per original, so copies that shared hooks still share.
    def __reduce__(self) -> tuple[Any, ...]:
        return (Registry, (self.path,))

    def __deepcopy__(self, memo: dict[int, Any]) -> Registry:
        return Registry(self.path)


def registry_paths(root: Any, named: Any) -> list[tuple[Registry, list[str]]]:
    """Each registry under `root` with every path it occupies there (`named` is
    `named_modules`)."""
    paths: dict[int, tuple[Registry, list[str]]] = {}
    for path, module in named(root, remove_duplicate=False):
        registry = registry_or_none(module)
        if registry is not None:
            paths.setdefault(id(registry), (registry, []))[1].append(path)
    return list(paths.values())


def claimed_elsewhere(root: Any, named: Any) -> set[int]:
    """The registries under `root` that another model named at a path they do not
    occupy in `root` (a block of one model, reused in another's structure): `root`
    gets fresh ones, so that no model's names depend on another's `hookable` call. A
    model's own root ("") may become a submodule of a bigger model, as in PyTorch."""
    return {
        id(registry)
        for registry, found in registry_paths(root, named)
        if registry.path and registry.path not in found
    }


def adopt(root: Any, named: Any) -> None:
    """Names every hookable module under `root` by its path from it (and its other
    paths, where one module appears several times)."""
    for registry, found in registry_paths(root, named):
        registry.path, registry.aliases = found[0], tuple(found[1:])


def registry_or_none(module: Any) -> Registry | None:
    """The registry of `module`, or `None` when it is not a hookable module."""
    registry: Any
    if isinstance(module, eqx.Module):
        registry = field_values(module).get("_jhooks")
    elif framework_of(module) is not None:
        attributes = cast("dict[str, Any]", vars(module))  # a Flax NNX module's
        registry = attributes.get("_jhooks")
    else:
        return None
    return registry if isinstance(registry, Registry) else None


def registry_of(module: Any, what: str = "register a hook on") -> Registry:
    """The registry of `module`; a `TypeError` saying what to do when it has none."""
    registry = registry_or_none(module)
    if registry is None:
        kind = type(module).__name__
        if not isinstance(module, eqx.Module) and framework_of(module) is None:
            raise TypeError(
                f"cannot {what} {kind}: it is not an Equinox or Flax NNX module. Pass a "
                "module of a model made with `model = jhooks.hookable(model)` (or built from "
                "classes that subclass `jhooks.Module`)."
            )
        raise TypeError(
            f"cannot {what} {kind}: it is not hookable. Call "
            "`model = jhooks.hookable(model)` on the whole model first and use the model it "
            "returns (or build the model from classes that subclass `jhooks.Module`)."
        )
    return registry


def module_path(module: AnyModule) -> str:
    """The dotted path of a hookable module from its root (`""` for the root itself).

    **Arguments:**

    - `module`: a module of a model made with [`jhooks.hookable`][] (or built from
        [`jhooks.Module`][] subclasses).

    **Returns:**

    Its path as [`jhooks.named_modules`][] names it from the root last given to
    `hookable` (or the outermost `jhooks.Module` constructed): `"fc1"`, `"layers.0"`.
    Global hooks see every module: this tells them apart. Raises a `TypeError` for a
    module that is not hookable.

    **Example:**

    ```python
    jhooks.register_module_forward_hook(lambda m, args, out: print(jhooks.module_path(m)))
    ```
    """
    return registry_of(module, "find the path of").path


def owner(module: Any) -> str:
    """How errors name a module: `module 'fc1' (Linear)`."""
    return f"module {module_path(module)!r} ({type(module).__name__})"

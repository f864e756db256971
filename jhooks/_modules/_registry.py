"""The hook registry of a hookable module, and how modules are named by it.

Every hookable module holds one `Registry` in its static `_jhooks` field. A static
field is part of the pytree structure, so every copy that JAX or Equinox makes of the
module (`jax.tree.map`, `eqx.apply_updates`, optax updates, `filter_jit`,
`tree_deserialise_leaves`) holds the same registry: copies share hooks, as the one
PyTorch module object would. The registry object stands for "the same module" (see
`_names.py`, which tells modules apart by its `id`).

**How registries compare (the rule that lets blocks stack).** Two registries compare
equal when they are one object, or when both are *interchangeable*: neither holds a
hook, neither is pinned, and no run is active or keyed (`_runs.names_read`). Then two
blocks that differ only by their registry (`blocks.0`, `blocks.1`) have equal pytree
structures: `jax.tree.map(lambda *a: jnp.stack(a), *blocks)` stacks them, and a jit
traced for one serves the other, which is sound because nothing traced there depends
on which module it is: no hooks, and names only where they are keyed or pinned. A
registry holding a hook compares by identity, so a jitted function called with
`blocks.0` then `blocks.1` (each with its own hooks) traces once for each. Where a
module's name is read while tracing and the cache key cannot show it (`module_path`
inside a jitted function, a run started inside the user's `jax.jit`), its registry is
pinned: compared by identity from then on. The hash is the same for every registry.

Pickling or deep-copying a registry gives a fresh, empty one with the same path: the
hooks stay with the original, whose handles refer to them (see `docs/semantics.md`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import equinox as eqx

from .._core import NAMES_KEYED, Hooks, field_values, under_staging
from .._runs import names_read
from ._frameworks import framework_of, refusal_of
from ._kinds import ModuleHooks
from ._types import AnyModule


def _nobody() -> None:
    return None


class Registry(ModuleHooks):
    """The hooks of one module, held in its static `_jhooks` field.

    Compares by identity, except that two interchangeable registries (no hooks, not
    pinned, no run reading names) compare equal; every registry has one hash. Which
    hooks it holds is in the jit key of `_handles.py`.
    """

    def __init__(self, path: str = "") -> None:
        super().__init__()
        self.path = path  # from the root last given to `hookable`; "" for the root
        self.aliases: tuple[str, ...] = ()  # its other paths there (a shared module)
        self.adopted = False  # whether a model named it (`adopt`)
        self.parameters: dict[str, Hooks] = {}  # dotted name -> hooks on that parameter
        self.pinned = False  # its name was read in a trace that a cache cannot tell apart
        self.holder: Callable[[], Any] = _nobody  # a Flax NNX module object: who made it

    def active(self) -> bool:
        return super().active() or any(self.parameters.values())

    def interchangeable(self) -> bool:
        """Whether nothing that a trace may depend on tells this module from another
        one of the same structure: it holds no hook, its name was never read in a
        trace keyed without it, and no run is reading names."""
        return not (self.pinned or names_read() or self.active())

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Registry):
            return NotImplemented
        return self.interchangeable() and other.interchangeable()

    def __hash__(self) -> int:
        return hash(Registry)

    def __repr__(self) -> str:
        why = ""
        if self.active():
            why = " (holding hooks)"
        elif self.pinned:
            why = " (its name was read inside a jitted function)"
        elif names_read():
            why = " (inside a run, which names each module)"
        if why:
            why += (
                ": a module that holds hooks, or whose name a trace read, is itself "
                "and not another; stack or vmap blocks before registering hooks, or "
                "make the stacked model hookable"
            )
        return f"<jhooks registry of module {self.path!r}{why}>"

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
    occupy in `root` (a block of one model reused in another's structure, or a whole
    model inside a bigger one): `root` gets fresh ones, so that no model's names
    depend on another's `hookable` call."""
    return {
        id(registry)
        for registry, found in registry_paths(root, named)
        if registry.adopted and registry.path not in found
    }


def adopt(root: Any, named: Any) -> None:
    """Names every hookable module under `root` by its path from it (and its other
    paths, where one module appears several times)."""
    for registry, found in registry_paths(root, named):
        registry.path, registry.aliases = found[0], tuple(found[1:])
        registry.adopted = True


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
        refusal = refusal_of(module)
        if refusal is not None:
            raise TypeError(f"cannot {what} {kind}: {refusal}")
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
    registry = registry_of(module, "find the path of")
    if under_staging() and not NAMES_KEYED:
        registry.pinned = True  # a trace reads the name: caches must tell it apart
    return registry.path


def owner(module: Any) -> str:
    """How errors name a module: `module 'fc1' (Linear)`."""
    return f"module {module_path(module)!r} ({type(module).__name__})"

"""`jhooks.hookable` for Flax NNX models: the model itself, made hookable in place.

NNX modules are mutable Python objects that the user (and `nnx.Optimizer`, and every
NNX transform) keeps referring to, so `hookable` changes the model in place and
returns it: each `nnx.Module` in it (`nnx.List` and `nnx.Sequential` included, as
PyTorch's containers are modules) becomes an instance of a subclass of its class
made once per class (same name, attributes, methods, pytree and graph behaviour),
whose `__call__` runs the hooks (`jhooks._modules`' call pipeline), and gets a hook
registry in a static attribute, `_jhooks`.

A static attribute is part of NNX's graph structure (the `GraphDef` of `nnx.split`,
the pytree aux data in tree mode), and the subclass is the node type recorded
there: every module that `nnx.merge`, `nnx.jit`, `nnx.grad`, `nnx.vmap`, `nnx.scan`
or `nnx.remat` rebuilds from the model is hookable and holds the same registry, so
hooks travel with the graph as Equinox's travel in a static field. What the hooks
are is in jhooks' jit key (`_core/_handles.py`), which every `jax.jit` (so every
`nnx.jit`) includes: registering or removing a hook retraces the next call, and a
registry that stays the same keeps NNX's cached graph structure valid.
"""

from __future__ import annotations

import weakref
from typing import Any

from flax import nnx

from .._modules import (
    ClassCache,
    Module,
    Registry,
    adopt,
    claimed_elsewhere,
    hookable_subclass,
    registry_or_none,
)
from ._flax_compat import is_pytree_class, set_static
from ._names import named_modules


class HookMethods:
    """What every hookable NNX class adds: PyTorch's `register_*` methods (those of
    [`jhooks.Module`][]) and pickling as its original class."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The subclass claims its original's name, so pickle could not find it: it is
        # rebuilt from the original class. The registry pickles as an empty one.
        return (unpickle, (_classes.originals[type(self)], dict(vars(self))))


for _name, _method in vars(Module).items():
    if _name.startswith("register_"):
        setattr(HookMethods, _name, _method)

_classes = ClassCache()


def hookable_class(cls: type) -> type:
    """The hookable subclass of the NNX module class `cls` (`cls` if it is one)."""
    # NNX registers each class as a graph node type (and a pytree) when it is made.
    return hookable_subclass(cls, HookMethods, _classes, pytree=is_pytree_class(cls))


def unpickle(cls: type, state: dict[str, Any]) -> Any:
    """Rebuilds a module of the hookable subclass of `cls` from its attributes."""
    new = object.__new__(hookable_class(cls))
    vars(new).update(state)
    return new


def hookable(model: nnx.Module) -> nnx.Module:
    """Makes every module of the NNX model `model` hookable, in place; returns `model`."""
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"jhooks.hookable takes a Flax NNX model (an nnx.Module), got "
            f"{type(model).__name__}: call it on the model, not on its state."
        )
    for _, module in named_modules(model):
        if registry_or_none(module) is None:
            module.__class__ = hookable_class(type(module))
            _give_registry(module, Registry())
    # A copy of a module (made by `jax.tree.map`: a block stacked from another model's
    # blocks) holding a registry that another model named at a path it does not
    # occupy here gets a fresh one, as in `jhooks.hookable` for Equinox. The module
    # object itself, shared by two models, stays one module with one registry.
    stale = claimed_elsewhere(model, named_modules)
    fresh: dict[int, Registry] = {}
    for _, module in named_modules(model, remove_duplicate=False):
        registry = registry_or_none(module)
        if registry is not None and id(registry) in stale and registry.holder() is not module:
            _give_registry(module, fresh.setdefault(id(registry), Registry()))
    adopt(model, named_modules)
    return model


def _give_registry(module: nnx.Module, registry: Registry) -> None:
    set_static(module, "_jhooks", registry)
    if registry.holder() is None:
        registry.holder = weakref.ref(module)

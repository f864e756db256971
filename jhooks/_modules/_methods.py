"""A module used only through other methods: their calls are points.

A module whose class has no `__call__` of its own (tunix's `Embedder`, called as
`embedder.encode(tokens)` and `embedder.decode(x)`) is never called as a module, so
it has no point of its own and its forward hooks could never run. Its hookable class
wraps each public method defined by the model's code instead (`wrap_method`): a call
of `encode` is the point `embedder.encode` (the method's output), and the points and
operations reached inside it are named under `embedder`, as in a call. Module hooks
stay PyTorch's: they run on `__call__` only; registering one on such a module warns
(`warn_if_never_called`). A subclass of `jhooks.Module` with no `__call__` has its
public methods wrapped the same way, when its class is made.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, cast

from .._core import user_stacklevel
from .._runs import hookable_call, named_point, names_unkeyed, point_scope
from .._staging import calls_model
from ._registry import registry_of

# Modules whose classes come from these packages are left as they are (their public
# methods are the library's, `nnx.Module.sow`, `eqx.Module.tree_at`...).
_LIBRARIES = ("equinox", "flax", "jax", "jhooks", "builtins", "abc", "typing")


def has_call(cls: type) -> bool:
    """Whether `cls` (or a class it derives from, `object` aside) defines `__call__`."""
    return any("__call__" in vars(klass) for klass in cls.__mro__[:-1])


def wrap_public_methods(namespace: dict[str, Any], bases: tuple[type, ...]) -> None:
    """Wraps the public methods in the `namespace` of a `jhooks.Module` subclass made
    from `bases`, if neither defines a `__call__`."""
    if "__call__" in namespace or any(has_call(base) for base in bases):
        return
    for name, method in list(namespace.items()):
        if is_public_method(name, method):
            namespace[name] = wrap_method(method, name)


def public_methods(cls: type, wrapped: bool = False) -> dict[str, Callable]:
    """The public methods the model's code defines on `cls` (none from a library's
    class), by name, in definition order, for a class without a `__call__`: those not
    wrapped yet, or with `wrapped` those `wrap_method` made."""
    out: dict[str, Callable] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] in _LIBRARIES:
            continue
        for name in vars(klass):
            method = getattr(cls, name, None)
            if (wrapped and hasattr(method, "_jhooks_method")) or is_public_method(name, method):
                out[name] = cast(Callable, method)
    return out


def is_public_method(name: str, value: Any) -> bool:
    """Whether `value`, found under `name` in a class, is a public method of the model's
    code not yet wrapped (not a property, staticmethod or classmethod)."""
    return (
        not name.startswith("_")
        and inspect.isfunction(value)
        and not hasattr(value, "_jhooks_method")
    )


def wrap_method(raw: Callable, name: str) -> Callable:
    """The method `name` of a hookable class without a `__call__`: its output is the
    point `<module path>.<name>`."""

    @functools.wraps(raw)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _method_call(self, raw, name, args, kwargs)

    method._jhooks_method = True  # type: ignore[attr-defined]
    calls_model(method)
    return method


def _method_call(module: Any, raw: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    return hookable_call(_scoped_method_call, module, raw, name, args, kwargs)


@calls_model
def _scoped_method_call(module: Any, raw: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    registry = registry_of(module)
    if names_unkeyed():  # a cache keyed without this module's name: it must be itself
        registry.pinned = True
    with point_scope(registry.path, registry.aliases):
        out = raw(module, *args, **kwargs)
    point = f"{registry.path}.{name}" if registry.path else name
    return named_point(out, point, aliases=tuple(f"{a}.{name}" for a in registry.aliases))


def warn_if_never_called(module: Any, kind: str) -> None:
    """Warns that a `kind` hook on `module` would never run: its class has no
    `__call__` (it is used through other methods, whose outputs are points)."""
    if callable(module):
        return
    path = registry_of(module).path
    methods = list(public_methods(type(module), wrapped=True))
    where = f" at {path!r}" if path else ""
    example = f"{path}.{methods[0]}" if path and methods else "<path>.<method>"
    warnings.warn(
        f"{type(module).__name__}{where} has no __call__: a {kind} runs when the "
        "module's __call__ is called, as in PyTorch, so this one never runs. The module is "
        f"used through its methods ({', '.join(methods) or 'none public'}), whose outputs "
        f"are points of runs: jhooks.run_with_hooks(model, x, fwd_hooks=[({example!r}, "
        "hook)]).",
        # The user's line, through `module.register_forward_hook` or
        # `jhooks.register_forward_hook` alike (Equinox's frames: a bound method's wrapper).
        stacklevel=user_stacklevel(("jhooks", "equinox")),
    )

"""PyTorch-style dotted names for the modules and parameters of an Equinox model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._core import field_values, is_equinox_class
from ._frameworks import framework_of, refusal_of


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def is_equinox_internal(cls: type) -> bool:
    """Whether `cls` is one of Equinox's own modules that are not layers.

    `eqx.nn.StateIndex` (a key of `eqx.nn.State`, which must be exactly that class), and
    every module class of Equinox that is not a public layer of `eqx.nn` (`eqx.Partial`,
    bound methods, the `filter_*` wrappers, private helpers such as the sentinel of a
    `StateIndex`). They are not hookable, and `named_modules` does not list them (as
    PyTorch lists no module for a buffer).
    """
    if issubclass(cls, eqx.nn.StateIndex):
        return True
    if not is_equinox_class(cls):
        return False
    # A layer's hookable subclass claims the layer's module and name.
    return not any(getattr(eqx.nn, c.__name__, None) is c for c in cls.__mro__)


def _key_name(key: Any) -> str:
    for attr in ("name", "idx", "key"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def dotted(prefix: str, path: tuple) -> str:
    """`prefix` followed by a JAX key path, PyTorch style: `layers.0.weight`."""
    parts = [prefix] if prefix else []
    parts.extend(_key_name(key) for key in path)
    return ".".join(parts)


def children(tree: Any) -> list[tuple[tuple, Any]]:
    """The leaves of `tree` with their key paths, stopping at the modules inside it."""
    leaves, _ = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree and _is_module(x))
    return leaves


def identity(module: eqx.Module) -> int:
    # A hookable module's copies (made by jax.tree.map, optax, ...) share its hook
    # registry, which therefore stands for "the same module", as one PyTorch object.
    # By `id`: two registries without hooks compare equal (`_registry.py`).
    registry = field_values(module).get("_jhooks")
    return id(module) if registry is None else id(registry)


def _walk(model: Any, remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
    # The root (a module or any pytree) and then every module under it, pre-order.
    seen: set[Any] = set()

    def walk(prefix: str, tree: Any) -> Iterator[tuple[str, Any]]:
        if _is_module(tree) and remove_duplicate:
            key = identity(tree)
            if key in seen:
                return
            seen.add(key)
        yield prefix, tree
        for path, leaf in children(tree):
            if _is_module(leaf):
                yield from walk(dotted(prefix, path), leaf)

    return walk("", model)


def named_modules(model: Any, remove_duplicate: bool = True) -> Iterator[tuple[str, eqx.Module]]:
    """Every Equinox module in `model` with its dotted name: PyTorch's `named_modules()`.

    **Arguments:**

    - `model`: an Equinox module, or any pytree holding modules.
    - `remove_duplicate`: as PyTorch's: `True` lists a module that appears several
        times (one object under two paths: `self.ls1 = self.ls2 = eqx.nn.Identity()`)
        once, under its first path; `False` lists it under every path it occupies.

    **Returns:**

    An iterator of `(name, module)` pairs: `("", model)` first, then each submodule
    before its own submodules (pre-order), in field order, named by the path to it:
    field names, then list or tuple indices and dict keys, joined by dots
    (`"fc1"`, `"layers.0"`). A module that appears twice is listed once, as in
    PyTorch, unless `remove_duplicate=False`. Lists, tuples and dicts are not
    modules (unlike `nn.ModuleList`), so they have no entry of their own. Equinox's
    internal modules (`eqx.nn.StateIndex`, `eqx.Partial`, ...) are not listed, as
    PyTorch lists no module for a buffer.
    For a Flax NNX model, the paths are NNX's (`nnx.List` is a module, as
    `nn.ModuleList` is), children in NNX's order (sorted by name).

    **Example:**

    ```python
    [name for name, _ in jhooks.named_modules(net)]  # ["", "conv", "fc1", "layers.0"]
    ```
    """
    framework = framework_of(model)
    if framework is not None:  # a Flax NNX model: see `jhooks/_nnx`
        return framework.named_modules(model, remove_duplicate)
    _refuse(model, "list the modules of")
    return (
        (name, m)
        for name, m in _walk(model, remove_duplicate)
        if _is_module(m) and not is_equinox_internal(type(m))
    )


def _refuse(model: Any, what: str) -> None:
    """A Flax Linen or Haiku module has no modules or parameters of its own to list."""
    refusal = refusal_of(model)
    if refusal is not None:
        raise TypeError(f"cannot {what} {type(model).__name__}: {refusal}")


def named_parameters(model: Any) -> Iterator[tuple[str, jax.Array]]:
    """Every array in `model` with its dotted name: PyTorch's `named_parameters()`.

    **Arguments:**

    - `model`: an Equinox module, or any pytree holding modules.

    **Returns:**

    An iterator of `(name, array)` pairs in PyTorch's order: for each module of
    [`jhooks.named_modules`][] in turn, the arrays it holds itself (outside its
    submodules), in field order: `"conv.weight"`, `"conv.bias"`, `"fc1.weight"`, ….
    Static fields hold no parameters. Shapes are Equinox's (a `Conv2d` bias is
    `(out, 1, 1)` where PyTorch's is `(out,)`). For a Flax NNX model (or an
    `nnx.State`, such as `nnx.grad`'s gradients), the `nnx.Param`s by NNX path
    (`"linear1.kernel"`): batch statistics and RNG state are buffers.

    **Example:**

    ```python
    dict(jhooks.named_parameters(net))["fc1.bias"]  # net.fc1.bias
    ```
    """
    framework = framework_of(model)
    if framework is not None:  # a Flax NNX model: see `jhooks/_nnx`
        yield from framework.named_parameters(model)
        return
    _refuse(model, "list the parameters of")
    for prefix, node in _walk(model):
        for path, leaf in children(node):
            if eqx.is_array(leaf):
                yield dotted(prefix, path), leaf

"""What Python code can reach from an object, and which code is the user's.

Code installed as a package (or the standard library) is library code, taken as
constant; the user's own (scripts, notebooks, tests, a source checkout) is looked into.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
import weakref
from typing import Any

import jax

# Objects of these packages are not looked into: library code and constants.
LIBRARIES = frozenset(
    {"jax", "jaxlib", "equinox", "numpy", "jhooks", "torch", "optax", "functools", "builtins"}
)
SKIPPED = frozenset(
    {
        "__dict__",
        "__weakref__",
        "__module__",
        "__doc__",
        "__qualname__",
        "__annotations__",
        "__slots__",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__match_args__",
        "__firstlineno__",
        "__static_attributes__",
        # A cache that `copy.copy` and pickling write on a class (`copyreg._slotnames`):
        # the trace's own copies would otherwise look like a write to the class.
        "__slotnames__",
    }
)
_INSTALLED = tuple(
    {
        os.path.realpath(sysconfig.get_paths()[k]) + os.sep
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
    }
)


@functools.lru_cache(maxsize=4096)
def _library_module(name: str) -> bool:
    """Code installed as a package (or the standard library) is library code; the
    user's own (scripts, notebooks, tests, a source checkout) is looked into."""
    if name.partition(".")[0] in LIBRARIES:
        return True
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return module is not None and name != "__main__"  # builtin modules
    return os.path.realpath(path).startswith(_INSTALLED)


def library(obj: Any) -> bool:
    module = getattr(obj, "__module__", None)
    return not isinstance(module, str) or _library_module(module)


@functools.lru_cache(maxsize=4096)
def code_names(code: types.CodeType) -> tuple[str, ...]:
    """The global and attribute names a code object (and the code nested in it) reads."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(code_names(const))
    return tuple(dict.fromkeys(names))


def namespace(obj: Any) -> bool:
    """Library objects that are only their attributes: looked into."""
    name = type(obj).__name__
    return (name == "SimpleNamespace" or name == "Namespace") and isinstance(
        getattr(obj, "__dict__", None), dict
    )


_slots: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def slot_names(cls: type) -> tuple[str, ...]:
    """The `__slots__` of a class and its bases (cached weakly: classes may die)."""
    found = _slots.get(cls)
    if found is None:
        names: list[str] = []
        for klass in cls.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            names.extend([slots] if isinstance(slots, str) else slots)
        found = _slots[cls] = tuple(n for n in names if n not in ("__dict__", "__weakref__"))
    return found


def node_children(obj: Any) -> tuple[list, Any] | None:
    """A pytree node's children and structure, one level down; `None` for a leaf."""
    children, treedef = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)
    if jax.tree_util.treedef_is_leaf(treedef):
        return None
    return children, treedef

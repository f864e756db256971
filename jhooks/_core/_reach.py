"""What Python code can reach from an object, and which code is the user's.

Code installed as a package (or the standard library) is library code, taken as
constant; the user's own (scripts, notebooks, tests, a source checkout) is looked into.
"""

from __future__ import annotations

import dis
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
        # a `copy.copy` in the model would otherwise look like a change of the class.
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


def reached_by(hook: Any) -> list[tuple[str, Any]]:
    """What `hook`'s own code reaches, each named as the user would: a bound method's
    `self`'s attributes (`Keeper.kept`), its function's closure variables, defaults and
    named globals, a `partial`'s arguments (where a value it kept is looked for, and
    named, or swapped for its forward value: `_tracing.leaked_tracers`, `_runs._kept`,
    `_forward_values`)."""
    out, hook = _unwrapped(hook)
    if not isinstance(hook, types.FunctionType):
        attrs = getattr(hook, "__dict__", None)  # a callable instance: its attributes
        if isinstance(attrs, dict):
            out += [(f"{type(hook).__qualname__}.{k}", v) for k, v in attrs.items()]
        return out
    out += [("a default", v) for v in (*(hook.__defaults__ or ()),)]
    out += [(f"the default `{k}`", v) for k, v in (hook.__kwdefaults__ or {}).items()]
    for var, cell in zip(hook.__code__.co_freevars, hook.__closure__ or ()):
        try:
            out.append((f"the closure variable `{var}`", cell.cell_contents))
        except ValueError:
            continue
    names, module = hook.__globals__, hook.__globals__.get("__name__")
    named = [n for n in global_names(hook.__code__) if n in names]
    return out + [(f"the global `{n}` of {module}", names[n]) for n in named]


def closure_cells(hook: Any) -> list:
    """The closure cells of `hook`'s function: where `nonlocal kept; kept = z` keeps."""
    _, fn = _unwrapped(hook)
    return list(fn.__closure__ or ()) if isinstance(fn, types.FunctionType) else []


def _unwrapped(hook: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The function under jhooks' wrappers, partials and a bound method, and what those
    hold on the way (a `partial`'s arguments, `self`'s attributes)."""
    out: list[tuple[str, Any]] = []
    for _ in range(8):  # jhooks' wrappers (and `functools.wraps`) name it `__wrapped__`
        inner = getattr(hook, "__wrapped__", None)
        if inner is None:
            break
        hook = inner
    for _ in range(3):  # partial(partial(f, ...)), a method's function
        if isinstance(hook, functools.partial):
            out += [("a partial argument", v) for v in (*hook.args, *hook.keywords.values())]
            hook = hook.func
        elif isinstance(hook, types.MethodType):
            owner = hook.__self__
            attrs = getattr(owner, "__dict__", None)
            if isinstance(attrs, dict):
                out += [(f"{type(owner).__qualname__}.{k}", v) for k, v in attrs.items()]
            hook = hook.__func__
    return out, hook


@functools.lru_cache(maxsize=4096)
def global_names(code: types.CodeType) -> tuple[str, ...]:
    """The globals a code object (and the code nested in it) loads."""
    names = [i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += global_names(const)
    return tuple(dict.fromkeys(names))


def user_stacklevel(skipped: tuple[str, ...] = ("jhooks",)) -> int:
    """The `stacklevel`, for the caller's `warnings.warn`, of the first frame whose
    module is in none of the packages `skipped`: the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(skipped):
        frame, level = frame.f_back, level + 1
    return level

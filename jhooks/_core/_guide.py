"""Guided errors for PyTorch habits inside a hook: JAX's error re-raised, chained, with the
hook's name, what it was given and the fix.

- `float(x)`, `bool(x)`, `x.item()` or `np.asarray(x)` on a traced value: JAX's
  concretization error, pointing to `jhooks.host`.
- A shape, broadcast or index error under `jax.vmap`, where a hook sees one example:
  the shapes the hook was given.
- `z[:, :, 1] = 0` (or `+=`...): JAX's refusal of an in-place edit, with the point the
  hook runs at and the statement written functionally, `z = z.at[:, :, 1].set(0)`, read
  from the hook's source line (`_inplace.py`).
- A hook whose signature does not take what it is called with (`lambda z: ...` as a
  run's hook): Python's `TypeError`, with the signatures each kind of hook is called with.

Every hook kind runs through `guided` (`run_chain` calls it for each hook), so one rule
covers value, node, module and run hooks. The error raised is a subclass of the original
error's class (`except jax.errors.ConcretizationTypeError` or `except IndexError` still
catch it), with JAX's or NumPy's error as its `__cause__`.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
from collections.abc import Callable
from typing import Any

import jax

from ._checks import describe, hook_name
from ._inplace import in_place_message, is_in_place
from ._jax_compat import is_vmapped

_CONCRETIZATION = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)
_GUIDED = "_jhooks_guided"
_guided_classes: dict[type, type] = {}


def guided(call: Callable[[Any, Any], Any], hook: Any, value: Any, where: str | None = None) -> Any:
    """Returns `call(hook, value)`; an error that a PyTorch habit causes is re-raised with
    what to do instead.

    **Arguments:**

    - `call`: calls a hook with a value.
    - `hook`: the hook (a function, or an entry whose `fn` is one).
    - `value`: what the hook is given, described in the error.
    - `where`: where the hook runs (`"at hook point 'hook_z'"`), named in the error.

    **Returns:**

    What `call(hook, value)` returns.
    """
    try:
        return call(hook, value)
    except Exception as e:
        try:
            message = _guide(hook, value, e, where)
            guided_error = None if message is None else _guided_class(type(e))(message)
        except Exception:  # a class that cannot be subclassed: JAX's error as it is
            guided_error = None
        if guided_error is None:
            raise
        raise guided_error from e


def _guide(hook: Any, value: Any, error: Exception, where: str | None) -> str | None:
    if getattr(error, _GUIDED, False):
        return None  # a hook inside a hook: the innermost one is named
    name = hook_name(_function_of(hook))
    if is_in_place(error):
        return in_place_message(f"hook {name}{f' {where}' if where else ''}", error)
    if isinstance(error, TypeError) and _not_entered(hook, error):
        return (
            f"hook {name}{f' {where}' if where else ''} cannot take the arguments it is "
            f"called with ({_first_line(error)}). Hooks are called as PyTorch and "
            "TransformerLens call them: a run's hooks as hook(value, name), a module's "
            "forward hooks as hook(module, args, output), its forward pre-hooks as "
            "hook(module, args), its backward hooks as hook(module, grad_input, grad_output), "
            "a value's gradient hooks as hook(grad) (with_kwargs=True adds the keyword "
            "arguments)."
        )
    given = describe(value)
    concretization = _concretization(error)
    if concretization is not None:
        return (
            f"hook {name} tried to read a traced value as a Python or NumPy value "
            f"(`float`, `int`, `bool`, `.item()`, `np.asarray`): it was given {given}, and "
            "its arguments are traced (jax.jit, jax.grad and jax.vmap trace the step, and "
            "hooks run while they trace), so they have no value yet. Wrap the hook in "
            "`jhooks.host(fn)` to run it on the host with NumPy values each time the step "
            "runs (to print, log or keep them), or return values instead: `jhooks.emit` in "
            "a backward hook, `jhooks.run_with_cache`. Appending the traced value to a list "
            "instead leaks a tracer (see the semantics page). JAX said: "
            f"{_first_line(concretization)}"
        )
    if _under_vmap(value) and _is_shape_error(error):
        return (
            f"hook {name} raised {type(error).__name__} under jax.vmap, where a hook sees "
            f"one example: it was given {given}, one example's shapes, without the batch "
            "axis (x[0] is the example's first entry, not the first example). Index and "
            "broadcast as for one example, or take the batch outside the vmapped function. "
            f"The error: {_first_line(error)}"
        )
    return None


def _function_of(hook: Any) -> Any:
    """The user's function in what a chain holds: `(id, entry)` pairs and entries with
    an `fn` (module forward hooks) hold it."""
    if isinstance(hook, tuple) and hook:
        hook = hook[-1]
    return getattr(hook, "fn", hook)


_BINDING = re.compile(
    r"positional argument|required (keyword-only |positional )?argument|unexpected keyword "
    r"argument|takes no arguments"
)


def _not_entered(hook: Any, error: TypeError) -> bool:
    """Whether `error` is Python's refusal to call the hook with these arguments: its
    message says so and the hook's own code never ran (no frame of it in the traceback)."""
    fn = inspect.unwrap(_function_of(hook))
    while isinstance(fn, functools.partial):
        fn = inspect.unwrap(fn.func)
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType):
        fn = type(fn).__call__  # a callable instance: its class's method
    code = getattr(fn, "__code__", None)
    if code is None or not _BINDING.search(str(error)):
        return False
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return False
        tb = tb.tb_next
    return True


def _concretization(error: BaseException) -> BaseException | None:
    """JAX's concretization error, `error` itself or one it was raised from."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, _CONCRETIZATION):
            return seen
        seen = seen.__cause__
    return None


def _under_vmap(value: Any) -> bool:
    leaves = jax.tree.leaves(value, is_leaf=lambda x: x is None)
    return any(is_vmapped(x) for x in leaves)


def _is_shape_error(error: BaseException) -> bool:
    if isinstance(error, IndexError):
        return True
    text = str(error).lower()
    return isinstance(error, (TypeError, ValueError)) and ("shape" in text or "broadcast" in text)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _guided_class(cls: type) -> type:
    """A subclass of `cls` that takes one message, shown under `cls`'s name."""
    if cls not in _guided_classes:
        namespace = {
            "__init__": Exception.__init__,
            "__str__": Exception.__str__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            _GUIDED: True,
        }
        _guided_classes[cls] = type(cls.__name__, (cls,), namespace)
    return _guided_classes[cls]

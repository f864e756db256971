"""Operation addresses: every value computed in a hookable module's call, by name.

A hookable module's call enters `jax.named_scope("module:" + path)` (`module_scope`), so
each equation traced inside it carries the module's path in its name stack, through
`vmap`, `scan`, `checkpoint` and `jit`. The prefix tells a module's scope from a scope
of the model's own code: tunix's Gemma 3 enters `jax.named_scope("rope")` in its
attention, which is no module, whatever paths other models have (profiles show
`module:blocks.0.attn` too). An equation's *operation* is named by where it was
made: the outermost public JAX function that the model's code called to make it (its
Python traceback: `softmax`, `einsum`, `where`, `dot_product_attention`; a
`custom_jvp`/`custom_vjp` function by its own name), or else its primitive (`add`,
`dot_general` for `@`, `exp`). The equations one such call made, in a row, are one
operation, whose value is its last equation's output.

An address is `<module path>/<operation>`, with `:k` (k = 1, 2, ...) for the k+1-th
operation of that name in that module, counted in program order:
`blocks.0.attn/softmax`, `blocks.0/add:1`. Counting per name keeps an address when an
unrelated operation is added before it. Operations outside every hookable module have
the path `""` (`/exp`).

A hookable model called under a `jax.vmap` inside a run's function (the user's vmap,
`jhooks.run_with_hooks(jax.vmap(model), xs)`) enters a scope of its own too
(`vmapped_call_scope(k)`, the k-th such call): its operations there are the batched
ones, with the vmap's axis where JAX's batching put it, and `Found.region` says which
call (a run selects them in that call's own jaxpr, one example's: `_runs/_operations.py`).
An operation made under a `jax.vmap` outside every hookable module and every such call
(a plain function's) has `Found.vmapped` (runs refuse a hook there).

Equations that jhooks itself made (hook points, hooks' own code) are not operations:
an equation is one only if the innermost jhooks frame in its traceback is a call of
the model (`calls_model`), or there is none. The equations inside one of jhooks' own
(the body of `jhooks.generate`'s decode loop, which calls the model) are judged one by
one.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import jax

from .._core import (
    BATCH_AXES_FILE,
    CUSTOM_CALLS,
    JIT,
    UNKNOWN_AXIS,
    VMAP_SCOPE,
    BatchAxes,
    custom_function_name,
    equation_frames,
    equation_scopes,
)
from .._core import inner_jaxprs as _inner

# What the named scope of a hookable module call starts with (a scope of the model's
# own, `jax.named_scope("mlp")`, is not a module).
_MODULE_SCOPE = "module:"
# The jhooks functions that call the model: frames of any other jhooks function make
# jhooks' own equations (a point's mark, a hook's code).
_MODEL_CALLERS: set[Any] = set()

_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_JHOOKS_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
# JAX's own plumbing (wrappers, tracing, operator methods): not functions a model calls.
_PLUMBING = tuple(
    os.path.join(_JAX_DIR, "_src", f)
    for f in (
        "traceback_util.py",
        "pjit.py",
        "api.py",
        "api_util.py",
        "linear_util.py",
        "core.py",
        "source_info_util.py",
        "custom_derivatives.py",
        "tree_util.py",
        "tree.py",
        "interpreters",
        os.path.join("numpy", "array_methods.py"),
        os.path.join("numpy", "indexing.py"),
        os.path.join("numpy", "ufunc_api.py"),
    )
) + (os.path.join(_JAX_DIR, "tree.py"),)
# The standard library's wrappers that JAX's functions may sit behind (jax 0.10.1 wraps
# `jnp.einsum` in a `ContextDecorator`): plumbing too, not the model's code.
_STDLIB_WRAPPERS = frozenset({contextlib.__file__, functools.__file__})


# What the named scope of a hookable model's outermost call made under a `jax.vmap`
# inside a run's function starts with (not a module path: no address names it).
_VMAPPED_CALL = "jhooks_vmapped_call:"


@contextmanager
def vmapped_call_scope(k: int) -> Iterator[None]:
    """The scope that marks the operations of the k-th model call under the user's vmap."""
    with jax.named_scope(f"{_VMAPPED_CALL}{k}"):
        yield


@contextmanager
def module_scope(path: str) -> Iterator[None]:
    """The named scope of the hookable module at `path` (none for the root, `""`)."""
    if not path:
        yield
        return
    with jax.named_scope(_MODULE_SCOPE + path):
        yield


def calls_model(fn: Callable) -> Callable:
    """Marks `fn`, a jhooks function, as one that calls the model's own code."""
    _MODEL_CALLERS.add(fn.__code__)
    return fn


# What a frame's code is: 0 JAX plumbing, 1 a public JAX function, 2 the model's code,
# 3 jhooks calling the model, 4 jhooks' own code.
_KINDS: dict[Any, int] = {}


def _kind(code: Any) -> int:
    kind = _KINDS.get(code)
    if kind is None:
        file = code.co_filename
        if file.startswith(_JAX_DIR):
            public = not code.co_name.startswith("_") and code.co_name.isidentifier()
            kind = 1 if public and not file.startswith(_PLUMBING) else 0
        elif file == BATCH_AXES_FILE:
            kind = 0
        elif file.startswith(_JHOOKS_DIR):
            kind = 3 if code in _MODEL_CALLERS else 4
        elif file in _STDLIB_WRAPPERS:
            kind = 0
        else:
            kind = 2
        _KINDS[code] = kind
    return kind


def _made_by(eqn: Any) -> tuple[str | None, Any, int] | None:
    """`(public function, model frame's code, its offset)` for an operation of the
    model, `None` for an equation jhooks made."""
    codes, lastis = equation_frames(eqn)
    public, user = None, None
    for code, lasti in zip(codes, lastis):
        kind = _kind(code)
        if user is None:
            if kind == 1:
                public = code.co_name
                continue
            if kind == 0:
                continue
            user = (code, lasti)
        if kind == 4:
            return None
        if kind == 3:
            break
    if user is None:
        return public, None, 0
    return public, user[0], user[1]


def _line(code: Any, lasti: int) -> int:
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return line
    return code.co_firstlineno


class Operation(NamedTuple):
    """One operation of a traced program, as [`jhooks.ops`][] lists it.

    `address` (`"blocks.0.attn/softmax"`), `shape` and `dtype` of its value (tuples
    of them for an operation with several outputs), and `source`, the model's line
    that made it (`"model.py:42"`).
    """

    address: str
    shape: Any
    dtype: Any
    source: str


class Found(NamedTuple):
    """An operation found in a jaxpr: its address, the equation giving its value, and
    the model's frame that made it (`(code, offset)`; code `None` if unknown); `region`,
    the model call under a `jax.vmap` inside the run's function it was made in
    (`vmapped_call_scope(k)`: k), and `vmapped`, whether it was made under a `jax.vmap`
    outside every hookable module and every such call."""

    address: str
    eqn: Any
    source: tuple[Any, int]
    region: int | None = None
    vmapped: bool = False
    axes: tuple[Any, ...] = ()


def moved_first(shape: tuple[int, ...], axis: Any) -> tuple[int, ...]:
    """`shape` with `axis` (a vmap's, or `None`) first, as an operation's hook sees it."""
    if not isinstance(axis, int):
        return shape
    return (shape[axis],) + shape[:axis] + shape[axis + 1 :]


class _Walk:
    """Names the operations of a jaxpr, in program order."""

    def __init__(self, batch_axes: BatchAxes | None) -> None:
        self.batch_axes = batch_axes
        self.found: list[Found] = []
        self.counts: dict[tuple[str, str], int] = {}
        # The named call being read: (key, module, name, src, where).
        self.group: tuple | None = None
        self.last: Any = None

    def jaxpr(self, jaxpr: Any, scopes: list[str], outer: tuple[Any, int] = (None, 0)) -> None:
        # `outer`: the model's frame that made the equation holding `jaxpr`, the line of
        # an operation made inside a function JAX jitted (`jax.nn.silu`, `jnp.clip`),
        # whose own traceback stops at that function.
        for eqn in jaxpr.eqns:
            here = scopes + equation_scopes(eqn)
            made = _made_by(eqn)
            if made is None:  # jhooks' own: a model's call inside it (a decode loop's body)
                self._close()
                for sub in _inner(eqn):
                    self.jaxpr(sub, here, outer)
                self._close()
                continue
            public, code, lasti = made
            if code is None:
                code, lasti = outer
            is_call = eqn.primitive is JIT or eqn.primitive in CUSTOM_CALLS
            if public is None and eqn.primitive in CUSTOM_CALLS:
                public = custom_function_name(eqn)
            inner = _inner(eqn)
            if inner and (public is None or not is_call):
                # Control flow, a checkpoint, a jit of the model's: their operations.
                self._close()
                for sub in inner:
                    self.jaxpr(sub, here, (code, lasti))
                self._close()
                continue
            module = next(
                (s[len(_MODULE_SCOPE) :] for s in reversed(here) if s.startswith(_MODULE_SCOPE)),
                "",
            )
            src = (code, lasti)
            where = _where(here)
            if public is None:
                self._close()
                self._add(module, eqn.primitive.name, eqn, src, where)
                continue
            key = (module, public, code, lasti)
            if self.group is not None and self.group[0] != key:
                self._close()
            if self.group is None:
                self.group = (key, module, public, src, where)
            self.last = eqn
        self._close()

    def _close(self) -> None:
        if self.group is not None:
            _, module, name, src, where = self.group
            self._add(module, name, self.last, src, where)
            self.group = None

    def _add(self, module: str, name: str, eqn: Any, src: tuple[Any, int], where: tuple) -> None:
        k = self.counts.get((module, name), 0)
        self.counts[(module, name)] = k + 1
        address = f"{module}/{name}" + (f":{k}" if k else "")
        region, vmapped, own_vmaps = where
        axes: tuple[Any, ...] = (None,) * len(eqn.outvars)
        if own_vmaps:
            # Under the model's own vmap: each output's axis as its batching gave it (in
            # a loop's or jit's body too: traced in the run's own jit context, never
            # taken from JAX's caches); one under a second vmap is not known.
            seen = self.batch_axes
            if own_vmaps == 1 and seen is not None:
                axes = tuple(seen.axis(v) for v in eqn.outvars)
            else:
                axes = (UNKNOWN_AXIS,) * len(eqn.outvars)
        self.found.append(Found(address, eqn, src, region, vmapped, axes))


def _where(scopes: list[str]) -> tuple[int | None, bool, int]:
    """`(region, vmapped, own_vmaps)` for an equation under these scopes: own_vmaps
    counts the model's own vmaps around it, inside a hookable module."""
    for s in scopes:
        if s.startswith(_VMAPPED_CALL):
            inner = scopes[scopes.index(s) :]
            return int(s[len(_VMAPPED_CALL) :]), False, _own_vmaps(inner)
    for i, s in enumerate(scopes):
        if s.startswith(_MODULE_SCOPE):
            return None, False, _own_vmaps(scopes[i:])
        if s == VMAP_SCOPE:
            return None, True, 0
    return None, False, 0


def _own_vmaps(scopes: list[str]) -> int:
    return sum(s == VMAP_SCOPE for s in scopes)


def find_operations(jaxpr: Any, batch_axes: BatchAxes | None = None) -> list[Found]:
    """The operations of `jaxpr` (and the jaxprs inside it), in program order;
    `batch_axes`, recorded while it was traced, says where the model's own vmaps put
    their axis in its own equations' values (`Found.axes`)."""
    walk = _Walk(batch_axes)
    walk.jaxpr(jaxpr, [])
    return walk.found


def operation_of(found: Found) -> Operation:
    """What [`jhooks.ops`][] lists for an operation found."""
    avals = [v.aval for v in found.eqn.outvars]
    shape = tuple(moved_first(getattr(a, "shape", ()), x) for a, x in zip(avals, found.axes))
    dtype = tuple(getattr(a, "dtype", None) for a in avals)
    code, lasti = found.source
    src = "?"
    if code is not None:
        file = code.co_filename
        file = os.path.relpath(file) if file.startswith(os.getcwd()) else file
        src = f"{file}:{_line(code, lasti)}"
    if len(avals) == 1:
        return Operation(found.address, shape[0], dtype[0], src)
    return Operation(found.address, shape, dtype, src)

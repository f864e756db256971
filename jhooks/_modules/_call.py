"""The call of a hookable module: PyTorch's `Module._call_impl` for Equinox.

`hooked_call` runs the call through `STAGES`, each a small function around the next,
in PyTorch's order, outermost first: `always_call` forward hooks when the call fails,
the forward pre-hooks on the arguments (global ones first), the input point (`path:in`,
there where a run names it), the backward hooks (an input side on the arguments, an
output side on the output: `call_with_backward_hooks`, the mechanism shared with
`jhooks.Node`), the forward hooks on the output (global ones first), the hooked
parameters, and innermost the class's own `__call__`. Then the output's named point for
`run_with_hooks` / `run_with_cache`. With no hook registered (and no global hook) it
calls the class's `__call__` directly, so the traced program is the plain Equinox one.

Every chain of hooks runs through `_core.run_chain`, the one loop shared with value
hooks and backward hooks: a non-`None` return replaces the value once checked.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._autograd import call_with_backward_hooks, register_hook
from .._core import check_like, describe, hook_name, run_chain
from .._runs import (
    hookable_call,
    input_point,
    named_point,
    names_unkeyed,
    outermost_call,
    point_scope,
)
from .._staging import calls_model
from ._frameworks import framework_of
from ._globals import GLOBAL
from ._kinds import ForwardEntry
from ._names import children, dotted, identity
from ._registry import Registry, owner, registry_of

# Parameter hooks


def _parameter_hooks(fns: list[Callable], name: str, where: str) -> Callable:
    def check(fn: Callable, new: Any, grad: Any) -> Any:
        return check_like(fn, new, grad, "gradient", f"on parameter {name!r} of {where}")

    def parameter_hooks(grad: Any) -> Any:
        at = f"on parameter {name!r} of {where}"
        return run_chain(fns, grad, lambda fn, g: fn(g), check, where=at)

    return parameter_hooks


def _parameter_keys(module: Any) -> tuple[list[Any], dict[str, Any]]:
    """For each leaf of `module` (in `jax.tree.leaves` order), which parameter it is:
    `(identity of the module holding it, its name in that module)`, or `None` for a
    leaf that is not an array. And the key of each dotted name from `module`; a
    module that appears twice keeps the name of its first appearance, as in
    `named_parameters`."""
    keys: list[Any] = []
    names: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        for path, leaf in children(node):
            if isinstance(leaf, eqx.Module):
                walk(dotted(prefix, path), leaf)
            elif eqx.is_array(leaf):
                key = (identity(node), dotted("", path))
                keys.append(key)
                names.setdefault(dotted(prefix, path), key)
            else:
                keys.append(None)

    walk("", module)
    return keys, names


def _with_parameter_hooks(module: Any, registry: Registry, where: str) -> Any:
    """`module` with each hooked parameter wrapped in a value hook chain.

    The parameters are wrapped once per call of the module that holds the hooks. A
    parameter that appears several times (a submodule shared by two parents) is
    wrapped once and that one value used at every appearance, so the hooks see the
    gradient summed over every use inside the call, as PyTorch's one parameter.
    """
    hooked = {name: list(hooks.values()) for name, hooks in registry.parameters.items() if hooks}
    if not hooked:
        return module
    leaves, treedef = jtu.tree_flatten(module)
    keys, names = _parameter_keys(module)
    assert len(keys) == len(leaves)
    chains = {names[name]: (name, fns) for name, fns in hooked.items() if name in names}
    wrapped: dict[Any, Any] = {}
    new = []
    for key, leaf in zip(keys, leaves):
        if key in chains:
            if key not in wrapped:
                name, fns = chains[key]
                wrapped[key] = register_hook(leaf, _parameter_hooks(fns, name, where))
            leaf = wrapped[key]
        new.append(leaf)
    return jtu.tree_unflatten(treedef, new)


# Forward pre-hooks and forward hooks


def _accept_pre_hook(where: str) -> Callable[[ForwardEntry, Any, tuple], tuple]:
    def accept(entry: ForwardEntry, new: Any, old: tuple) -> tuple:
        args, kwargs, changed = old
        if entry.with_kwargs:
            if not (
                isinstance(new, tuple)
                and len(new) == 2
                and isinstance(new[0], (tuple, list))
                and isinstance(new[1], dict)
            ):
                raise ValueError(
                    f"forward pre-hook {hook_name(entry.fn)} of {where} was registered with "
                    f"with_kwargs=True and returned {describe(new)}: it must return None or "
                    "a pair (args, kwargs) of a tuple and a dict."
                )
            new_args, kwargs = tuple(new[0]), new[1]
        else:
            new_args = tuple(new) if isinstance(new, tuple) else (new,)
        if len(new_args) != len(args):
            changed = entry.fn
        return new_args, kwargs, changed

    return accept


def _call_pre_hook(module: Any) -> Callable[[ForwardEntry, tuple], Any]:
    def call(entry: ForwardEntry, value: tuple) -> Any:
        args, kwargs, _ = value
        return entry.fn(module, args, kwargs) if entry.with_kwargs else entry.fn(module, args)

    return call


def _bound(hook: Callable, module: Any) -> Callable:
    """`hook` with `module` as its first argument, named as `hook` in errors."""

    @functools.wraps(hook)
    def bound(*args: Any) -> Any:
        return hook(module, *args)

    return bound


def _shape_of(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x


# The call as stages, outermost first: each stage is `stage(call, inner)` and calls
# `inner(call)` for the rest of the pipeline, as Flax's `run_interceptors` composes
# interceptors. `Call` is what the stages share.


@dataclasses.dataclass
class Call:
    """One call of a hooked module, as the stages see it and change it."""

    module: Any
    registry: Registry
    raw: Callable  # the class's own `__call__`
    args: tuple
    kwargs: dict
    where: str  # the module, for errors
    forward_hooks: list[tuple[int, ForwardEntry]]  # global ones first
    called: set[int] = dataclasses.field(default_factory=set)  # forward hooks run
    output: Any = None  # the output so far (what `always_call` hooks get)


Stage = Callable[[Call, Callable[[Call], Any]], Any]


def _always_call_stage(call: Call, inner: Callable[[Call], Any]) -> Any:
    """As PyTorch: forward hooks registered with `always_call=True` run even when the
    call fails (those that did not run yet), and the original error is raised again."""
    try:
        return inner(call)
    except Exception:
        for item in call.forward_hooks:
            hook_id, entry = item
            if entry.always_call and hook_id not in call.called:
                try:
                    call.output = _run_forward_hooks(call, [item], call.output)
                except Exception as hook_error:
                    warnings.warn(
                        f"forward hook {hook_name(entry.fn)} of {call.where} with "
                        "always_call=True raised an exception that was silenced as another "
                        f"error was raised in forward: {hook_error}",
                        stacklevel=4,
                    )
        raise


def _forward_pre_stage(call: Call, inner: Callable[[Call], Any]) -> Any:
    """PyTorch's forward pre-hooks (global ones first) replace the arguments."""
    pre_hooks = [*GLOBAL.forward_pre.values(), *call.registry.forward_pre.values()]
    n_args = len(call.args)
    call.args, call.kwargs, changed_arity = run_chain(
        pre_hooks,
        (call.args, call.kwargs, None),
        _call_pre_hook(call.module),
        _accept_pre_hook(call.where),
        where=f"of {call.where}",
    )
    try:
        return inner(call)
    except TypeError as e:
        if changed_arity is None:
            raise
        raise TypeError(
            f"{call.where} raised TypeError after forward pre-hook {hook_name(changed_arity)} "
            f"changed its positional arguments from {n_args} to {len(call.args)}: {e}"
        ) from e


def _input_stage(call: Call, inner: Callable[[Call], Any]) -> Any:
    """The arguments (after the forward pre-hooks) are the point `path:in`, where a run
    asks for it by name."""
    call.args = input_point(call.args, call.registry.path, call.registry.aliases)
    return inner(call)


def _backward_stage(call: Call, inner: Callable[[Call], Any]) -> Any:
    """PyTorch's `BackwardHook`: identity wrappers on the arrays going in and coming out
    (`call_with_backward_hooks`, shared with `jhooks.Node`). Backward hooks get the
    module's structure without its arrays: those are values of the forward pass,
    which JAX cannot use in the backward pass."""
    registry = call.registry
    backward_pre = [*GLOBAL.full_backward_pre.values(), *registry.full_backward_pre.values()]
    backward = [*GLOBAL.full_backward.values(), *registry.full_backward.values()]
    if not (backward_pre or backward):
        return inner(call)
    framework = framework_of(call.module)
    if framework is None:
        shapes = jtu.tree_map(_shape_of, call.module)
    else:
        shapes = framework.shapes(call.module)
    backward_pre = [_bound(h, shapes) for h in backward_pre]
    backward = [_bound(h, shapes) for h in backward]

    def forward(*args: Any, **kwargs: Any) -> Any:
        call.args, call.kwargs = args, kwargs
        return inner(call)

    return call_with_backward_hooks(
        forward, call.args, call.kwargs, backward_pre, backward, call.where
    )


def _run_forward_hooks(call: Call, hooks: list[tuple[int, ForwardEntry]], output: Any) -> Any:
    def run(item: tuple[int, ForwardEntry], out: Any) -> Any:
        hook_id, entry = item
        call.called.add(hook_id)
        try:
            if entry.with_kwargs:
                return entry.fn(call.module, call.args, call.kwargs, out)
            return entry.fn(call.module, call.args, out)
        except TypeError as e:
            if not isinstance(out, tuple):
                raise
            raise TypeError(
                f"forward hook {hook_name(entry.fn)} of {call.where} raised TypeError: {e}. "
                f"It was given the module's output {describe(out)}, a tuple (a stateful "
                "layer returns `(y, state)`): return None or an output of that structure, "
                "e.g. `(y * 0.5, state)`."
            ) from e

    def accept(item: tuple[int, ForwardEntry], new: Any, old: Any) -> Any:
        if old is not None:  # an always_call hook after a failed call gets None
            check_like(item[1].fn, new, old, "output", f"of {call.where}")
        call.output = new
        return new

    return run_chain(hooks, output, run, accept, where=f"of {call.where}")


def _forward_stage(call: Call, inner: Callable[[Call], Any]) -> Any:
    """PyTorch's forward hooks (global ones first) read or replace the output."""
    call.output = inner(call)
    return _run_forward_hooks(call, call.forward_hooks, call.output)


def _parameter_stage(call: Call, inner: Callable[[Call], Any]) -> Any:
    """Hooked parameters wrapped in value hook chains (`register_parameter_hook`)."""
    framework = framework_of(call.module)
    if framework is None:
        call.module = _with_parameter_hooks(call.module, call.registry, call.where)
        return inner(call)
    # A Flax NNX module is mutable, and what its call updates (batch statistics, RNG
    # counts) must reach the caller: its parameters are wrapped in place for the call.
    chains = {
        name: _parameter_hooks(list(hooks.values()), name, call.where)
        for name, hooks in call.registry.parameters.items()
        if hooks
    }
    with framework.parameters_hooked(call.module, chains):
        return inner(call)


STAGES: tuple[Stage, ...] = (
    _always_call_stage,
    _forward_pre_stage,
    _input_stage,
    _backward_stage,
    _forward_stage,
    _parameter_stage,
)


def _through(stages: tuple[Stage, ...], innermost: Callable[[Call], Any]) -> Callable[[Call], Any]:
    """`stages` composed around `innermost`, the first stage outermost."""
    if not stages:
        return innermost
    stage, inner = stages[0], _through(stages[1:], innermost)
    return lambda call: stage(call, inner)


@calls_model
def _call_raw(call: Call) -> Any:
    return call.raw(call.module, *call.args, **call.kwargs)


@calls_model
def hooked_call(module: Any, raw: Callable, args: tuple, kwargs: dict) -> Any:
    """Calls `raw(module, *args, **kwargs)`, the class's own `__call__`, with the hooks.
    The outermost call feeds `jhooks.loop_index()` to its hooks (`_runs/_module_runs.py`)."""
    return outermost_call(module, args, kwargs, lambda m, a, k: _hooked_call(m, raw, a, k), raw)


def _hooked_call(module: Any, raw: Callable, args: tuple, kwargs: dict) -> Any:
    return hookable_call(_scoped_call, module, raw, args, kwargs)


@calls_model
def _scoped_call(module: Any, raw: Callable, args: tuple, kwargs: dict) -> Any:
    registry = registry_of(module)
    if names_unkeyed():  # a cache keyed without this module's name: it must be itself
        registry.pinned = True
    # The points reached inside the call are named under the module's path.
    with point_scope(registry.path, registry.aliases):
        if registry.active() or GLOBAL.active():
            forward_hooks = [*GLOBAL.forward.items(), *registry.forward.items()]
            call = Call(module, registry, raw, args, kwargs, owner(module), forward_hooks)
            out = _through(STAGES, _call_raw)(call)
        else:
            out = raw(module, *input_point(args, registry.path, registry.aliases), **kwargs)
    # Every submodule's output is a named point too, for run_with_hooks/run_with_cache.
    if not registry.path:
        return out
    return named_point(out, registry.path, aliases=registry.aliases)


def wrap_call(raw: Callable) -> Callable:
    """The `__call__` of a hookable class whose own `__call__` is `raw`."""

    @functools.wraps(raw)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if type(self).__call__ is not __call__:
            # Reached through `super().__call__(...)` from a subclass's own call,
            # which runs the hooks already: run them once per call, as PyTorch.
            return raw(self, *args, **kwargs)
        return hooked_call(self, raw, args, kwargs)

    __call__._jhooks_raw = raw  # type: ignore[attr-defined]
    calls_model(__call__)
    return __call__

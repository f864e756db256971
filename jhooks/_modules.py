"""Module hooks: PyTorch's `nn.Module` hooks for Equinox modules.

A hookable module is an instance of a subclass of [`jhooks.Module`][]: either a class
the user wrote on that base, or, for any other `eqx.Module` class (stock `eqx.nn`
layers included), a subclass made once per class by `hookable`, which keeps the
class's name, fields, methods and pytree leaves and adds

- one static field, `_jhooks`, holding the module's hook registry. A static field is
  part of the pytree structure, so every copy that JAX or Equinox makes of the
  module (`jax.tree.map`, `eqx.apply_updates`, optax updates, `filter_jit`,
  `tree_deserialise_leaves`) holds the same registry: copies share hooks, as the
  one PyTorch module object would. The registry compares by identity.
- a `__call__` that runs the hooks around the class's own `__call__`, the way
  PyTorch's `Module._call_impl` does: forward pre-hooks on the arguments, the
  backward hooks' input side, the forward, the forward hooks on the output, the
  backward hooks' output side (`call_with_backward_hooks`, the mechanism shared with
  `jhooks.Node`). With no hook registered (and no global hook) it calls the class's
  `__call__` directly, so the traced program is the plain Equinox one.

Every registration returns a `RemovableHandle`, whose creation and removal change the
jit cache key, so a jitted function retraces when hooks change and gets its old
program back when they are removed.

Importing jhooks gives `eqx.Module` a `__getattr__` (only reached when normal attribute
lookup fails, so nothing else changes) whose error for `register_*` names on a module
that is not hookable says to call `jhooks.hookable` first, instead of Python's bare
"object has no attribute".
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._backward_hooks import call_with_backward_hooks
from ._checks import check_callable, check_like, describe, hook_name
from ._globals import GLOBAL, ForwardHook, ModuleHooks
from ._handles import Hooks, RemovableHandle, add_hook
from ._names import dotted, named_modules, named_parameters
from ._points import hook_point
from ._values import register_hook

T = TypeVar("T")


class _Registry(ModuleHooks):
    """The hooks of one module, held in its static `_jhooks` field.

    Hashes and compares by identity (so jit caches key on which module it is, never
    on which hooks it holds: those are in the jit key of `_handles.py`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.path = ""  # from the root last given to `hookable`; "" for the root
        self.parameters: dict[str, Hooks] = {}  # dotted name -> hooks on that parameter

    def active(self) -> bool:
        return super().active() or any(self.parameters.values())

    def __repr__(self) -> str:
        return f"<jhooks registry of module {self.path!r}>"


def _registry(module: Any, what: str = "register a hook on") -> _Registry:
    registry = module.__dict__.get("_jhooks") if isinstance(module, eqx.Module) else None
    if not isinstance(registry, _Registry):
        raise TypeError(
            f"cannot {what} {type(module).__name__}: it is not hookable. Call "
            "`model = jhooks.hookable(model)` on the whole model first and use the model it "
            "returns (or build the model from classes that subclass `jhooks.Module`)."
        )
    return registry


def module_path(module: eqx.Module) -> str:
    """The dotted path of a hookable module from the root given to `hookable` ("" for it)."""
    return _registry(module, "find the path of").path


def _owner(module: Any) -> str:
    """How errors name a module: `module 'fc1' (Linear)`."""
    return f"module {module_path(module)!r} ({type(module).__name__})"


# The call


def _bound(hook: Callable, module: Any) -> Callable:
    """`hook` with `module` as its first argument, named as `hook` in errors."""

    @functools.wraps(hook)
    def bound(*args: Any) -> Any:
        return hook(module, *args)

    return bound


def _shape_of(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x


def _parameter_hooks(fns: list[Callable], name: str, owner: str) -> Callable:
    def parameter_hooks(grad: Any) -> Any:
        for fn in fns:
            new = fn(grad)
            if new is not None:
                check_like(fn, new, grad, "gradient", f"on parameter {name!r} of {owner}")
                grad = new
        return grad

    return parameter_hooks


def _with_parameter_hooks(module: Any, registry: _Registry, owner: str) -> Any:
    """`module` with each hooked parameter wrapped in a value hook chain.

    The parameters are wrapped once per call of the module that holds the hooks, so
    every use inside that call adds to the one gradient the hooks see.
    """
    hooked = {name: list(hooks.values()) for name, hooks in registry.parameters.items() if hooks}
    if not hooked:
        return module
    leaves, treedef = jtu.tree_flatten_with_path(module)
    new = []
    for path, leaf in leaves:
        fns = hooked.get(dotted("", path))
        if fns:
            leaf = register_hook(leaf, _parameter_hooks(fns, dotted("", path), owner))
        new.append(leaf)
    return jtu.tree_unflatten(treedef, new)


def _run_pre_hooks(
    hooks: list[ForwardHook], module: Any, args: tuple, kwargs: dict, owner: str
) -> tuple[tuple, dict, Callable | None]:
    changed_arity = None
    for entry in hooks:
        n_args = len(args)
        if entry.with_kwargs:
            new = entry.fn(module, args, kwargs)
            if new is None:
                continue
            if not (
                isinstance(new, tuple)
                and len(new) == 2
                and isinstance(new[0], (tuple, list))
                and isinstance(new[1], dict)
            ):
                raise ValueError(
                    f"forward pre-hook {hook_name(entry.fn)} of {owner} was registered with "
                    f"with_kwargs=True and returned {describe(new)}: it must return None or "
                    "a pair (args, kwargs) of a tuple and a dict."
                )
            args, kwargs = tuple(new[0]), new[1]
        else:
            new = entry.fn(module, args)
            if new is None:
                continue
            args = tuple(new) if isinstance(new, tuple) else (new,)
        if len(args) != n_args:
            changed_arity = entry.fn
    return args, kwargs, changed_arity


def _call_with_hooks(
    module: Any, registry: _Registry, raw: Callable, args: tuple, kwargs: dict
) -> Any:
    # PyTorch's Module._call_impl, with the backward hooks of _backward_hooks.py.
    owner = _owner(module)
    pre_hooks = [*GLOBAL.forward_pre.values(), *registry.forward_pre.values()]
    forward_hooks = [*GLOBAL.forward.items(), *registry.forward.items()]
    # Backward hooks get the module's structure without its arrays: those are
    # values of the forward pass, which JAX cannot use in the backward pass.
    shapes = jtu.tree_map(_shape_of, module)
    backward_pre = [
        _bound(h, shapes) for h in (*GLOBAL.backward_pre.values(), *registry.backward_pre.values())
    ]
    backward = [_bound(h, shapes) for h in (*GLOBAL.backward.values(), *registry.backward.values())]
    called: set[int] = set()
    result = None

    def forward(*call_args: Any, **call_kwargs: Any) -> Any:
        nonlocal args, kwargs, result
        args, kwargs = call_args, call_kwargs
        result = raw(_with_parameter_hooks(module, registry, owner), *args, **kwargs)
        for hook_id, entry in forward_hooks:
            if entry.always_call:
                called.add(hook_id)
            result = run_forward_hook(entry)
        return result

    def run_forward_hook(entry: ForwardHook) -> Any:
        if entry.with_kwargs:
            new = entry.fn(module, args, kwargs, result)
        else:
            new = entry.fn(module, args, result)
        return result if new is None else new

    try:
        n_args = len(args)
        args, kwargs, changed_arity = _run_pre_hooks(pre_hooks, module, args, kwargs, owner)
        try:
            if backward_pre or backward:
                return call_with_backward_hooks(
                    forward, args, kwargs, backward_pre, backward, owner
                )
            return forward(*args, **kwargs)
        except TypeError as e:
            if changed_arity is None:
                raise
            raise TypeError(
                f"{owner} raised TypeError after forward pre-hook {hook_name(changed_arity)} "
                f"changed its positional arguments from {n_args} to {len(args)}: {e}"
            ) from e
    except Exception:
        # As PyTorch: hooks registered with always_call=True run even when the call
        # fails, and the original error is raised again.
        for hook_id, entry in forward_hooks:
            if entry.always_call and hook_id not in called:
                try:
                    result = run_forward_hook(entry)
                except Exception as hook_error:
                    warnings.warn(
                        f"forward hook {hook_name(entry.fn)} of {owner} with always_call=True "
                        "raised an exception that was silenced as another error was raised "
                        f"in forward: {hook_error}",
                        stacklevel=3,
                    )
        raise


def _hooked_call(module: Any, raw: Callable, args: tuple, kwargs: dict) -> Any:
    """Calls `raw(module, *args, **kwargs)`, the class's own `__call__`, with the hooks."""
    registry = _registry(module)
    if registry.active() or GLOBAL.active():
        out = _call_with_hooks(module, registry, raw, args, kwargs)
    else:
        out = raw(module, *args, **kwargs)
    # Every submodule's output is a named point too, for run_with_hooks/run_with_cache.
    return hook_point(out, registry.path) if registry.path else out


def _wrap_call(raw: Callable) -> Callable:
    @functools.wraps(raw)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if type(self).__call__ is not __call__:
            # Reached through `super().__call__(...)` from a subclass's own call,
            # which runs the hooks already: run them once per call, as PyTorch.
            return raw(self, *args, **kwargs)
        return _hooked_call(self, raw, args, kwargs)

    __call__._jhooks_raw = raw  # type: ignore[attr-defined]
    return __call__


# Making modules hookable


def _convert(tree: Any, memo: dict[int, Any]) -> Any:
    """`tree` with every module in it (outside static fields) hookable."""

    def one(x: Any) -> Any:
        if not isinstance(x, eqx.Module):
            return x
        if id(x) not in memo:  # the same module twice stays one module
            memo[id(x)] = _convert_module(x, memo)
        return memo[id(x)]

    return jtu.tree_map(one, tree, is_leaf=lambda x: isinstance(x, eqx.Module))


def _dynamic_fields(module: eqx.Module) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(module)
        if not f.metadata.get("static", False) and f.name in module.__dict__
    ]


def _convert_module(module: eqx.Module, memo: dict[int, Any]) -> eqx.Module:
    new = object.__new__(_hookable_class(type(module)))
    new.__dict__.update(module.__dict__)
    for name in _dynamic_fields(module):
        new.__dict__[name] = _convert(module.__dict__[name], memo)
    if not isinstance(new.__dict__.get("_jhooks"), _Registry):
        new.__dict__["_jhooks"] = _Registry()
    return new


def _adopt(root: Any) -> None:
    """Names every hookable module under `root` by its path from it."""
    for path, module in named_modules(root):
        registry = module.__dict__.get("_jhooks")
        if isinstance(registry, _Registry):
            registry.path = path


_classes: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def _has_call(cls: type) -> bool:
    return any("__call__" in klass.__dict__ for klass in cls.__mro__[:-1])


def _hookable_class(cls: type) -> type:
    """`cls` itself if it subclasses `jhooks.Module`, else its hookable subclass."""
    if issubclass(cls, Module):
        return cls
    if cls not in _classes:

        def body(ns: dict[str, Any]) -> None:
            ns["__module__"] = cls.__module__
            ns["__qualname__"] = cls.__qualname__
            ns["__doc__"] = cls.__doc__
            if _has_call(cls):
                ns["__call__"] = _wrap_call(cls.__call__)  # type: ignore[operator]

        _classes[cls] = types.new_class(cls.__name__, (cls, Module), exec_body=body)
    return _classes[cls]


def hookable(model: T) -> T:
    """Makes every Equinox module in `model` able to hold hooks, as PyTorch modules do.

    **Arguments:**

    - `model`: an Equinox module (or any pytree of modules), built from any
        `eqx.Module` classes: the user's, or stock `eqx.nn` layers.

    **Returns:**

    The same model, whose every module (itself, its submodules, and modules inside
    lists, tuples and dicts) has the `register_*` methods of [`jhooks.Module`][]. Each
    module becomes an instance of a subclass of its class made for the purpose (same
    name, fields, methods and behaviour), so `isinstance`, attribute access and the
    pytree leaves are unchanged. Hooks are registered in place and shared by every
    copy of the model that JAX, Equinox or optax make (see [`jhooks.Module`][]).
    Modules that are already hookable keep their hooks; a module that appears twice
    in `model` stays one module, with one set of hooks.

    Each module is named by its dotted path from `model` (`""`, `"fc1"`,
    `"layers.0"`), which errors use.

    **Example:**

    ```python
    net = jhooks.hookable(eqx.nn.MLP(2, 1, 8, 2, key=key))
    h = net.layers[0].register_forward_hook(lambda m, args, out: jnp.tanh(out))
    ```
    """
    leaves = jtu.tree_leaves(model, is_leaf=lambda x: isinstance(x, eqx.Module))
    if not any(isinstance(x, eqx.Module) for x in leaves):
        raise TypeError(
            f"jhooks.hookable expects an Equinox module (or a pytree holding modules), got "
            f"{type(model).__name__}."
        )
    model = _convert(model, {})
    _adopt(model)
    return model


class _HookableMeta(type(eqx.Module)):  # type: ignore[misc]
    def __new__(mcs, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> Any:
        call = namespace.get("__call__")
        if call is not None and not hasattr(call, "_jhooks_raw"):
            namespace["__call__"] = _wrap_call(call)
        return super().__new__(mcs, name, bases, namespace, **kwargs)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        self = super().__call__(*args, **kwargs)
        memo: dict[int, Any] = {}
        for name in _dynamic_fields(self):
            self.__dict__[name] = _convert(self.__dict__[name], memo)
        _adopt(self)
        return self


class Module(eqx.Module, metaclass=_HookableMeta):
    """An `eqx.Module` that can hold hooks, as a PyTorch `nn.Module` can.

    Subclass it instead of `eqx.Module` (the same dataclass fields, `__init__` and
    `__call__` as usual); submodules built from any `eqx.Module` class, stock `eqx.nn`
    layers included, are made hookable when the instance is constructed. Or build the
    model as usual and call [`jhooks.hookable`][] on it, which makes every module in it
    an instance of (a subclass of) this class.

    Hooks run when the module is called (`module(*args, **kwargs)`), in PyTorch's
    order: global forward pre-hooks, the module's forward pre-hooks, its `__call__`,
    global forward hooks, the module's forward hooks; in the backward pass, global
    backward pre-hooks, the module's backward pre-hooks, then global and the module's
    full backward hooks. Hook signatures and return rules are PyTorch's.

    - Forward hooks run while JAX traces the call, on tracers; they may replace the
        arguments or the output. Wrap a hook in [`jhooks.host`][] to see concrete
        values each time a jitted step runs.
    - Equinox modules are called per example under `jax.vmap`, so hooks see
        PyTorch's shapes minus the batch dimension: under `jax.vmap(model)`, `args`,
        `output`, `grad_input` and `grad_output` are one example's.
    - Backward hooks get, as `module`, the module with each array replaced by a
        `jax.ShapeDtypeStruct`: its type, static fields, path and shapes are there,
        but not its weights, which are values of the forward pass that JAX cannot use
        in the backward pass.
    - Registration is in place and returns a [`jhooks.RemovableHandle`][]. A jitted
        function retraces when hooks are added or removed, and never runs a stale set.
    - Copies share hooks: a hook registered on a module is on every copy that JAX,
        Equinox or optax make of it (`jax.tree.map`, `eqx.apply_updates`,
        `eqx.tree_deserialise_leaves` with the model as `like`, the model returned by a
        training step), as the one PyTorch module object would be; its handle removes
        it from all of them.

    **Example:**

    ```python
    class Net(jhooks.Module):
        fc1: eqx.nn.Linear

        def __call__(self, x):
            return jax.nn.relu(self.fc1(x))

    net = Net(eqx.nn.Linear(3, 4, key=key))
    h = net.fc1.register_forward_hook(lambda module, args, out: out * 2)
    ```
    """

    _jhooks: _Registry = eqx.field(static=True, init=False, repr=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls, *args, **kwargs)
        object.__setattr__(self, "_jhooks", _Registry())
        return self

    def register_forward_pre_hook(
        self,
        hook: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
    ) -> RemovableHandle:
        """Adds a hook run before the module's `__call__`: PyTorch's method of the same name.

        **Arguments:**

        - `hook`: `hook(module, args) -> None | args`, where `args` is the tuple of
            positional arguments; a returned non-tuple is wrapped as `(value,)`. With
            `with_kwargs=True`, `hook(module, args, kwargs) -> None | (args, kwargs)`.
        - `prepend`: run before the module's other forward pre-hooks (global ones
            still run first).
        - `with_kwargs`: pass and let the hook replace the keyword arguments.

        **Returns:**

        A [`jhooks.RemovableHandle`][].

        **Example:**

        ```python
        net.fc1.register_forward_pre_hook(lambda module, args: args[0] * 2)
        ```
        """
        check_callable(hook)
        return add_hook(
            _registry(self).forward_pre, ForwardHook(hook, with_kwargs), prepend=prepend
        )

    def register_forward_hook(
        self,
        hook: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> RemovableHandle:
        """Adds a hook run after the module's `__call__`: PyTorch's method of the same name.

        **Arguments:**

        - `hook`: `hook(module, args, output) -> None | output`; a non-`None` return
            replaces the output. With `with_kwargs=True`,
            `hook(module, args, kwargs, output)`.
        - `prepend`: run before the module's other forward hooks.
        - `with_kwargs`: pass the keyword arguments too.
        - `always_call`: run the hook even when the call raises (at trace time),
            with `output=None`; the error is then raised again.

        **Returns:**

        A [`jhooks.RemovableHandle`][].

        **Example:**

        ```python
        net.fc1.register_forward_hook(lambda module, args, out: jnp.clip(out, -1, 1))
        ```
        """
        check_callable(hook)
        entry = ForwardHook(hook, with_kwargs, always_call)
        return add_hook(_registry(self).forward, entry, prepend=prepend)

    def register_full_backward_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """Adds a hook on the gradients of the module's outputs: PyTorch's method.

        **Arguments:**

        - `hook`: `hook(module, grad_output) -> None | grad_output` (`module` with
            shapes in place of arrays, see [`jhooks.Module`][]). `grad_output`
            is a tuple with an entry per array leaf of the output (`None` for an
            integer one, or one that no gradient reached); a returned tuple of the
            same length and shapes replaces it.
        - `prepend`: run before the module's other backward pre-hooks.

        **Returns:**

        A [`jhooks.RemovableHandle`][].

        **Example:**

        ```python
        net.fc1.register_full_backward_pre_hook(lambda module, g: (g[0] * 2,))
        ```
        """
        check_callable(hook)
        return add_hook(_registry(self).backward_pre, hook, prepend=prepend)

    def register_full_backward_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """Adds a hook on the gradients of the module's inputs: PyTorch's method.

        **Arguments:**

        - `hook`: `hook(module, grad_input, grad_output) -> None | grad_input`
            (`module` with shapes in place of arrays). `grad_input` has an entry
            per positional argument of the call (`None` for one that is not a
            floating array); a returned tuple of the same
            length and shapes replaces it. When no argument is differentiated the
            hook is called with `None` entries and must return `None`, as in
            PyTorch. Keyword arguments and parameters have no entry.
        - `prepend`: run before the module's other full backward hooks.

        **Returns:**

        A [`jhooks.RemovableHandle`][].

        **Example:**

        ```python
        net.act.register_full_backward_hook(lambda m, gi, go: (jnp.maximum(gi[0], 0),))
        ```
        """
        check_callable(hook)
        return add_hook(_registry(self).backward, hook, prepend=prepend)

    def register_backward_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """PyTorch's deprecated name: warns, and registers a full backward hook.

        **Arguments:**

        - `hook`: as for [`jhooks.Module.register_full_backward_hook`][].

        **Returns:**

        A [`jhooks.RemovableHandle`][].
        """
        check_callable(hook)
        warnings.warn(
            f"register_backward_hook is deprecated, as in PyTorch: use "
            f"register_full_backward_hook. {hook_name(hook)} is registered on "
            f"{_owner(self)} as a full backward hook.",
            FutureWarning,
            stacklevel=2,
        )
        return add_hook(_registry(self).backward, hook)

    def register_parameter_hook(self, name: str, fn: Callable[..., Any]) -> RemovableHandle:
        """Adds a gradient hook on a parameter: PyTorch's `param.register_hook(fn)`.

        **Arguments:**

        - `name`: the parameter's dotted name from this module, as listed by
            [`jhooks.named_parameters`][] (`"fc1.bias"`).
        - `fn`: `fn(grad) -> None | grad`, with a gradient of the parameter's shape
            and dtype; a non-`None` return replaces it. Several hooks on one
            parameter run in registration order.

        **Returns:**

        A [`jhooks.RemovableHandle`][].

        The parameter is wrapped when this module is called, so `fn` runs once per
        call of this module in a differentiated function, with the gradient summed
        over every use of the parameter inside that call: once per differentiation,
        with the total gradient, when the model is called once (as PyTorch). Under
        `jax.vmap(model)` the parameter is shared by the examples, so `fn` still
        sees the total gradient over the batch; under `jax.vmap(jax.grad(loss))`
        it sees each example's gradient (per-example clipping). If the module is
        called twice in one differentiated function, `fn` runs twice, each time
        with that call's share of the gradient: register the hook on a module
        that encloses both calls to get the total.

        **Example:**

        ```python
        net.register_parameter_hook("fc1.bias", jnp.zeros_like)  # freeze fc1.bias
        ```
        """
        check_callable(fn)
        registry = _registry(self)
        params = dict(named_parameters(self))
        if name not in params:
            raise ValueError(
                f"register_parameter_hook({name!r}, {hook_name(fn)}) on {_owner(self)}: "
                f"no such parameter. Valid names: {', '.join(params) or 'none'}."
            )
        if not jnp.issubdtype(params[name].dtype, jnp.inexact):
            raise TypeError(
                f"register_parameter_hook({name!r}, {hook_name(fn)}) on {_owner(self)}: "
                f"the parameter is {describe(params[name])}; only floating-point arrays "
                "have gradients."
            )
        return add_hook(registry.parameters.setdefault(name, Hooks()), fn)


_METHODS = frozenset(name for name in vars(Module) if name.startswith("register_"))


def _missing_attribute(self: Any, name: str) -> Any:
    # Only reached when normal lookup fails: turns "'Linear' object has no attribute
    # 'register_forward_hook'" into an error that says what to call first.
    if name in _METHODS:
        raise AttributeError(
            f"{type(self).__name__}.{name}: this module is not hookable. Call "
            "`model = jhooks.hookable(model)` on the whole model first and use the model "
            "it returns (or subclass `jhooks.Module` instead of `eqx.Module`).",
            name=name,
            obj=self,
        )
    raise AttributeError(
        f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
    )


if "__getattr__" not in vars(eqx.Module):
    eqx.Module.__getattr__ = _missing_attribute  # type: ignore[attr-defined]

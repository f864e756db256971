"""Making modules hookable: `jhooks.hookable`, the `jhooks.Module` base class, pickling.

A hookable module is an instance of a subclass of `jhooks.Module`: either a class the
user wrote on that base, or, for any other `eqx.Module` class (stock `eqx.nn` layers
included), a subclass made once per class by `hookable`, which keeps the class's name,
fields, methods and pytree leaves, and adds the static `_jhooks` registry field
(`_registry.py`) and a `__call__` that runs the hooks (`_call.py`).

Equinox's own internal modules keep their class (`_names.is_equinox_internal`):
`eqx.nn.StateIndex` (a key of `eqx.nn.State`, which must be exactly that class), and
every other module class of Equinox that is not a public layer of `eqx.nn`
(`eqx.Partial`, bound methods, the `filter_*` wrappers, private helpers): they are not
layers. Their submodules are still made hookable.

Importing jhooks changes no class of Equinox or JAX. The first call of `hookable` (or
the first `jhooks.Module` built) gives `eqx.Module` a `__getattr__`, reached only when
normal lookup fails, whose error for a `register_*` name on a module that is not
hookable says to call `jhooks.hookable` first (or, on the model given to `hookable`, to
use the one it returned); `JHOOKS_EXPLAIN_MISSING_HOOKS=0` leaves `eqx.Module` as it is.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu

from .._core import RemovableHandle, dynamic_field_names, field_values, new_module, set_field
from . import _register as _hooks
from ._call import wrap_call
from ._explain import explain_missing_hooks, given_to_hookable
from ._frameworks import framework_of, refusal_of
from ._methods import has_call, public_methods, wrap_method, wrap_public_methods
from ._names import is_equinox_internal, named_modules
from ._registry import Registry, adopt, claimed_elsewhere, registry_or_none

T = TypeVar("T")


def _convert(tree: Any, memo: dict[int, Any]) -> Any:
    """`tree` with every module in it (outside static fields) hookable."""

    def one(x: Any) -> Any:
        if not isinstance(x, eqx.Module):
            return x
        if id(x) not in memo:  # the same module twice stays one module
            memo[id(x)] = _convert_module(x, memo)
        return memo[id(x)]

    return jtu.tree_map(one, tree, is_leaf=lambda x: isinstance(x, eqx.Module))


def _convert_module(module: eqx.Module, memo: dict[int, Any]) -> eqx.Module:
    old = field_values(module)
    fields = {name: _convert(old[name], memo) for name in dynamic_field_names(module)}
    cls = type(module)
    if is_equinox_internal(cls):
        if all(fields[name] is old[name] for name in fields):
            return module
    else:
        cls = _hookable_class(cls)
    new: Any = new_module(cls, {**old, **fields})
    if cls is not type(module) and registry_or_none(new) is None:
        set_field(new, "_jhooks", Registry())
    return new


def _renew(tree: Any, stale: set[int], fresh: dict[int, Registry]) -> Any:
    """`tree` with a fresh registry (one per old one) for each registry in `stale`."""

    def one(x: Any) -> Any:
        if not isinstance(x, eqx.Module):
            return x
        old = field_values(x)
        fields = {name: _renew(old[name], stale, fresh) for name in dynamic_field_names(x)}
        registry = registry_or_none(x)
        if registry is None or id(registry) not in stale:
            if all(fields[name] is old[name] for name in fields):
                return x
        new: Any = new_module(type(x), {**old, **fields})
        if registry is not None and id(registry) in stale:
            set_field(new, "_jhooks", fresh.setdefault(id(registry), Registry()))
        return new

    return jtu.tree_map(one, tree, is_leaf=lambda x: isinstance(x, eqx.Module))


def _own(root: Any) -> Any:
    """`root` with fresh registries where another model named its modules elsewhere."""
    stale = claimed_elsewhere(root, named_modules)
    return _renew(root, stale, {}) if stale else root


def _adopt(root: Any) -> None:
    """Names every hookable module under `root` by its path from it."""
    adopt(root, named_modules)


class ClassCache:
    """The hookable subclass made of each class (`subclasses`) and the class each one was
    made from (`originals`), weakly keyed: one per kind of hookable class."""

    def __init__(self) -> None:
        self.subclasses: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()
        self.originals: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def hookable_subclass(cls: type, base: type, cache: ClassCache, **keywords: Any) -> type:
    """`cls` itself if it subclasses `base`, else the subclass of `cls` and `base`, made
    once per class and kept in `cache`.

    The subclass claims `cls`'s name, qualified name, module and docstring, and wraps
    `cls.__call__` (where it has one) to run the hooks (`_call.py`), else its public
    methods, whose calls are points (`_methods.py`). `keywords` go to the
    class statement (Flax NNX's `pytree=`). It cannot be pickled by name: `base` pickles
    its instances through `cache.originals`.
    """
    if issubclass(cls, base):
        return cls
    if cls not in cache.subclasses:

        def body(ns: dict[str, Any]) -> None:
            ns["__module__"] = cls.__module__
            ns["__qualname__"] = cls.__qualname__
            ns["__doc__"] = cls.__doc__
            if has_call(cls):
                ns["__call__"] = wrap_call(cls.__call__)  # type: ignore[attr-defined]
            else:  # used through other methods: their calls are points (`_methods.py`)
                for name, method in public_methods(cls).items():
                    ns[name] = wrap_method(method, name)

        new = types.new_class(cls.__name__, (cls, base), keywords, body)
        cache.subclasses[cls] = new
        cache.originals[new] = cls
    return cache.subclasses[cls]


_classes = ClassCache()


def _hookable_class(cls: type) -> type:
    """`cls` itself if it subclasses `jhooks.Module`, else its hookable subclass."""
    return hookable_subclass(cls, Module, _classes)


def unpickle(cls: type, state: dict[str, Any]) -> Any:
    """Rebuilds a module of the hookable subclass of `cls` from its `__dict__`."""
    return new_module(_hookable_class(cls), state)


def hookable(model: T) -> T:
    """Makes every Equinox module in `model` able to hold hooks, as PyTorch modules do.

    **Arguments:**

    - `model`: an Equinox module (or any pytree of modules), built from any
        `eqx.Module` classes: the user's, or stock `eqx.nn` layers, stateful ones
        (`BatchNorm`, `SpectralNorm`, made with `eqx.nn.make_with_state`) included.

    **Returns:**

    The same model, whose every module (itself, its submodules, and modules inside
    lists, tuples and dicts) has the `register_*` methods of [`jhooks.Module`][]. Each
    module becomes an instance of a subclass of its class made for the purpose (same
    name, fields, methods and behaviour), so `isinstance`, attribute access and the
    pytree leaves are unchanged. Hooks are registered in place and shared by every
    copy of the model that JAX, Equinox or optax make (see [`jhooks.Module`][]).
    Modules that are already hookable keep their hooks; a module that appears twice
    in `model` stays one module, with one set of hooks. A hookable module that
    another model names at a path it does not occupy in `model` (a block of one
    model reused in another's structure or stacked with `jax.tree.map`, a whole
    model inside a bigger one, or one made hookable on its own) gets a fresh, empty
    registry here, so that no model's names depend on another's `hookable` call.
    Hookable blocks without hooks stack with `jax.tree.map` (see
    [Other models](other_models.md#stacking-blocks-that-are-already-hookable)).
    Equinox's internal modules
    (`eqx.nn.StateIndex`, `eqx.Partial`, ...) keep their class.

    Each module is named by its dotted path from `model` (`""`, `"fc1"`,
    `"layers.0"`), which errors use. The model can be pickled; the copy has no hooks.

    A Flax NNX model (an `nnx.Module`) is made hookable **in place** and returned:
    each of its modules gets a hookable subclass of its class and a registry that
    `nnx.split`, `nnx.merge` and NNX's transforms carry along (see
    [Flax NNX](flax_nnx.md)). A Flax Linen or Haiku module raises a `TypeError`: it
    holds no state to keep hooks in, and runs name its calls instead (see [Flax Linen
    and Haiku models](other_models.md#flax-linen-and-haiku-models)).

    **Example:**

    ```python
    net = jhooks.hookable(eqx.nn.MLP(2, 1, 8, 2, key=key))
    h = net.layers[0].register_forward_hook(lambda m, args, out: jnp.tanh(out))
    ```
    """
    framework = framework_of(model)
    if framework is not None:  # a Flax NNX module: see `jhooks/_nnx`
        return framework.hookable(model)
    refusal = refusal_of(model)  # a Flax Linen or Haiku module: see `jhooks/_linen_haiku`
    if refusal is not None:
        raise TypeError(f"jhooks.hookable cannot make {type(model).__name__} hookable: {refusal}")
    leaves = jtu.tree_leaves(model, is_leaf=lambda x: isinstance(x, eqx.Module))
    if not any(isinstance(x, eqx.Module) for x in leaves):
        raise TypeError(
            f"jhooks.hookable expects an Equinox module (or a pytree holding modules), got "
            f"{type(model).__name__}."
        )
    explain_missing_hooks(Module)
    given, model = model, _own(_convert(model, {}))
    _adopt(model)
    if model is not given and isinstance(given, eqx.Module):
        given_to_hookable[id(given)] = given
    return model


class _HookableMeta(type(eqx.Module)):  # type: ignore[misc]
    def __new__(mcs, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> Any:
        call = namespace.get("__call__")
        if call is not None and not hasattr(call, "_jhooks_raw"):
            namespace["__call__"] = wrap_call(call)
        elif call is None and any(isinstance(b, _HookableMeta) for b in bases):  # not `Module`
            wrap_public_methods(namespace, bases)  # used through other methods, if no call
        return super().__new__(mcs, name, bases, namespace, **kwargs)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        explain_missing_hooks(Module)
        self = super().__call__(*args, **kwargs)
        memo: dict[int, Any] = {}
        fields = field_values(self)
        for name in dynamic_field_names(self):
            set_field(self, name, _convert(fields[name], memo))
        stale = claimed_elsewhere(self, named_modules)
        if stale:
            fresh: dict[int, Registry] = {}
            fields = field_values(self)
            for name in dynamic_field_names(self):
                set_field(self, name, _renew(fields[name], stale, fresh))
        _adopt(self)
        return self


class Module(eqx.Module, metaclass=_HookableMeta):
    """An `eqx.Module` that can hold hooks, as a PyTorch `nn.Module` can.

    Subclass it instead of `eqx.Module` (the same dataclass fields, `__init__` and
    `__call__` as usual); submodules built from any `eqx.Module` class, stock `eqx.nn`
    layers included, are made hookable when the instance is constructed. Or build the
    model as usual and call [`jhooks.hookable`][] on it, which makes every module in it
    an instance of (a subclass of) this class.

    The `register_*` methods are PyTorch's; each calls the typed function of the same
    name ([`jhooks.register_forward_hook`][], ...) with this module.

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
        it from all of them. A pickled (or deep-copied) model has no hooks: it is
        hookable, with registries of its own.

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

    _jhooks: Registry = eqx.field(static=True, init=False, repr=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls, *args, **kwargs)
        set_field(self, "_jhooks", Registry())
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A subclass made by `hookable` claims its original's name, so pickle could not
        # find it: it is rebuilt from the original class instead. The registry pickles
        # as a fresh, empty one (`_registry.py`).
        original = _classes.originals.get(type(self))
        if original is None:
            return super().__reduce_ex__(protocol)
        return (unpickle, (original, dict(field_values(self))))

    def register_forward_pre_hook(
        self, hook: Callable[..., Any], *, prepend: bool = False, with_kwargs: bool = False
    ) -> RemovableHandle:
        """PyTorch's method: [`jhooks.register_forward_pre_hook`][] on this module.

        **Example:**

        ```python
        handle = model.fc1.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
        handle.remove()
        ```
        """
        return _hooks.register_forward_pre_hook(
            self, hook, prepend=prepend, with_kwargs=with_kwargs
        )

    def register_forward_hook(
        self,
        hook: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> RemovableHandle:
        """PyTorch's method: [`jhooks.register_forward_hook`][] on this module.

        **Example:**

        ```python
        handle = model.fc1.register_forward_hook(lambda m, args, out: jnp.tanh(out))
        ```
        """
        return _hooks.register_forward_hook(
            self, hook, prepend=prepend, with_kwargs=with_kwargs, always_call=always_call
        )

    def register_full_backward_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """PyTorch's method: [`jhooks.register_full_backward_pre_hook`][] on this module.

        **Example:**

        ```python
        model.fc1.register_full_backward_pre_hook(lambda m, go: (jnp.clip(go[0], -1, 1),))
        ```
        """
        return _hooks.register_full_backward_pre_hook(self, hook, prepend=prepend)

    def register_full_backward_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """PyTorch's method: [`jhooks.register_full_backward_hook`][] on this module.

        **Example:**

        ```python
        model.act.register_full_backward_hook(lambda m, gi, go: (jnp.maximum(gi[0], 0.0),))
        ```
        """
        return _hooks.register_full_backward_hook(self, hook, prepend=prepend)

    def register_backward_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """PyTorch's deprecated name: warns, and registers a full backward hook
        ([`jhooks.register_full_backward_hook`][]).

        **Example:**

        ```python
        model.fc1.register_backward_hook(hook)  # DeprecationWarning: use the full one
        ```
        """
        return _hooks.register_backward_hook(self, hook)

    def register_parameter_hook(self, name: str, fn: Callable[..., Any]) -> RemovableHandle:
        """PyTorch's `param.register_hook(fn)`: [`jhooks.register_parameter_hook`][] on
        this module, with `name` the parameter's dotted name from it (`"fc1.bias"`).

        **Example:**

        ```python
        model.register_parameter_hook("fc1.bias", jnp.zeros_like)  # a frozen bias
        ```
        """
        return _hooks.register_parameter_hook(self, name, fn)

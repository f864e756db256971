"""Named hook points: `hook_point`, `run_with_hooks` and `run_with_cache`.

A hook point is the identity until a `run_with_hooks` or `run_with_cache` call is
active: then the point looks itself up in the active runs (a thread-local stack),
applies their forward hooks, marks the value for `run_with_cache` and puts their
backward hooks on the value with [`jhooks.register_hook`][]. Forward hooks are Python
code run while tracing, backward hooks are value hooks. `run_with_cache` traces `fn` to
a jaxpr and brings the marked values (and their gradients) out of loops, conds, nested
jit and checkpoint (`_loops.py`, `_harvest.py`).

Each run is one compiled program per structure (`_programs.compiled`), chosen by
guards on everything the function, its arguments and the hooks read; the arrays they
read (and the numbers seen to change) are the program's arguments. A sweep over a
head index or a patch compiles once per point name. A run goes down the layers once:
`run_with_hooks` makes a `Spec` (the hooks and the body), `compiled` traces the body
in the program, the body makes the `Run` that the points read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax.numpy as jnp

from .._autograd import register_hook
from .._core import check_callable, check_like, describe, hook_name, run_chain
from .._staging import bind_point, calls_model
from . import _loops
from ._activations import Cast
from ._active import ACTIVE_RUNS
from ._backward import as_gradient, carried
from ._operations import call_at_operations
from ._programs import NamedCall, Spec, compiled, selector_key
from ._scopes import current_scope, scoped
from ._select import NamesFilter, Selector, did_you_mean, is_operation

NameSelector: TypeAlias = str | Callable[[str], bool]


class _NamedHook:
    """`hook(grad, name)` as a value hook `fn(grad)`; errors name the user's hook."""

    def __init__(self, hook: Callable, name: str):
        self.__wrapped__ = hook
        self.name = name

    def __call__(self, grad: Any) -> Any:
        return as_gradient(self.__wrapped__(grad, self.name), grad)


def _hook_list(hooks: Sequence[tuple[NameSelector, Callable]], what: str) -> list:
    out = []
    for entry in hooks:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise TypeError(f"{what} takes a list of (name, hook) pairs, got {entry!r} in it.")
        name, hook = entry
        check_callable(hook, f"the hook for {name!r} in {what}")
        try:
            selector = Selector(name, "")
        except TypeError:  # the message names the hook (computed only here: reprs cost)
            selector = Selector(name, f"the name of hook {hook_name(hook)} in {what}")
        out.append((selector, hook))
    return out


class Run:
    """One active `run_with_hooks` or `run_with_cache` call."""

    def __init__(
        self,
        fwd: list[tuple[Selector, Callable]],
        bwd: list[tuple[Selector, Callable]],
        cache: Selector | None,
        grads: Selector | None,
        caller: str,
    ):
        self.fwd = fwd
        self.bwd = bwd
        self.cache_selector = cache
        self.grad_selector = grads
        self.caller = caller
        self.seen: dict[str, int] = {}
        # Where `loop_index` counts loops from; a staged run (see `_loops.staged_run`)
        # sets it to its own trace, and its place in the run stack (`tag`).
        self.base = _loops.current_trace()
        self.staged = False
        self.tag = -1
        self.operations: list[str] = []  # every operation's address, once looked for

    def selectors(self) -> list[Selector]:
        sels = [sel for sel, _ in self.fwd + self.bwd]
        return sels + [s for s in (self.cache_selector, self.grad_selector) if s is not None]

    def names_operations(self) -> bool:
        """Whether a hook or filter of this run names an operation address."""
        return any(sel.names_operations for sel in self.selectors())

    def selects_operation(self, address: str) -> bool:
        return any(sel.selects_operation(address) for sel in self.selectors())

    def forward(self, name: str, value: Any) -> Any:
        """Runs this run's forward hooks at point `name`."""
        self.seen[name] = self.seen.get(name, 0) + 1
        hooks = [hook for selector, hook in self.fwd if selector(name)]
        where = f"at hook point {name!r}"
        return run_chain(
            hooks,
            value,
            lambda hook, v: hook(v, name),
            lambda hook, new, old: check_like(hook, new, old, "activation", where),
        )

    def backward(self, name: str, value: Any) -> Any:
        """Registers this run's backward hooks at point `name` on its value."""
        hooks = [hook for selector, hook in self.bwd if selector(name)]
        named = [hook for hook in hooks if isinstance(hook, NamedCall)]
        if len(named) == len(hooks) and any(hook.sites for hook in named):
            # The hooks read traced values: they travel to the backward pass.
            return carried(value, named, name)
        if hooks:
            # Hooks that read no traced value: registered without the run's values (a
            # value hook's rule lives as long as the traced program, which must not
            # hold this trace's arrays).
            bare = [NamedCall(h.fn) if isinstance(h, NamedCall) else h for h in hooks]
            value = register_hook(value, *(_NamedHook(hook, name) for hook in bare))
        return value

    def keep(self, name: str, value: Any) -> Any:
        """Marks the value at point `name` for the cache if it is selected.

        The run is staged (`_loops.staged_run`): the mark is an identity primitive that
        the run finds in its jaxpr, inside loops, conds, jit and checkpoint too.
        """
        if self.cache_selector is None or not self.cache_selector(name):
            return value
        return bind_point(value, name, self.tag)

    def check_names(self, seen: frozenset[str]) -> None:
        """Raises for a hook or filter naming a point that `fn` does not have."""
        entries = [(sel, f"hook {hook_name(hook)}") for sel, hook in self.fwd + self.bwd]
        for sel in (self.cache_selector, self.grad_selector):
            if sel is not None:
                entries.append((sel, "names_filter"))
        for sel, what in entries:
            for name in sel.unmatched(seen):
                if is_operation(name):
                    raise ValueError(
                        f"{self.caller} ({what}): no operation at address {name!r}. "
                        + did_you_mean(name, self.operations, "operations (jhooks.ops)")
                    )
                raise ValueError(
                    f"{self.caller} ({what}): no hook point named {name!r}. "
                    + did_you_mean(name, seen, "points reached")
                )


@calls_model
def _run(fn: Callable, args: tuple, kwargs: dict, run: Run) -> Any:
    """Calls `fn` with `run` active (inside the run's compiled program) and checks names.

    Callers pass `fn` through a staged trace as an argument, not in a closure: a
    module (`fn` itself) is then rebuilt inside that trace, as Flax NNX requires of
    modules that its transforms (`nnx.scan`...) take.

    An unknown name raises while the program is traced, so JAX caches no program for
    it: every call with that name raises again.
    """
    with ACTIVE_RUNS.pushed(run):
        if run.names_operations():
            out = call_at_operations(fn, args, kwargs, run, named_point)
        else:
            out = fn(*args, **kwargs)
    run.check_names(frozenset(run.seen))
    return out


def hook_point(x: Any, name: str) -> Any:
    """Marks a named point that `run_with_hooks` and `run_with_cache` can read and edit.

    **Arguments:**

    - `x`: an array or a pytree of arrays (an activation).
    - `name`: the point's name, such as `"hook_z"`. Inside the call of a hookable
        module (see [`jhooks.hookable`][]) it is named under the module's path, as
        TransformerLens names its `HookPoint`s: `hook_point(z, "hook_z")` in the
        attention module at `blocks.0.attn` is the point `"blocks.0.attn.hook_z"`.
        A name that already starts with the module's path is kept as it is.

    **Returns:**

    `x` itself when no run is active: a point costs nothing otherwise. Inside
    [`jhooks.run_with_hooks`][], the value after the forward hooks that select `name`,
    with the backward hooks that select it registered on it. Every hookable module's
    output is also a point, named by the module's path (`"blocks.0.attn"`).

    **Example:**

    ```python
    def mlp(x):
        h = jhooks.hook_point(jax.nn.relu(x @ w1), "hidden")
        return h @ w2
    ```
    """
    if not isinstance(name, str):
        raise TypeError(f"hook_point takes a string name, got {name!r}.")
    if not ACTIVE_RUNS:
        return x
    if current_scope():
        # A jitted function holding this point may be called again inside another
        # module's call: it is traced anew there, for its own name (see `_loops`).
        _loops.fence_jit_cache(ACTIVE_RUNS.items()[0].base)
    return named_point(x, scoped(name))


def named_point(x: Any, name: str) -> Any:
    """The point `name` as it is (a module's output, named by its path from the root)."""
    runs = list(ACTIVE_RUNS.items())
    # Every run's forward hooks first, then the caches (a cache sees the patched
    # value), then the backward hooks: a cached gradient is the one after them.
    for run in runs:
        x = run.forward(name, x)
    for run in runs:
        x = run.keep(name, x)
    for run in runs:
        x = run.backward(name, x)
    return x


def run_with_hooks(
    fn: Callable,
    *args: Any,
    fwd_hooks: Sequence[tuple[NameSelector, Callable]] = (),
    bwd_hooks: Sequence[tuple[NameSelector, Callable]] = (),
    **kwargs: Any,
) -> Any:
    """Calls `fn(*args, **kwargs)` with hooks on its named points, for this call only.

    **Arguments:**

    - `fn`: any function (an Equinox module, a jitted function) whose computation
        reaches [`jhooks.hook_point`][]s.
    - `*args`, `**kwargs`: what `fn` is called with.
    - `fwd_hooks`: pairs `(name, hook)`. `name` is a point name, a glob pattern
        (`"blocks.*.attn.hook_z"`), an operation address or pattern of them
        (`"blocks.*.attn/softmax"`: any value computed in a hookable module's call,
        see [`jhooks.ops`][]) or a predicate `name -> bool` (points only). `hook(value, name)`
        runs when the point is reached; a non-`None` return replaces the activation
        (patching, ablation) and must have the same structure, shapes and dtypes.
    - `bwd_hooks`: pairs `(name, hook)`. `hook(grad, name)` runs in the backward pass
        with the gradient of the point's value (after the forward hooks); a
        non-`None` return replaces it.

    **Returns:**

    What `fn` returns.

    A hook named by a string that matches no point raises a `ValueError` listing the
    close matches, once `fn` has run (inside `jax.jit`: when it is traced). Hooks are
    ordinary traced code, so this works inside `jax.jit`, `jax.grad` and `jax.vmap`
    (where hooks see per-example values). Each call runs one compiled program per
    structure (eager calls too): the arrays and numbers a forward hook closes over
    (closure cells, defaults, `functools.partial` arguments, the module globals it
    reads) are arguments of that program, so new values do not recompile, while new
    code, strings or structure do. Mark a number that must stay a Python value (a
    shape, `range(n)`) with [`jhooks.static`][]. Hooks may take TransformerLens'
    `hook(value, hook)` form: the name passed has `hook.name`.

    **Example:**

    ```python
    def zero_head(z, name):
        return z.at[:, 3].set(0.0)

    logits = jhooks.run_with_hooks(model, x, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])
    ```
    """
    check_callable(fn, "the function passed to jhooks.run_with_hooks")
    fwd = _hook_list(fwd_hooks, "fwd_hooks")
    bwd = _hook_list(bwd_hooks, "bwd_hooks")

    def body(fn: Callable, args: tuple, kwargs: dict, fwd: list, bwd: list) -> Any:
        return _loops.plain_or_staged(
            fn,
            lambda: Run(fwd, bwd, None, None, "run_with_hooks"),
            lambda run, a, k: _run(a[0], a[1:], k, run),
            (fn, *args),  # `fn` too, as a module may be: see `_run`
            kwargs,
        )

    return compiled(Spec("run_with_hooks", body, None, fwd, bwd), fn, args, kwargs)


def run_with_cache(
    fn: Callable,
    *args: Any,
    names_filter: NamesFilter = None,
    incl_bwd: bool = False,
    return_output: bool = True,
    dtype: Any = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """Calls `fn` and returns the activations at its named points too.

    **Arguments:**

    - `fn`: any function whose computation reaches [`jhooks.hook_point`][]s.
    - `*args`, `**kwargs`: what `fn` is called with.
    - `names_filter`: which points to keep: `None` (all), a name, a glob pattern
        (`"blocks.*.attn.hook_z"`), a list of those, or a predicate `name -> bool`.
        Operation addresses (`"blocks.*.attn/softmax"`, see [`jhooks.ops`][]) are
        kept only when named: `None` and predicates select points.
        Only those are returned, so only they are kept in memory under `jax.jit`.
    - `incl_bwd`: also return the gradient of `fn`'s output (a scalar) with respect
        to each selected floating-point activation, under `name + "_grad"`, and the
        values that backward hooks emit with [`jhooks.emit`][], under their names.
    - `return_output`: `False` returns `(None, cache)`: the program then computes
        only what the selected points need (XLA drops the layers after the last one).
    - `dtype`: a floating dtype (`jnp.bfloat16`) the floating-point cached values
        are cast to inside the compiled program, so the cache costs that much.

    **Returns:**

    `(out, cache)`: what `fn` returns and a dict from point name to value (and
    gradient).

    The cache is returned as values, not stored on the side, so it works inside
    `jax.jit`, `jax.grad` and `jax.vmap`. Points inside `lax.scan` (and `fori_loop`
    with static bounds) come back stacked along a new leading axis of the scan's
    length, one per enclosing scan, outermost first, and their gradients likewise;
    inside `lax.cond`, the value of the branch that ran; under a `jax.vmap` inside
    `fn`, with the batch axis first (a leaf that is the same for every example, such
    as a `BatchNorm`'s state under `vmap(..., out_axes=(0, None))`, once); inside a
    nested `jax.jit` or `jax.checkpoint`, as anywhere else. Leaves that are not arrays
    (a Python int, a str) come back as they are, with `None` as their gradient. A
    selected point inside `lax.while_loop` raises a `ValueError` naming it.

    A cache keeps one value per name: a selected point reached twice in one run
    (twice per iteration in a loop) raises a `ValueError` naming it, however it was
    selected, so no value is ever dropped silently; a point inside a hookable
    module's call is named under the module's path, so one module class used in two
    places gives two names. A filter name (or `*` pattern) that matches no point
    raises a `ValueError` listing the close matches and the points reached.

    **Example:**

    ```python
    logits, cache = jhooks.run_with_cache(model, x, names_filter=lambda n: "attn" in n)
    loss, cache = jhooks.run_with_cache(loss_fn, x, incl_bwd=True)  # cache["h_grad"], ...
    _, cache = jhooks.run_with_cache(scanned_model, x)  # cache["blocks.attn"]: (layers, ...)
    ```
    """
    check_callable(fn, "the function passed to jhooks.run_with_cache")
    selector = Selector(names_filter, "names_filter")
    cast = Cast(dtype)

    def check(out: Any) -> None:
        if incl_bwd and jnp.shape(out) != ():
            raise ValueError(
                "run_with_cache(..., incl_bwd=True) differentiates fn's output, which must "
                f"be a scalar; fn returned {describe(out)}."
            )

    def program(fn: Callable, args: tuple, kwargs: dict, fwd: list, bwd: list) -> Any:
        run = Run([], [], selector, selector if incl_bwd else None, "run_with_cache")
        out, cache = _loops.staged_run(
            run,
            lambda a, k: _run(a[0], a[1:], k, run),
            (fn, *args),  # `fn` too, as a module may be: see `_run`
            kwargs,
            grads=incl_bwd,
            check=check,
        )
        cache = cast(cache)
        # The names in the order the points were reached (a compiled program's dict
        # outputs come back sorted).
        return (out if return_output else None), cache, tuple(cache)

    options = (selector_key(selector), incl_bwd, return_output, cast.key)
    spec = Spec("run_with_cache", program, options, [], [])
    out, cache, order = compiled(spec, fn, args, kwargs)
    return out, {name: cache[name] for name in order}

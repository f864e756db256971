"""Named hook points: `hook_point`, `run_with_hooks` and `run_with_cache`.

A hook point is the identity until a `run_with_hooks` or `run_with_cache` call is
active: then the point looks itself up in the active runs (a thread-local stack),
applies their forward hooks, marks the value for `run_with_cache` and puts their
backward hooks on the value with [`jhooks.register_hook`][]. Forward hooks are Python
code run while tracing, backward hooks are value hooks. `run_with_cache` traces `fn` to
a jaxpr and brings the marked values (and their gradients) out of loops, conds, nested
jit and checkpoint (`_loops.py`, `_harvest.py`).

Each run is one compiled program per structure (`_programs.compiled`), chosen by
guards on everything the function, its arguments and the hooks read; the arrays and
numbers of the arguments' pytree (and the hooks' constants) are the program's
arguments. A sweep over a head index or a patch compiles once per point name. A run
goes down the layers once: `run_with_hooks` makes a `Spec` (the hooks and the body),
`compiled` traces the body in the program, the body makes the `Run` that the points
read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from .._core import check_callable, hook_name, outside_vmaps, vmapped_between
from .._staging import calls_model
from . import _loops
from ._activations import Cast, differentiated
from ._active import ACTIVE_RUNS
from ._operations import call_at_operations
from ._program import Spec, selector_key
from ._programs import compiled
from ._run import INPUT, PointName, Run
from ._scopes import intercepting, scope_aliases, scoped, users_vmap_base
from ._select import NamesFilter, Selector

NameSelector: TypeAlias = str | Callable[[str], bool]


_SELECTORS: dict[str, Selector] = {}  # by name: a warm call makes none again


def _hook_list(hooks: Sequence[tuple[NameSelector, Callable]], what: str) -> list:
    out = []
    for entry in hooks:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise TypeError(f"{what} takes a list of (name, hook) pairs, got {entry!r} in it.")
        name, hook = entry
        check_callable(hook, f"the hook for {name!r} in {what}")
        selector = _SELECTORS.get(name) if isinstance(name, str) else None
        if selector is None:
            try:
                selector = Selector(name, "")
            except TypeError:  # the message names the hook (computed only here: reprs cost)
                selector = Selector(name, f"the name of hook {hook_name(hook)} in {what}")
            if isinstance(name, str):
                if len(_SELECTORS) >= 4096:
                    _SELECTORS.clear()
                _SELECTORS[name] = selector
        out.append((selector, hook))
    return out


@calls_model
def _run(fn: Callable, args: tuple, kwargs: dict, run: Run) -> Any:
    """Calls `fn` with `run` active (inside the run's compiled program) and checks names.

    Callers pass `fn` through a staged trace as an argument, not in a closure: a
    module (`fn` itself) is then rebuilt inside that trace, as Flax NNX requires of
    modules that its transforms (`nnx.scan`...) take.

    An unknown name raises while the program is traced, so JAX caches no program for
    it: every call with that name raises again.
    """
    with ACTIVE_RUNS.pushed(run), intercepting():
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
    name = scoped(name)
    return named_point(x, name, aliases=scope_aliases(name))


def named_point(x: Any, name: str, *, aliases: tuple[str, ...] = (), asked: bool = False) -> Any:
    """The point `name` as it is (a module's output, named by its path from the root).

    Reached again in the same run (a module called twice), it is the point
    `name + ":1"`, then `":2"`... (`Run.call_name`). Under a `jax.vmap` inside the run's
    function, hooks, cache and gradient see the value with the vmap's batch axis first,
    as the cache shows it (`outside_vmaps`). With `asked`, the point is there only
    when a run's hook or filter names it (`Run.asks_for`): a module's input. A hook or
    filter may name the point by any of `aliases` too (a shared module's other paths)."""
    runs = list(ACTIVE_RUNS.items())
    if not runs:
        return x
    names = [PointName.of(run.call_name(name), name, aliases) for run in runs]
    if asked and not any(run.asks_for(n) for run, n in zip(runs, names)):
        return x
    # A jitted function that reached a point is traced again when called again in the
    # run: its next call is another call, with other names.
    _loops.fence_jit_cache(runs[0].base)
    base = runs[-1].base
    if vmapped_between(base) and any(run.uses(n) for run, n in zip(runs, names)):
        example = users_vmap_base()
        if example is not None:  # the user's vmap around the model: one example
            return _per_example(runs, names, example, base, x)
        # Only a selected point leaves the vmaps: an unselected one costs nothing.
        return outside_vmaps(base, lambda v: _through_runs(runs, names, v), x)
    return _through_runs(runs, names, x)


def input_point(args: tuple, path: str, aliases: tuple[str, ...] = ()) -> tuple:
    """The positional arguments of a call of the module at `path`, through the point
    `path + ":in"` (the one argument, or the tuple of them) where a run asks for it."""
    if not ACTIVE_RUNS or not path:
        return args
    value = named_point(
        args[0] if len(args) == 1 else args,
        path + INPUT,
        aliases=tuple(a + INPUT for a in aliases),
        asked=True,
    )
    return (value,) if len(args) == 1 else tuple(value)


def _per_example(runs: list[Run], names: list[PointName], example: Any, base: Any, x: Any) -> Any:
    # Hooks as from the trace of the user's vmap (one example; the model's own vmaps
    # peeled, as without the user's), the cache as from the run's (stacked, batch first).
    def forward(v: Any) -> Any:
        for run, name in zip(runs, names):
            run.refuse_inside_vmap(name, example)
            v = run.forward(name, v)
        return v

    def keep(v: Any) -> Any:
        for run, name in zip(runs, names):
            v = run.keep(name, v)
        return v

    def backward(v: Any) -> Any:
        for run, name in zip(runs, names):
            v = run.backward(name, v)
        return v

    x = outside_vmaps(example, forward, x)
    x = outside_vmaps(base, keep, x)
    return outside_vmaps(example, backward, x)


def _through_runs(runs: list[Run], names: list[PointName], x: Any) -> Any:
    # Every run's forward hooks first, then the caches (a cache sees the patched
    # value), then the backward hooks: a cached gradient is the one after them.
    for run, name in zip(runs, names):
        run.refuse_inside_vmap(name)
        x = run.forward(name, x)
    for run, name in zip(runs, names):
        x = run.keep(name, x)
    for run, name in zip(runs, names):
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
        see [`jhooks.ops`][]; in an address's module path `*` matches one dotted
        segment, `**` any part) or a predicate `name -> bool` (points only; asked
        once per point on every call, as TransformerLens asks its filters). At an
        operation with several outputs (`jnp.split`), `value` is a list of them and the
        hook may return a list or tuple of the same length. `hook(value, name)`
        runs when the point is reached; a non-`None` return replaces the activation
        (patching, ablation) and must have the same structure, shapes and dtypes.
        A point reached again in the run is `name:1`, `name:2`...; `name` selects
        every call, `name:1` one. Under a `jax.vmap` inside `fn`, hooks see the
        batched value, as the cache shows it.
    - `bwd_hooks`: pairs `(name, hook)`. `hook(grad, name)` runs in the backward pass
        with the gradient of the point's value (after the forward hooks); a
        non-`None` return replaces it.

    **Returns:**

    What `fn` returns.

    Called outside your own `jax.jit`, a hook whose Python does more than compute with
    JAX (it prints, counts, keeps a value, calls `float` or `np.asarray`, branches on a
    value) runs on the point's concrete arrays when the program reaches it, as in
    PyTorch (a graph break), and a backward hook of that kind runs in the backward
    pass; pure JAX hooks are compiled into the program (docs/semantics.md, the rule of
    runs). A hook named by a string that matches no point raises a `ValueError` listing
    the close matches, once `fn` has run (inside `jax.jit`: when it is traced). Inside
    `jax.jit` hooks are ordinary traced code, run once per compilation; this works
    inside `jax.jit`, `jax.grad` and `jax.vmap` (where hooks see per-example values).
    Each call runs one compiled program per structure (eager calls too): the arrays
    and numbers a forward hook closes over (closure cells, defaults,
    `functools.partial` arguments, the module globals it reads) are arguments of that
    program, so new values do not recompile, while new
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
    max_steps: int | None = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """Calls `fn` and returns the activations at its named points too.

    **Arguments:**

    - `fn`: any function whose computation reaches [`jhooks.hook_point`][]s or
        hookable modules (a Flax Linen `model.apply` or a Haiku `apply` too: each
        module call is a point, see [Flax Linen and Haiku
        models](other_models.md#flax-linen-and-haiku-models)).
    - `*args`, `**kwargs`: what `fn` is called with.
    - `names_filter`: which points to keep: `None` (all), a name, a glob pattern
        (`"blocks.*.attn.hook_z"`), a list of those, or a predicate `name -> bool`.
        Operation addresses (`"blocks.*.attn/softmax"`, see [`jhooks.ops`][]) are
        kept only when named: `None` and predicates select points.
        Only those are returned, so only they are kept in memory under `jax.jit`.
    - `incl_bwd`: also return the gradient of `fn`'s output (a scalar) with respect
        to each selected floating-point activation, under `name + "_grad"`, and the
        values that backward hooks emit with [`jhooks.emit`][], under their names. An
        output that is not a scalar is read as `jax.grad(..., has_aux=True)` reads it:
        the first element of a tuple or list (`(loss, aux)`), or the `"loss"` entry of
        a dict; anything else raises a `ValueError` that names what `fn` returned.
    - `return_output`: `False` returns `(None, cache)`: the program then computes
        only what the selected points need (XLA drops the layers after the last one).
    - `dtype`: a floating dtype (`jnp.bfloat16`) the floating-point cached values
        are cast to inside the compiled program, so the cache costs that much.
    - `max_steps`: a Python int, the bound of the cache inside `lax.while_loop` (a
        decode loop): each point there comes back as a `(max_steps, ...)` buffer,
        row `i` written at the loop's step `i`, with `name + "_steps"` (the number
        of steps run) and `name + "_valid"` (`(max_steps,)` booleans, the rows
        written). Steps past the bound are not kept (`_steps` exceeds `max_steps`).

    **Returns:**

    `(out, cache)`: what `fn` returns and a dict from point name to value (and
    gradient).

    The cache is returned as values, not stored on the side, so it works inside
    `jax.jit`, `jax.grad` and `jax.vmap`. Points inside `lax.scan` (and `fori_loop`
    with static bounds) come back stacked along a new leading axis of the scan's
    length, one per enclosing scan, outermost first, and their gradients likewise;
    inside `lax.cond`, the value of the branch that ran; under a `jax.vmap` inside
    `fn`, a point with the batch axis first (a leaf that is the same for every
    example, such as a `BatchNorm`'s state under `vmap(..., out_axes=(0, None))`,
    once), an operation address as the batched operation is laid out (the axis where
    JAX's batching rule put it: see [Hooking a model you did not
    write](other_models.md); a hook at an operation of a model called under a
    `jax.vmap` inside `fn`, the user's `jax.vmap(model)`, raises a `ValueError`:
    call the run inside the vmap); inside a
    nested `jax.jit` or `jax.checkpoint`, as anywhere else. Leaves that are not arrays
    (a Python int, a str) come back as they are, with `None` as their gradient. A
    selected point inside `lax.while_loop` needs `max_steps` (without it, a
    `ValueError` names the point and the option), and has no gradient.

    A point reached again in one run (a module called twice, twice per iteration in
    a loop) is another point, named by call order: `"rope"`, then `"rope:1"`; a
    point's own name selects every call of it (see [Hooking a model you did not
    write](other_models.md)). A point inside a hookable module's call is named under
    the module's path, so one module class used in two places gives two names. A
    module's input is the point `path + ":in"`, there only when a filter names it
    (`"blocks.*.attn.o_proj:in"`): `None` caches outputs only. A filter name (or `*`
    pattern) that matches no point raises a `ValueError` listing the close matches and
    the points reached.

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
    if max_steps is not None and not (type(max_steps) is int and max_steps > 0):
        raise TypeError(
            f"run_with_cache: max_steps takes a positive Python int, got {max_steps!r}."
        )

    def check(out: Any) -> None:
        if incl_bwd:
            differentiated(out)

    def program(fn: Callable, args: tuple, kwargs: dict, fwd: list, bwd: list) -> Any:
        run = Run([], [], selector, selector if incl_bwd else None, "run_with_cache")
        out, cache = _loops.staged_run(
            run,
            lambda a, k: _run(a[0], a[1:], k, run),
            (fn, *args),  # `fn` too, as a module may be: see `_run`
            kwargs,
            grads=incl_bwd,
            check=check,
            loss=differentiated,
            max_steps=max_steps,
        )
        cache = cast(cache)
        # The names in the order the points were reached (a compiled program's dict
        # outputs come back sorted).
        return (out if return_output else None), cache, tuple(cache)

    options = (selector_key(selector), incl_bwd, return_output, cast.key, max_steps)
    spec = Spec("run_with_cache", program, options, [], [])
    out, cache, order = compiled(spec, fn, args, kwargs)
    return out, {name: cache[name] for name in order}

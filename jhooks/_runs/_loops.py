"""Runs whose points live in loops: `jhooks.loop_index` and the staged run.

A staged run traces its function to a jaxpr (`jax.make_jaxpr`) and evaluates it with
`_harvest.Harvester`, which brings the values of the points out of
`lax.scan`, `lax.cond`, nested `jax.jit` and `jax.checkpoint` (stacked along a leading
axis per scan), puts a zero probe on each to get its gradient, and feeds `loop_index`.

`run_with_cache` always runs staged. `run_with_hooks` runs as a plain call first, so its
hooks see concrete values when it is called eagerly; only if `loop_index()` is called
inside a loop does it start again, staged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp

from .._core import (
    Bounded,
    Emitted,
    ThreadStack,
    body_argument,
    collecting,
    current_trace,
    is_staging,
    loop_fence_key,
    parent_of,
    running_backward_hook,
    staged_key,
    traced_for,
)
from .._staging import Harvester, PointLayout, Traced, loop_index_p
from ._active import ACTIVE_RUNS
from ._host_calls import host_loop_index, in_backward_hook

LOOP_TRACES = frozenset({"scan", "fori_loop", "while_body", "while_cond"})


# The trace of a hook traced on its own (`_hookcall.py`) and its value's array leaves:
# inside it, `loop_index()` anchors on the value (the point's, where it is evaluated),
# not on the loop bodies' tracers, which would be constants of the hook's trace.
HOOK_VALUES: ThreadStack[tuple[Any, list[Any]]] = ThreadStack("hooks' traces and values")


def loop_anchors(base: Any) -> list[Any]:
    """An argument of each loop body traced between the current trace and `base`
    (`_core.body_argument`), for `loop_index_p` to stay in its loops under `jax.grad`;
    in a hook traced on its own, its value's first leaf instead of the loops outside."""
    trace, anchors = current_trace(), []
    hook = HOOK_VALUES.top()
    while trace is not base and trace is not None:
        if hook is not None and trace is hook[0]:
            return anchors + hook[1][:1]
        if traced_for(trace) in LOOP_TRACES:
            anchor = body_argument(trace)
            if anchor is not None:
                anchors.append(anchor)
        trace = parent_of(trace)
    return anchors


def loops_between(base: Any) -> int | None:
    """How many loop bodies are being traced between the current trace and `base`, or
    `None` when `base` is not an ancestor of the current trace."""
    trace, depth = current_trace(), 0
    while trace is not base:
        if trace is None:
            return None
        if traced_for(trace) in LOOP_TRACES:
            depth += 1
        trace = parent_of(trace)
    return depth


# Functions jitted inside a staged run hold its primitives: this context is part of
# jit's cache key, so a plain run never reuses what a staged one traced.
_staged = staged_key

# A jitted function that called `loop_index()` was traced for one loop depth: called
# again from another depth (once before a scan, then inside it), JAX's cache would hand
# back that trace and its index. `loop_index` sets this context (part of jit's cache
# key) to a fresh value each time it is called inside a nested staged function, so the
# next call of any jitted function in the run is traced anew; the run restores it.
_fence = loop_fence_key
_FENCES: ThreadStack[list[Any]] = ThreadStack("jit cache fences set by loop_index")


class _Fence:
    """A fresh value for `_fence`, equal only to itself."""

    __slots__ = ("__weakref__",)


@contextmanager
def fenced() -> Iterator[None]:
    """Restores the `_fence` context that `loop_index` sets inside the block."""
    entered: list[Any] = [_fence(_Fence())]  # jits traced in an earlier run are not reused
    entered[0].__enter__()
    with _FENCES.pushed(entered):
        try:
            yield
        finally:
            for scope in reversed(entered):
                scope.__exit__(None, None, None)


def _inside_staged_function(base: Any) -> bool:
    """Whether a trace that stages out a function JAX may cache (jit, checkpoint...)
    lies between the current trace and `base`."""
    trace = current_trace()
    while trace is not base and trace is not None:
        if is_staging(trace) and traced_for(trace) not in LOOP_TRACES:
            return True
        trace = parent_of(trace)
    return False


def fence_jit_cache(base: Any) -> None:
    """Inside a nested staged function of a run, makes the next jit calls retrace."""
    fences = _FENCES.top()
    if fences is not None and _inside_staged_function(base):
        scope = _fence(_Fence())
        scope.__enter__()
        fences.append(scope)


# The loop depth of the point whose hook is traced on its own now (`_hookpass.py`): its
# `loop_index()` gives that many iterations, bound where the program evaluates it.
HOOK_SITE: ThreadStack[int] = ThreadStack("hooks traced on their own")


def site_depth(run: Any) -> int:
    """How many loops are around the current point of `run`'s trace."""
    runs = ACTIVE_RUNS.items()
    return loops_between(runs[0].base if runs else run.base) or 0


class NeedsStaging(Exception):
    """Raised inside a plain run when `loop_index()` is called within a loop."""


# The traces of the outermost hookable module calls running plainly with no run active
# (`_module_runs.py`): `loop_index()` in a loop inside one starts it again, staged.
MODULE_ROOTS: ThreadStack[Any] = ThreadStack("outermost hookable module calls")


def loop_index() -> tuple[jax.Array, ...]:
    """The iteration of each loop (`lax.scan`, `lax.fori_loop`, `lax.while_loop`)
    around the current code.

    **Arguments:**

    None.

    **Returns:**

    A tuple of `int32` scalars, one per loop body being traced between the run and
    here, outermost first; `()` outside any loop. Each counts the iterations of its
    loop from 0, the position along the axis that `run_with_cache` stacks the loop's
    values on: in `lax.fori_loop(2, 5, body, x)` it is 0, 1, 2, that is `i - 2`, not
    fori's `i`. In a `lax.while_loop` (or a `fori_loop` with traced bounds) it is the
    number of iterations completed, a traced value (the run adds a counter to the
    loop's carry). It works in forward hooks and any code traced in the forward pass
    of a [`jhooks.run_with_hooks`][] or [`jhooks.run_with_cache`][] call (the run
    feeds each scan the range of its length as an extra input), and in the hooks of
    modules (`register_forward_hook`...) for the loops inside the outermost hookable
    module's call: with no run active, that call stands in for one (it starts again
    as a run the first time a hook asks). A jitted function called from several
    loop depths (a block applied once before the `lax.scan` over the others, then
    inside it) gets the index of each call: a jitted function that calls
    `loop_index()` is traced again when called again in the run. A run differentiated
    inside another run (`jax.grad`, `jax.hessian`, `jax.vmap` of `jax.grad`, with a
    `jax.checkpoint` or `jax.jit` in the loop's body) gets the same indices: the index
    takes an argument of each loop body (in a hook, the point's value) as an operand,
    so that `jax.grad` does not move it out of its loop. A call inside a loop
    with no run (or hookable call) around the loop raises a `ValueError`, as does any
    call in a backward hook (which runs in the backward pass, where loops run in
    reverse: read the index in a forward hook and close over it).

    **Example:**

    ```python
    def patch_layer_3(value, name):
        (layer,) = jhooks.loop_index()         # the scan over layers
        return jnp.where(layer == 3, 0.0, value)

    out = jhooks.run_with_hooks(model, x, fwd_hooks=[("blocks.mlp", patch_layer_3)])
    ```
    """
    on_values = host_loop_index()
    if on_values is not None:
        return on_values
    hook = running_backward_hook()
    if hook is not None:
        raise in_backward_hook(hook)
    site = HOOK_SITE.top()
    if site is not None:
        return tuple(loop_index_p.bind(*loop_anchors(None), depth=site)) if site else ()
    runs = ACTIVE_RUNS.items()
    base = runs[0].base if runs else None
    fence_jit_cache(base)
    depth = loops_between(base)
    if depth is None:
        raise ValueError(
            "jhooks.loop_index() was called outside the forward pass of the active run "
            "(in a backward hook?). It is available in forward hooks and forward code: "
            "read it there, e.g. in a forward hook that selects what to patch."
        )
    if depth == 0:
        return ()
    if not runs:
        root = MODULE_ROOTS.top()
        if root is not None and loops_between(root):
            raise NeedsStaging()  # the outermost hookable call starts again, staged
        raise ValueError(
            "jhooks.loop_index() was called inside a loop with no run active: it gives "
            "the iteration of loops within jhooks.run_with_hooks or jhooks.run_with_cache, "
            "or, in a module's hooks, of loops within the outermost hookable module's call "
            "(a loop around that call is not counted: make the module that runs the loop "
            "hookable with jhooks.hookable, or run it with jhooks.run_with_hooks)."
        )
    if not runs[0].staged:
        raise NeedsStaging()
    return tuple(loop_index_p.bind(*loop_anchors(base), depth=depth))


# The (function, run key) pairs whose plain run called `loop_index()` in a loop: they
# are staged at once next time. The function is held so that its id stays its own.
_needs_staging: Bounded[int, bool] = Bounded(256)


def plain_or_staged(
    fn: Callable,
    new_run: Callable[[], Any],
    call: Callable[[Any, tuple, dict], Any],
    args: tuple,
    kwargs: dict,
) -> Any:
    """Runs `call(run, args, kwargs)` plainly, or staged if `loop_index()` needs it.

    **Arguments:**

    - `fn`: the run's function (to remember that it needs staging).
    - `new_run`: makes a fresh `Run`.
    - `call`: calls `fn` under the run.
    - `args`, `kwargs`: `fn`'s arguments.

    **Returns:**

    What `fn` returns.
    """
    run = new_run()
    outermost = not ACTIVE_RUNS
    key = id(fn)  # a hint only: which functions needed staging before
    if not (outermost and key in _needs_staging):
        try:
            with fenced():
                return call(run, args, kwargs)
        except NeedsStaging:
            # Only the outermost run feeds `loop_index`: it starts again, staged.
            if not outermost:
                raise
        _needs_staging[key] = True  # not fn itself: that would keep it alive
    _needs_staging.move_to_end(key)
    run = new_run()
    out, _ = staged_run(run, lambda a, k: call(run, a, k), args, kwargs)
    return out


def staged_run(
    run: Any,
    call: Callable[[tuple, dict], Any],
    args: tuple,
    kwargs: dict,
    *,
    grads: bool = False,
    check: Callable[[Any], None] | None = None,
    loss: Callable[[Any], Any] = lambda out: out,
    max_steps: int | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Calls `call(args, kwargs)` (which runs the function under `run`) staged.

    **Arguments:**

    - `run`: the `Run`; its `base`, `staged` and `tag` are set here, and its
        `cache_selector`, `caller` read.
    - `call`: calls the run's function with `(args, kwargs)`.
    - `args`, `kwargs`: the function's arguments. Its JAX arrays (and tracers) are
        traced; everything else is passed as is.
    - `grads`: also return the gradient of the (scalar) output with respect to each
        floating-point point, under `name + "_grad"`.
    - `check`: called with the output while tracing (to refuse a non-scalar).
    - `loss`: the scalar to differentiate, given the output (`grads`).
    - `max_steps`: the bound of the buffers of points inside `lax.while_loop`.

    **Returns:**

    `(out, cache)`: the function's output and the values of the run's points.
    """

    def staged(a: tuple, k: dict) -> Any:
        run.base, run.staged, run.tag = current_trace(), True, len(ACTIVE_RUNS)
        with _staged(True), fenced():
            out = call(a, k)
        if check is not None:
            check(out)
        return out

    traced = Traced(staged, (args, kwargs))
    closed, values, output = traced.closed, traced.inputs, traced.output

    def duplicate(name: str) -> None:
        raise ValueError(
            f"{run.caller}: hook point {name!r} is twice in the run's traced program where "
            "its trace counted one call (a traced function evaluated twice without being "
            "traced again), and the cache keeps one value per name. Give each use its own "
            f"name, or leave {name!r} out of names_filter."
        )

    harvester = Harvester(run.tag, run.tag == 0, duplicate, run.caller, max_steps)
    points = harvester.points(closed.jaxpr)

    def cache_of(reaped: dict[str, list[Any]]) -> dict[str, Any]:
        return {n: jax.tree.unflatten(p.treedef, reaped[n]) for n, p in points.items()}

    if not grads:
        outs, reaped = harvester.run(closed.jaxpr, closed.consts, values)
        return output(outs), cache_of(reaped)

    # Negative zeros: x + (-0.0) is x for every x, -0.0 included.
    probes = {
        n: [jnp.full(a.shape, -0.0, a.dtype) for a in p.avals]
        for n, p in points.items()
        if p.floating
    }

    def differentiated(probes: dict[str, list[Any]]) -> tuple[Any, tuple]:
        outs, reaped = harvester.run(closed.jaxpr, closed.consts, values, (), dict(probes))
        out = output(outs)
        return loss(out), (out, reaped)

    with collecting(Emitted(base=current_trace())) as emitted:
        (_, (out, reaped)), grads_of = jax.value_and_grad(differentiated, has_aux=True)(probes)
    cache = cache_of(reaped)
    for name in probes:
        layout = points[name].treedef
        if isinstance(layout, PointLayout):
            layout = layout.without_static()
        cache[name + "_grad"] = jax.tree.unflatten(layout, grads_of[name])
    emitted.merge_into(cache, "a cached point or gradient")
    return out, cache

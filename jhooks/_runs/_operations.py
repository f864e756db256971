"""Operation addresses in runs, and `jhooks.ops`.

A run whose hooks or filter name an operation (`"blocks.0.attn/softmax"`, a name with a
`/`) traces the function to a jaxpr, names its operations (`_staging/_addresses.py`),
and evaluates it again (`_staging/_rewrite.py`) with each selected operation's value
passed through `named_point`, as a `hook_point` at that place would be. A hook at an
operation of a model called under a `jax.vmap` inside the function (the user's
`jax.vmap(model)`) is refused: it would see the batched operation, with the vmap's axis
where JAX put it, not one example as `jhooks.ops(model, x)` lists it. A run that
selects no operation calls the function as it is: the program is the one without
jhooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core import NAMES_KEYED, UNKNOWN_AXIS, current_trace, program_key, recording_batch_axes
from .._staging import (
    AtOperations,
    Found,
    Operation,
    Traced,
    calls_model,
    find_operations,
    operation_of,
)
from ._active import ACTIVE_RUNS
from ._program import Token
from ._run import Run
from ._scopes import intercepting


@calls_model
def _call_model(fn: Callable, args: tuple, kwargs: dict, runs: tuple) -> Any:
    # The runs at the level of this trace count loops (`loop_index`) and staged
    # functions (the jit cache fences of `_loops`) from it, as from their own: it stands
    # for their trace, so a hook point in the model does not make every jit retrace.
    bases = [run.base for run in runs]
    for run in runs:
        run.base = current_trace()
    try:
        return fn(*args, **kwargs)
    finally:
        for run, base in zip(runs, bases):
            run.base = base


def _traced(fn: Callable, args: tuple, kwargs: dict, runs: tuple) -> tuple[Traced, list[Found]]:
    # `fn` travels as an argument: a module's arrays are inputs of the jaxpr. Where the
    # model's own vmaps put their axis is recorded as it is traced.
    with recording_batch_axes() as axes:
        traced = Traced(_call_model, (fn, args, kwargs, runs))
        return traced, find_operations(traced.closed.jaxpr, axes)


def _runs_here() -> tuple:
    here = current_trace()
    return tuple(run for run in ACTIVE_RUNS.items() if run.base is here)


def _chosen(run: Any, f: Found) -> tuple[str, tuple]:
    # An operation under the model's own vmap is seen with the vmap's axis first; one
    # whose axis JAX's batching did not give as it is (made inside a batching rule, or
    # under a second vmap there) is refused.
    if UNKNOWN_AXIS in f.axes:
        run.refuse_unplaced_operation(f.address)
    return f.address, f.axes


def call_at_operations(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    run: Any,
    point: Callable[[Any, str], Any],
) -> Any:
    """Calls `fn(*args, **kwargs)` with the operations `run` selects passed through
    `point(value, address)`; records every address in `run.operations` (for errors)."""
    run.chosen_per_example, run.regions = set(), 0
    traced, found = _traced(fn, args, kwargs, _runs_here())
    run.operations = [f.address for f in found]
    chosen, selected = {}, set(run.chosen_per_example)
    for f in found:
        if not run.selects_operation(f.address):
            continue
        selected.add(f.address)
        if f.region is None:
            if f.vmapped:  # a plain function's operation batched by the user's vmap
                run.refuse_vmapped_operation(f.address)
            chosen[id(f.eqn)] = _chosen(run, f)
    _refuse_ambiguous(run, found, selected)
    closed = traced.closed
    outs = AtOperations(chosen, point, run.caller).run(closed.jaxpr, closed.consts, traced.inputs)
    return traced.output(outs)


def per_example_operations(
    call: Callable, args: tuple, region: int, point: Callable[[Any, str], Any]
) -> Any:
    """`call(*args)`, a hookable model's outermost call under the user's `jax.vmap`
    inside the function of runs that name operations: traced on one example (the
    vmap's tracers have one example's shapes), its operations named as
    `jhooks.ops(model, x)` names them, the ones the runs select passed through
    `point`, evaluated under the vmap. The run's own walk leaves them (`Found.region`)."""
    runs = [run for run in ACTIVE_RUNS.items() if run.names_operations()]
    traced, found = _traced(call, args, {}, ())
    chosen = {}
    for run in runs:
        if run.listing:
            run.listed[region] = found
    for f in found:
        for run in runs:
            if run.selects_operation(f.address):
                chosen[id(f.eqn)] = _chosen(run, f)
                run.chosen_per_example.add(f.address)
    closed = traced.closed
    outs = AtOperations(chosen, point, runs[-1].caller).run(
        closed.jaxpr, closed.consts, traced.inputs
    )
    return traced.output(outs)


def _refuse_ambiguous(run: Any, found: list, selected: set[str]) -> None:
    # A model call under the user's vmap counts its operations as `jhooks.ops(model, x)`
    # does, from the first; where the function makes operations of that name in that
    # module elsewhere too, the run's count (`:k`) differs from it: refused.
    places: dict[str, set] = {}
    for f in found:
        places.setdefault(f.address.rsplit(":", 1)[0], set()).add(f.region)
    for address in sorted(selected):
        if len(places.get(address.rsplit(":", 1)[0], ())) > 1:
            run.refuse_ambiguous_operation(address)


def ops(fn: Callable, *args: Any, **kwargs: Any) -> list[Operation]:
    """Lists the operations of `fn(*args, **kwargs)` by address, as runs select them.

    nnsight's `module.source` for JAX: every value computed inside a hookable module's
    call (see [`jhooks.hookable`][]) is addressable as `<module path>/<operation>`,
    where the operation is the public JAX function the model called (`softmax`,
    `einsum`, `where`; a `custom_jvp` / `custom_vjp` function by its name) or else
    the primitive (`add`, `dot_general` for `@`, `exp`), with `:1`, `:2`... for the
    second, third... of one name in one module, in program order. Operations outside
    every hookable module have the path `""` (`"/exp"`).

    **Arguments:**

    - `fn`: a model or any function.
    - `*args`, `**kwargs`: what `fn` is called with (arrays or
        `jax.ShapeDtypeStruct`s: nothing is computed).

    **Returns:**

    A list of `Operation(address, shape, dtype, source)`, in program order: the
    shape and dtype of each operation's value (inside a `lax.scan`, one iteration's;
    in a hookable model called under a `jax.vmap` inside `fn`, one example's; under a
    `jax.vmap` of a module's own code, with that vmap's axis first; each as a run's
    hooks see it) and the line of the model's code that made it. `fn` is only traced
    (`jax.make_jaxpr`): nothing is compiled or run, and the model is not changed.

    **Example:**

    ```python
    for op in jhooks.ops(model, tokens):
        print(op.address, op.shape, op.source)   # blocks.0.attn/softmax (4, 8, 8) model.py:31
    logits = jhooks.run_with_hooks(model, tokens, fwd_hooks=[("blocks.0.attn/softmax", hook)])
    ```
    """
    # Addresses are names: traced with registries compared by identity, and in a jit
    # context of its own, so that no function jitted for another module is reused.
    # A model called under a `jax.vmap` inside `fn` lists one example's operations, as
    # a run's hooks see them (`_users_vmap.py`): `fn` is traced under a run of its own.
    run = Run([], [], None, None, "jhooks.ops")
    run.listing = True
    with NAMES_KEYED.pushed(fn), program_key(Token()), ACTIVE_RUNS.pushed(run), intercepting():
        traced, every = _traced(fn, args, kwargs, _runs_here())
    found, listed = [], set()
    for f in every:
        if f.region is None:
            found.append(f)
        elif f.region not in listed:
            listed.add(f.region)
            found += run.listed.get(f.region, [])
    return [operation_of(f) for f in found]

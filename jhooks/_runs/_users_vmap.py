"""The user's `jax.vmap` around a hookable model's call: hooks see one example.

`jhooks.run_with_hooks(jax.vmap(model), xs, fwd_hooks=...)` calls the model under a
vmap inside the run's function. A hook there sees what it would see with the vmap
around the run (`jax.vmap(lambda x: jhooks.run_with_hooks(model, x, ...))`): one
example's value, with the shape that `jhooks.ops(model, x)` lists and that a module
hook registered on the module sees. The cache still holds every example, stacked batch
axis first.

- A point (a module's output or input, a `hook_point`) leaves only the vmaps of the
  model's own code (`named_point`, from `users_vmap_base`).
- An operation is found in the model call's own jaxpr, traced on one example (the
  vmap's tracers have one example's shapes), and evaluated under the vmap with the
  selected operations' values passed through `named_point`
  (`_operations.per_example_operations`): JAX batches the hooks with the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core import current_trace, vmapped_between
from .._staging import vmapped_call_scope
from ._active import ACTIVE_RUNS
from ._operations import per_example_operations
from ._points import named_point
from ._scopes import in_module_call, users_vmap


def hookable_call(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)`, a hookable module's call: its point scope, its code and its output
    point. The outermost one under a `jax.vmap` inside a run's function (the user's vmap)
    is one example's (see above)."""
    if in_module_call() or not ACTIVE_RUNS:
        return call(*args)
    runs = ACTIVE_RUNS.items()
    if not vmapped_between(runs[-1].base):
        return call(*args)
    region = runs[-1].next_region()
    with users_vmap().pushed(current_trace()), vmapped_call_scope(region):
        if any(run.names_operations() for run in runs):
            return per_example_operations(call, args, region, named_point)
        return call(*args)

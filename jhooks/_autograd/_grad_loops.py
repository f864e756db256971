"""`jhooks.grad` through `lax.scan`, `lax.cond`, nested `jax.jit` and `jax.checkpoint`.

`retain_grad` called inside a function that JAX stages out within the differentiated
function cannot add a probe there (JAX caches that function and runs it on its own),
so it names the value's hook chain instead (`_Chain.retained`, by the tag of the
`jhooks.grad` call). `jhooks.grad` finds such chains in the jaxpr of the function and
then differentiates it through `_harvest.Harvester`, which adds a zero probe to the
inputs of each named chain (stacked along one leading axis per enclosing scan) and
brings the gradient with respect to it out: the gradient after every hook of the chain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core import hook_p, inner_jaxprs, zero_probe
from .._staging import Harvester, Point, Traced, bind_point


class RetainHarvester(Harvester):
    """The harvester of one `jhooks.grad` call: its points are retained values."""

    def __init__(self, tag: int, loops: bool, duplicate: Callable[[str], None], caller: str):
        super().__init__(tag, loops, _twice, caller)

    def _refuse(self, eqn: Any) -> None:
        advice = ", or retain the loop's output instead"
        name, where = self._refusal(eqn, "gradients", advice)
        raise ValueError(f"{self.caller}: retain_grad({name!r}) was called inside {where}.")

    def _same_in_branches(self, branches: list[dict[str, Point]]) -> dict[str, Point]:
        names = [set(branch) for branch in branches]
        for name in sorted(set.union(*names) - set.intersection(*names)):
            raise ValueError(
                f"{self.caller}: retain_grad({name!r}) is called in only some branches of a "
                "lax.cond / lax.switch, so there is no gradient to return for it when another "
                "branch runs. Call it in every branch, with the same shape and dtype."
            )
        return super()._same_in_branches(branches)


def _twice(name: str) -> None:
    raise ValueError(
        f"retain_grad name {name!r} is used twice in one differentiated function; "
        "give every retained value its own name."
    )


def nested_retains(
    traced: Callable[..., Any], args: tuple, tag: int
) -> tuple[dict[str, Point], bool]:
    """The values `retain_grad` named inside staged functions when `traced(*args)` ran
    (with the `jhooks.grad` context of tag `tag` active), and whether any hook sits
    inside a staged function (its backward pass may emit there)."""
    closed = jax.make_jaxpr(traced)(*args)
    points = RetainHarvester(tag, False, _twice, "jhooks.grad").points(closed.jaxpr)
    return points, any(_holds_hooks(j) for e in closed.jaxpr.eqns for j in inner_jaxprs(e))


def _holds_hooks(jaxpr: Any) -> bool:
    return any(
        e.primitive is hook_p or any(_holds_hooks(j) for j in inner_jaxprs(e)) for e in jaxpr.eqns
    )


def value_and_grad_harvested(
    call: Callable[[dict[str, Any], tuple], Any],
    probes: dict[str, Any],
    differentiated: tuple,
    tag: int,
    **options: Any,
) -> tuple[Any, list[Any], dict[str, Any]]:
    """`jax.value_and_grad` of `call(probes, differentiated)` with respect to the
    differentiated arguments, the probes, and the values retained in staged functions.

    **Returns:**

    `(value, grads, retained)`: the value, the gradients of the differentiated
    arguments (a list) and those of the probes and retained values, by name.
    """
    traced = Traced(call, (probes, differentiated), lambda x: True)
    closed = traced.closed
    harvester = RetainHarvester(tag, False, _twice, "jhooks.grad")
    points = harvester.points(closed.jaxpr)
    nested = {n: [zero_probe(a) for a in p.avals] for n, p in points.items()}

    def harvested(nested: dict[str, list[Any]], probes: dict[str, Any], *diff: Any) -> Any:
        flat = jax.tree.leaves((probes, diff))
        outs, _ = harvester.run(closed.jaxpr, closed.consts, flat, (), dict(nested))
        return traced.output(outs)

    argnums = tuple(range(2 + len(differentiated)))
    value, (nested_grads, retained, *grads) = jax.value_and_grad(harvested, argnums, **options)(
        nested, probes, *differentiated
    )
    retained = dict(retained)
    for name, point in points.items():
        if name in retained:
            _twice(name)
        retained[name] = jax.tree.unflatten(point.treedef, nested_grads[name])
    return value, grads, retained


# --------------------------------------------------------------------------- emits


def emit_tag(tag: int) -> tuple[str, int]:
    """The tag of the marks of values emitted in staged backward passes of one call."""
    return ("emit", tag)


# The tags (nesting depths of `jhooks.grad`) at which a value was ever emitted in a staged
# backward pass. JAX caches the backward pass of a nested jit (by its jaxpr, itself cached
# by the tag in the jit key): a later trace may reuse it, marks included, without running
# the hooks. So from then on, a `jhooks.grad` at that depth whose function has hooks
# inside staged functions looks for marks.
_STAGED_TAGS: set[int] = set()


def may_hold_staged_emits(tag: int) -> bool:
    """Whether a backward pass cached by JAX may hold emit marks of this tag."""
    return tag in _STAGED_TAGS


def mark_emit(tag: int) -> Callable[[str, Any], None]:
    """Marks a value emitted in a staged backward pass (see `_emit`) as a point."""

    def mark(name: str, value: Any) -> None:
        _STAGED_TAGS.add(tag)
        bind_point(value, name, emit_tag(tag))  # type: ignore[arg-type]

    return mark


def _emitted_twice(name: str) -> None:
    raise ValueError(
        f"jhooks.emit({name!r}) was called twice in one backward pass; give each emitted "
        f"value its own name, e.g. f'{name}.{{layer}}'."
    )


def with_staged_emits(run: Callable[..., tuple], args: tuple, tag: int) -> tuple:
    """`run(*args)` (a `(value, grads, retained)` triple) traced to a jaxpr and evaluated
    by the harvester, so that values emitted in backward passes JAX stages out (scan,
    checkpoint, cond, nested jit) come out of them, stacked along each scan's axis, into
    `retained`."""
    traced = Traced(run, args)
    closed = traced.closed
    harvester = Harvester(emit_tag(tag), False, _emitted_twice, "jhooks.grad")  # type: ignore[arg-type]
    points = harvester.points(closed.jaxpr)
    outs, reaped = harvester.run(closed.jaxpr, closed.consts, traced.inputs)
    value, grads, retained = traced.output(outs)
    for name, point in points.items():
        if name in retained:
            _emitted_twice(name)
        retained[name] = jax.tree.unflatten(point.treedef, reaped[name])
    return value, grads, retained

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

from .._core import zero_probe
from .._staging import Harvester, Point


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


def nested_retains(traced: Callable[..., Any], args: tuple, tag: int) -> dict[str, Point]:
    """The values `retain_grad` named inside staged functions when `traced(*args)` ran
    (with the `jhooks.grad` context of tag `tag` active)."""
    closed = jax.make_jaxpr(traced)(*args)
    return RetainHarvester(tag, False, _twice, "jhooks.grad").points(closed.jaxpr)


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
    out_box: dict[str, Any] = {}

    def traced(probes: dict[str, Any], differentiated: tuple) -> list[Any]:
        out = call(probes, differentiated)
        leaves, tree = jax.tree.flatten(out)
        kept = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        static = [None if i in kept else x for i, x in enumerate(leaves)]
        out_box.update(leaves=static, tree=tree, kept=kept)
        return [leaves[i] for i in kept]

    closed = jax.make_jaxpr(traced)(probes, differentiated)
    harvester = RetainHarvester(tag, False, _twice, "jhooks.grad")
    points = harvester.points(closed.jaxpr)
    nested = {n: [zero_probe(a) for a in p.avals] for n, p in points.items()}

    def harvested(nested: dict[str, list[Any]], probes: dict[str, Any], *diff: Any) -> Any:
        flat = jax.tree.leaves((probes, diff))
        outs, _ = harvester.run(closed.jaxpr, closed.consts, flat, (), dict(nested))
        full = list(out_box["leaves"])
        for i, x in zip(out_box["kept"], outs):
            full[i] = x
        return jax.tree.unflatten(out_box["tree"], full)

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

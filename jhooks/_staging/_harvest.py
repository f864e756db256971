"""Reap and plant through JAX control flow: the machinery behind points in loops.

Inside a run, a cached point binds `point_p`, an identity primitive carrying the point's
name, and `jhooks.loop_index()` binds `loop_index_p`. The run traces its function to a
jaxpr and evaluates it with `Harvester`, which rewrites the primitives that hold them:

- `scan`: the values of the points in its body leave it as extra stacked outputs; their
  probes (zeros whose gradients are the points' gradients) enter as extra stacked inputs;
  an `iota` input gives `loop_index`.
- `cond`: every branch returns the points' values (all branches must have the same ones),
  so the branch that ran gives them.
- `jit`: rewritten and jitted again (kept, per traced program); `checkpoint`: re-wrapped;
  `custom_jvp_call`, `custom_vjp_call`: evaluated inline (their custom rule is dropped).
- `while`: rewritten with a step counter (`loop_index`) and, given `max_steps`, a
  bounded buffer per point (`_while.py`); without the bound its points are refused.

A hook chain (`_values._Chain`) that `retain_grad` named inside a staged function under
`jhooks.grad` is a point too (its `retained` names, by tag): its probe is added to the
chain's inputs, so that its gradient is the one after the chain's hooks.

Oryx's harvest (`oryx/core/interpreters/harvest.py`) does the same with reap and plant.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import (
    CUSTOM_CALLS,
    JIT,
    Bounded,
    ClosedJaxpr,
    Interpreter,
    call_body,
    hook_p,
    inner_jaxprs,
)
from ._marks import loop_index_p, point_p
from ._while import MAX_STEPS_ADVICE, harvest_while, while_points

# The evaluation is `_core`'s `Interpreter` (the environment, the loop, control flow
# staged again) with the rule below; the JAX internals it needs (which equations are
# calls, the jit and custom-derivative primitives) are asked of `_core` (the fence,
# `_jax_compat`); scan, cond and while, whose parameters it reads, are matched by name.


class Point(NamedTuple):
    """A point as the harvest returns it: leaves' types (stacked), structure, floating."""

    name: str
    avals: tuple[Any, ...]
    treedef: Any
    floating: bool

    def stacked(self, length: int) -> Point:
        avals = tuple(a.update(shape=(length, *a.shape)) for a in self.avals)
        return self._replace(avals=avals)


_JITTED: Bounded[tuple, tuple[Any, Callable]] = Bounded(16)  # see Harvester._jitted
_inner = inner_jaxprs
POINTS, INDEX = 1, 2  # what `Harvester.marks` finds: this run's points, loop indices


def _is_call(eqn: Any) -> bool:
    """A call (jit, any checkpoint, closed_call...) or a custom-derivative call, whose
    body is evaluated in place (the custom rule dropped)."""
    return call_body(eqn) is not None or eqn.primitive in CUSTOM_CALLS


class Harvester(Interpreter):
    """Evaluates a run's jaxpr, returning the values of its points and filling loop indices.

    `tag` picks the points of one run; `loops` says whether this run fills
    `loop_index` (the outermost run does); `duplicate(name)` is called for a point
    reached twice on one path (it raises or lets the first value stand); `max_steps`
    bounds the cache of points inside `lax.while_loop` (`_while.py`).
    """

    def __init__(
        self,
        tag: int,
        loops: bool,
        duplicate: Callable[[str], None],
        caller: str,
        max_steps: int | None = None,
    ):
        super().__init__()
        self.tag = tag
        self.loops = loops
        self.duplicate = duplicate
        self.caller = caller
        self.max_steps = max_steps
        # While evaluating (`at`): the loop indices around, probes left, values reaped.
        self.index: tuple[Any, ...] = ()
        self.probes: dict[str, list] | None = None
        self.reaped: dict[str, list[Any]] = {}

    # -- what a jaxpr holds ------------------------------------------------------------

    def _is_point(self, eqn: Any) -> bool:
        return eqn.primitive is point_p and eqn.params["tag"] == self.tag

    def _marks(self, eqn: Any) -> list[Point]:
        """The points of this run that `eqn` marks: a point primitive of its tag, or a
        hook chain that `retain_grad` named (see `jhooks._grad`)."""
        avals = tuple(v.aval for v in eqn.invars)
        if self._is_point(eqn):
            p = eqn.params
            return [Point(p["name"], avals, p["treedef"], p["floating"])]
        if eqn.primitive is hook_p:
            rule = eqn.params["rule"]  # a BackwardRule
            return [
                Point(n, avals, rule.treedef, True) for n, tag in rule.retained if tag == self.tag
            ]
        return []

    def _is_index(self, eqn: Any) -> bool:
        return self.loops and eqn.primitive is loop_index_p

    def _refusal(self, eqn: Any, stacked: str, advice: str = "") -> tuple[str | None, str]:
        """The first point inside `eqn`, and why `eqn` cannot return `stacked` (for errors)."""
        name = self.first(_inner(eqn), lambda e: next((m.name for m in self._marks(e)), None))
        kind = eqn.primitive.name
        if kind == "while":
            where = (
                "a lax.while_loop (or a lax.fori_loop with traced bounds), whose number of "
                f"iterations is not known when tracing, so there is no axis to stack its "
                f"{stacked} along. Use lax.scan, or lax.fori_loop with Python int bounds"
                f"{advice}"
            )
        else:
            where = f"a `{kind}` primitive, which jhooks cannot look into"
        return name, where

    def _refuse(self, eqn: Any) -> None:
        advice = MAX_STEPS_ADVICE if eqn.primitive.name == "while" else ""
        name, where = self._refusal(eqn, "values", advice)
        if name is None:
            raise ValueError(
                f"{self.caller}: jhooks.loop_index() was called inside {where}. Forward "
                "hooks still run there without it."
            )
        raise ValueError(
            f"{self.caller}: hook point {name!r} is inside {where}; its value cannot be "
            "returned from the run. Forward and backward hooks still run there; leave "
            "the point out of names_filter to cache the others."
        )

    def points(self, jaxpr: Any) -> dict[str, Point]:
        """The points of this run in `jaxpr`, in the order they are reached, stacked
        along one leading axis per scan around them."""
        found: dict[str, Point] = {}

        def add(point: Point) -> None:
            if point.name in found:
                self.duplicate(point.name)
            else:
                found[point.name] = point

        for eqn in jaxpr.eqns:
            marks = self._marks(eqn)
            for point in marks:
                add(point)
            if marks:
                continue
            if not any(self.holds(j) & POINTS for j in _inner(eqn)):
                continue
            kind = eqn.primitive.name
            if kind == "scan":
                for point in self.points(eqn.params["jaxpr"].jaxpr).values():
                    add(point.stacked(eqn.params["length"]))
            elif kind == "while":
                for point in while_points(self, eqn):
                    add(point)
            elif kind == "cond":
                branches = [self.points(b.jaxpr) for b in eqn.params["branches"]]
                for point in self._same_in_branches(branches).values():
                    add(point)
            elif _is_call(eqn):
                for inner in _inner(eqn)[:1]:
                    for point in self.points(inner).values():
                        add(point)
            else:
                self._refuse(eqn)
        return found

    def _same_in_branches(self, branches: list[dict[str, Point]]) -> dict[str, Point]:
        first = branches[0]
        for other in branches[1:]:
            for name in set(first) ^ set(other):
                raise ValueError(
                    f"{self.caller}: hook point {name!r} is reached in only some branches "
                    "of a lax.cond / lax.switch, so the cache would have no value for it "
                    "when another branch runs. Reach it in every branch (with the same "
                    "shape and dtype), or leave it out of names_filter."
                )
            for name, point in first.items():
                if [(a.shape, a.dtype) for a in point.avals] != [
                    (a.shape, a.dtype) for a in other[name].avals
                ] or point.treedef != other[name].treedef:
                    raise ValueError(
                        f"{self.caller}: hook point {name!r} has different shapes or dtypes "
                        "in the branches of a lax.cond / lax.switch "
                        f"({[a.str_short() for a in point.avals]} and "
                        f"{[a.str_short() for a in other[name].avals]}); the cache needs one "
                        "type per point. Give each branch's point its own name."
                    )
        return first

    # -- evaluation: the rule of `_core`'s `Interpreter` --------------------------------

    def run(
        self,
        jaxpr: Any,
        consts: Any,
        args: list[Any],
        index: tuple[Any, ...] = (),
        probes: dict[str, list] | None = None,
    ) -> tuple[list[Any], dict[str, list[Any]]]:
        """Evaluates `jaxpr`; returns its outputs and the leaves of this run's points.

        `index` holds the indices of the loops around it; `probes` (or `None`), by
        point name, zeros added to the points' values, taken out as they are used.
        """
        at = self.at(index, probes)
        return at.run_jaxpr(jaxpr, consts, args), at.reaped

    def at(self, index: tuple[Any, ...], probes: dict[str, list] | None) -> Harvester:
        """This harvester, evaluating inside loops of indices `index` with `probes`."""
        inner = copy.copy(self)  # sharing the memo of `holds`
        inner.index, inner.probes, inner.reaped = tuple(index), probes, {}
        return inner

    def marks(self, eqn: Any) -> int:
        return (POINTS if self._marks(eqn) else 0) | (INDEX if self._is_index(eqn) else 0)

    def equation(self, eqn: Any, invals: list[Any], at: tuple) -> list[Any]:
        probes = self.probes
        for point in self._marks(eqn):
            if point.name not in self.reaped:
                if probes is not None and point.name in probes:
                    invals = [x + p for x, p in zip(invals, probes.pop(point.name))]
                self.reaped[point.name] = invals
        if self._is_point(eqn):
            return invals
        if self._is_index(eqn):
            return self._index(eqn)
        return super().equation(eqn, invals, at)

    def _index(self, eqn: Any) -> list[Any]:
        index = self.index
        if eqn.params["depth"] != len(index):
            raise ValueError(
                f"{self.caller}: jhooks.loop_index() was traced inside "
                f"{eqn.params['depth']} loops but runs inside {len(index)} here (a jitted "
                "function called from different loop depths?)."
            )
        return list(index)

    def enter(self, eqn: Any, invals: list[Any], at: tuple) -> list[Any]:
        if eqn.primitive.name == "while":
            outs, reaped = harvest_while(self, eqn, invals, self.index, self.probes)
            self.took(eqn, reaped)
            return outs
        p = eqn.params
        if eqn.primitive is JIT and isinstance(p["jaxpr"], ClosedJaxpr):
            mine = self._take(self.probes, p["jaxpr"].jaxpr)
            jitted = self._jitted(p["jaxpr"], mine, len(self.index))
            outs, reaped = jitted(invals, mine, self.index)
            self.took(eqn, reaped)
            return outs
        if eqn.primitive in CUSTOM_CALLS:  # the custom rule is dropped
            closed = p["call_jaxpr"]
            if isinstance(closed, ClosedJaxpr):
                return self.call_into(eqn, closed.jaxpr, closed.consts, invals, at)
            return self.call_into(eqn, closed, (), invals, at)
        return super().enter(eqn, invals, at)

    def refuse(self, eqn: Any) -> None:
        self._refuse(eqn)

    def side_in(self, eqn: Any, body: Any) -> Any:
        """A scan's body: its loop index (an `iota`, if it needs one) and probes; any
        other body: its probes and the loop indices around it."""
        if eqn.primitive.name == "cond":
            self._same_in_branches([self.points(b.jaxpr) for b in eqn.params["branches"]])
        mine = self._take(self.probes, body)
        if eqn.primitive.name != "scan":
            return mine, self.index
        needs_index = self.holds(body) & INDEX
        length = eqn.params["length"]
        return (jnp.arange(length, dtype=jnp.int32) if needs_index else None), mine

    def inner(self, eqn: Any, side: Any) -> Harvester:
        if eqn.primitive.name != "scan":
            probes, index = side
            return self.at(index, probes)
        i, probes = side
        return self.at(self.index if i is None else (*self.index, i), probes)

    def side_out(self) -> dict[str, list[Any]]:
        return self.reaped

    def took(self, eqn: Any, out: dict[str, list[Any]]) -> None:
        for name, leaves in out.items():
            self.reaped.setdefault(name, leaves)

    def _take(self, probes: dict[str, list] | None, jaxpr: Any) -> dict[str, list] | None:
        """The probes of the points inside `jaxpr`, removed from `probes`."""
        if probes is None:
            return None
        return {n: probes.pop(n) for n in self.points(jaxpr) if n in probes}

    def _jitted(self, closed: Any, probes: dict | None, depth: int) -> Callable:
        """A nested jit, rewritten and jitted again; kept, so that eager runs of a jitted
        function compile it once."""
        probed = None if probes is None else tuple(probes)
        key = (id(closed), self.tag, self.loops, probed, depth, self.max_steps)
        if key not in _JITTED or _JITTED[key][0] is not closed:
            inner = type(self)(self.tag, self.loops, lambda name: None, self.caller)
            inner.max_steps = self.max_steps

            def call(args: list, pr: Any, ix: tuple) -> tuple:
                return inner.run(closed.jaxpr, closed.consts, list(args), tuple(ix), pr)

            _JITTED[key] = (closed, jax.jit(call))
        _JITTED.move_to_end(key)
        return _JITTED[key][1]

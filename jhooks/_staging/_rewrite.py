"""A program evaluated again with the values of chosen operations passed through a hook.

`AtOperations` evaluates a traced function's jaxpr equation by equation; the value of
each chosen equation (an operation address, `_addresses.py`) goes through
`point(value, address)`, the function a `hook_point` calls (`_runs.named_point`): the
runs' forward hooks, the cache's mark and the backward hooks, one mechanism. The
control flow that holds a chosen equation is staged again around the evaluation of
its body: `lax.scan` (whose marks the staged run then stacks, as for points),
`lax.cond`/`switch`, `lax.while_loop`, `jax.checkpoint` (its policy kept); a nested
`jit` is evaluated inline. Everything else is bound as it was, a `custom_jvp` or
`custom_vjp` call with its rule (an operation is never looked for inside one: the
call is one operation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core import (
    COND,
    REMAT,
    SCAN,
    WHILE,
    bind_equation,
    call_body,
    inner_jaxprs,
    is_literal,
    remat_like,
    with_source_of,
)


class AtOperations:
    """Evaluates jaxprs, passing chosen equations' values through `point`.

    `chosen` maps `id(eqn)` to the operation's address; `point(value, address)`
    returns the value to use (a single output as an array, several as a list).
    """

    def __init__(self, chosen: dict[int, str], point: Callable[[Any, str], Any], caller: str):
        self.chosen = chosen
        self.point = point
        self.caller = caller
        self._memo: dict[int, tuple[Any, bool]] = {}

    def holds(self, jaxpr: Any) -> bool:
        """Whether `jaxpr` (or one inside it) has a chosen equation."""
        memo = self._memo.get(id(jaxpr))
        if memo is not None and memo[0] is jaxpr:
            return memo[1]
        found = any(
            id(eqn) in self.chosen or any(self.holds(j) for j in inner_jaxprs(eqn))
            for eqn in jaxpr.eqns
        )
        self._memo[id(jaxpr)] = (jaxpr, found)
        return found

    def run(self, jaxpr: Any, consts: Any, args: list[Any]) -> list[Any]:
        """Evaluates `jaxpr` on `args`; returns its outputs."""
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if is_literal(v) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            with with_source_of(eqn):
                if any(self.holds(j) for j in inner_jaxprs(eqn)):
                    outs = self._rewrite(eqn, invals)
                else:
                    outs = bind_equation(eqn, invals)
            address = self.chosen.get(id(eqn))
            if address is not None:
                if len(outs) == 1:
                    outs = [self.point(outs[0], address)]
                else:
                    outs = list(self.point(list(outs), address))
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _rewrite(self, eqn: Any, invals: list[Any]) -> list[Any]:
        p = eqn.params
        if eqn.primitive is SCAN:
            closed, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
            consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]

            def step(carry: list, x: list) -> tuple:
                outs = self.run(closed.jaxpr, closed.consts, [*consts, *carry, *x])
                return outs[:nk], outs[nk:]

            carry, ys = jax.lax.scan(
                step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
            )
            return [*carry, *ys]
        if eqn.primitive is COND:

            def branch(closed: Any) -> Callable:
                return lambda ops: self.run(closed.jaxpr, closed.consts, list(ops))

            return jax.lax.switch(invals[0], [branch(b) for b in p["branches"]], invals[1:])
        if eqn.primitive is WHILE:
            cond, body = p["cond_jaxpr"], p["body_jaxpr"]
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            cc, bc, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
            return jax.lax.while_loop(
                lambda c: self.run(cond.jaxpr, cond.consts, [*cc, *c])[0],
                lambda c: self.run(body.jaxpr, body.consts, [*bc, *c]),
                list(init),
            )
        if eqn.primitive is REMAT:
            jaxpr = p["jaxpr"]
            return remat_like(eqn, lambda args: self.run(jaxpr, (), list(args)))(invals)
        called = call_body(eqn)
        if called is not None:  # a nested jit: inline
            return self.run(called[0], called[1], invals)
        inside = next(filter(None, map(self._first, inner_jaxprs(eqn))))
        raise ValueError(
            f"{self.caller}: operation {inside!r} is inside a `{eqn.primitive.name}` "
            "primitive, which jhooks cannot evaluate again; select an operation outside it."
        )

    def _first(self, jaxpr: Any) -> str | None:
        """The first chosen address in `jaxpr` (or one inside it)."""
        for eqn in jaxpr.eqns:
            found = self.chosen.get(id(eqn)) or next(
                filter(None, map(self._first, inner_jaxprs(eqn))), None
            )
            if found:
                return found
        return None

"""The one jaxpr interpreter: an environment, the equation loop, control flow staged again.

`Interpreter` evaluates a jaxpr equation by equation, as `jax.core.eval_jaxpr` does,
and, where its client's rule asks, evaluates the jaxprs inside an equation with itself,
staging the control flow again around them: `lax.scan`, `lax.cond`/`switch`,
`lax.while_loop`, `jax.checkpoint` (its policy kept) and calls (nested `jit`,
`closed_call`: inline). Its clients are rules (subclasses): the staged runs' harvest
(`_staging/_harvest.py`), operation addresses (`_staging/_rewrite.py`) and
`clipped_grad`'s walker (`_per_example/_walk.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax

from ._jax_compat import (
    COND,
    SCAN,
    WHILE,
    bind_equation,
    call_body,
    inner_jaxprs,
    is_literal,
    remat_like,
)


class Interpreter:
    """Evaluates jaxprs equation by equation; a client overrides the rule's methods:

    - `marks(eqn)`: bit flags of what the client looks for in `eqn` itself; `holds(jaxpr)`
      is their union over a jaxpr and every jaxpr inside it (kept per jaxpr).
    - `equation(eqn, invals, at)`: the outputs of one equation; by default `enter` it
      when a jaxpr inside it holds a mark, else bind it as it was.
    - Values of the client's may cross a body staged again besides its operands:
      `side_in(eqn, body)` (what enters: stacked along a scan's axis), `inner(eqn,
      side)` (the interpreter of the body, given it), `side_out()` (what that
      interpreter brings out: stacked along a scan's axis), `took(eqn, out)` (the
      caller receives it). None crosses a `lax.while_loop`.
    - `refuse(eqn)`: raises, for an equation to enter that is none of those.
    """

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Any, int]] = {}  # `holds`, by jaxpr

    def run_jaxpr(self, jaxpr: Any, consts: Any, args: Any, path: tuple = ()) -> list[Any]:
        """Evaluates `jaxpr` on `args`; returns its outputs. Each equation is evaluated
        `at` `(*path, its index)`: `path` locates `jaxpr` in the outermost one."""
        env: dict[Any, Any] = {}
        literal = self.literal

        def read(v: Any) -> Any:
            return literal(v) if is_literal(v) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for i, eqn in enumerate(jaxpr.eqns):
            outs = self.equation(eqn, [read(v) for v in eqn.invars], (*path, i))
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def body(self, jaxpr: Any, consts: Any, args: list[Any], path: tuple) -> list[Any]:
        """How a body staged again (a scan's, a branch, a call's) is evaluated."""
        return self.run_jaxpr(jaxpr, consts, args, path)

    def literal(self, v: Any) -> Any:
        """The environment's value of a literal operand."""
        return v.val

    def marks(self, eqn: Any) -> int:
        """Bit flags of what the client looks for in `eqn` itself (not inside it)."""
        return 0

    def holds(self, jaxpr: Any) -> int:
        """The union of `marks` over `jaxpr`'s equations and the jaxprs inside them."""
        memo = self._memo
        kept = memo.get(id(jaxpr))
        if kept is not None and kept[0] is jaxpr:
            return kept[1]
        found = 0
        for eqn in jaxpr.eqns:
            found |= self.marks(eqn)
            for inner in inner_jaxprs(eqn):
                found |= self.holds(inner)
        memo[id(jaxpr)] = (jaxpr, found)
        return found

    def equation(self, eqn: Any, invals: list[Any], at: tuple) -> list[Any]:
        """The outputs of `eqn` on `invals`."""
        if any(self.holds(j) for j in inner_jaxprs(eqn)):
            return self.enter(eqn, invals, at)
        return bind_equation(eqn, invals)

    def side_in(self, eqn: Any, body: Any) -> Any:
        return None

    def inner(self, eqn: Any, side: Any) -> Interpreter:
        return self

    def side_out(self) -> Any:
        return None

    def took(self, eqn: Any, out: Any) -> None:
        pass

    def refuse(self, eqn: Any) -> None:
        raise NotImplementedError(f"cannot evaluate a `{eqn.primitive.name}` again")

    def first(self, jaxprs: Any, name_of: Callable[[Any], str | None]) -> str | None:
        """The first `name_of(eqn)` that is not `None` in `jaxprs` or inside them."""
        for jaxpr in jaxprs:
            for eqn in jaxpr.eqns:
                found = name_of(eqn) or self.first(inner_jaxprs(eqn), name_of)
                if found is not None:
                    return found
        return None

    def enter(self, eqn: Any, invals: list[Any], at: tuple) -> list[Any]:
        """Evaluates the jaxprs inside `eqn` with this interpreter, staging its control
        flow again around them."""
        if eqn.primitive is SCAN:
            return self._staged_scan(eqn, invals, at)
        if eqn.primitive is COND:
            return self._staged_cond(eqn, invals, at)
        if eqn.primitive is WHILE:
            return self._staged_while(eqn, invals, at)
        called = call_body(eqn)
        if called is not None:
            return self.call_into(eqn, called[0], called[1], invals, at)
        self.refuse(eqn)
        raise AssertionError  # refuse raises

    def call_into(self, eqn: Any, jaxpr: Any, consts: Any, invals: list, at: tuple) -> list:
        """Evaluates `jaxpr`, the body `eqn` calls once: inline, or inside
        `jax.checkpoint` with `eqn`'s policy when `eqn` is a checkpoint."""

        def call(args: list, side: Any) -> tuple:
            inner = self.inner(eqn, side)
            return inner.body(jaxpr, consts, list(args), at), inner.side_out()

        outs, out = remat_like(eqn, call)(invals, self.side_in(eqn, jaxpr))
        self.took(eqn, out)
        return outs

    def _staged_scan(self, eqn: Any, invals: list[Any], at: tuple) -> list[Any]:
        p = eqn.params
        closed, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
        consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]

        def step(carry: list, x: tuple) -> tuple:
            xs_i, side_i = x
            inner = self.inner(eqn, side_i)
            outs = inner.body(closed.jaxpr, closed.consts, [*consts, *carry, *xs_i], at)
            return outs[:nk], (outs[nk:], inner.side_out())

        side = self.side_in(eqn, closed.jaxpr)
        carry, (ys, out) = lax.scan(
            step, init, (xs, side), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
        )
        self.took(eqn, out)
        return [*carry, *ys]

    def _staged_cond(self, eqn: Any, invals: list[Any], at: tuple) -> list[Any]:
        branches = eqn.params["branches"]

        def branch(closed: Any) -> Any:
            def run(ops: Any, side: Any) -> tuple:
                inner = self.inner(eqn, side)
                return inner.body(closed.jaxpr, closed.consts, list(ops), at), inner.side_out()

            return run

        side = self.side_in(eqn, branches[0].jaxpr)
        outs, out = lax.switch(invals[0], [branch(b) for b in branches], invals[1:], side)
        self.took(eqn, out)
        return outs

    def _staged_while(self, eqn: Any, invals: list[Any], at: tuple) -> list[Any]:
        p = eqn.params
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
        return lax.while_loop(
            lambda c: self.body(cond.jaxpr, cond.consts, [*cc, *c], at)[0],
            lambda c: self.body(body.jaxpr, body.consts, [*bc, *c], at),
            list(init),
        )

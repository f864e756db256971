"""The walk of `jhooks.clipped_grad` over the per-example loss's jaxpr.

The per-example loss is traced once to a jaxpr whose first inputs are the model's
parameters. A parameter flows through *views* (reshape, transpose, squeeze, broadcast,
dtype conversion), *scales* (a product with a scalar, a negation), calls (nested `jit`,
any version's `jax.checkpoint`: any primitive that calls one jaxpr once) and `lax.scan`
(as a constant of the body, the same weight every iteration, or as a scanned input, a
slice per iteration: scan-over-layers), static slices (*regions*, `W[:, :k]`), shifts
(`1 + scale`) and derived values (`exp(W)`, see `_passages`) into the operations that
*use* it.

`Walker(evaluate=False)` collects the uses. `Walker(evaluate=True)` runs the loss again
and, at each *site* (a use with a ghost rule, see `_sites`), adds a zero probe to the
output and records the site's other operands and the product of the scales on the way:
inside a scan the probes enter, and the records leave, stacked along the scan's axis;
inside a checkpoint they cross it as its arguments and results. A *tapped* site records
nothing: its backward pass returns its norm as its probe's cotangent (`_norms.tap`).

Only the jaxpr's own structure is read: no jhooks hook machinery.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

from .._core import REMAT, SCAN, Interpreter, bind_equation, call_body, is_literal
from ._gathered import Gathered, classify_gathered
from ._passages import passage, with_constants
from ._sites import Loop, Use, classify, region_of
from ._taps import Tap, tap, tap_second

# Operations that only relabel (or broadcast) a parameter: followed, not uses.
VIEWS = frozenset(
    {
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
        "copy_p",
        "reduce_precision",
    }
)


@dataclasses.dataclass(frozen=True)
class Tag:
    """A value that is `scale` times a view of parameter `leaf` through `chain` (view
    equations and `Loop`s, from the parameter to the value); `derived` when the chain
    holds a `DERIVED` operation (analysis only: a derived use is never a site)."""

    leaf: int
    chain: tuple = ()
    scale: Any = dataclasses.field(default=None, compare=False)  # evaluate only
    derived: str = ""  # the first DERIVED operation on the way, named in the warning
    rows: Any = dataclasses.field(default=None, compare=False)  # a `Gathered`'s ids

    def then(self, step: Any, derived: str = "", rows: Any = None) -> Tag:
        rows = self.rows if rows is None else rows
        return Tag(self.leaf, self.chain + (step,), self.scale, self.derived or derived, rows)

    def scaled(self, factor: Any) -> Tag:
        scale = factor if self.scale is None else self.scale * factor
        return Tag(self.leaf, self.chain, scale, self.derived, self.rows)


def _scale_of(eqn: Any, intags: list, invals: list, evaluate: bool) -> tuple[bool, Any]:
    """(whether `eqn` scales its one tagged operand by a scalar, the factor)."""
    name = eqn.primitive.name
    tagged = [j for j, t in enumerate(intags) if t is not None]
    if len(tagged) != 1 or len(eqn.outvars) != 1:
        return False, None
    j = tagged[0]
    if eqn.outvars[0].aval.shape != eqn.invars[j].aval.shape:
        return False, None
    if name == "neg":
        return True, -1.0
    if name not in ("mul", "div") or len(eqn.invars) != 2 or eqn.invars[1 - j].aval.shape:
        return False, None
    if name == "div" and j == 1:
        return False, None  # c / W is not linear in W
    other = invals[1 - j] if evaluate else None
    return True, (None if other is None else (1 / other if name == "div" else other))


class Value(NamedTuple):
    """What the walk holds of a jaxpr variable: its value (`None` in analysis), its tag
    (`None` unless a view of a parameter) and its taint (whether it depends on the
    example; analysis only)."""

    x: Any
    tag: Tag | None
    taint: bool


class Walker(Interpreter):
    """Walks (`evaluate=False`) or evaluates (`evaluate=True`) a jaxpr, following parameters.

    **Arguments:**

    - `leaf_shapes`: the parameters' shapes, by leaf index (analysis).
    - `sites`: `{equation path: operand index of the parameter}`: the sites whose output
      gets a probe and whose other operands are recorded (evaluation).
    - `taps`: `{equation path: Tap}`: the sites whose squared gradient norm is computed in
      the backward pass, as the cotangent of their probe (`_taps`; evaluation).
    - `probes`: `{equation path: zeros like the site's output}` for `sites`, a zero scalar
      for `taps`, stacked along the axes of the scans around the site (evaluation).

    The evaluation is `_core`'s `Interpreter` with this rule; the scans and calls that
    a parameter enters are staged again there, the probes going in and the records
    coming out (`side_in`, `side_out`).
    """

    def __init__(
        self, evaluate: bool, leaf_shapes=None, sites=None, probes=None, taps=None, passages=None
    ):
        super().__init__()
        self.evaluate = evaluate
        # How a parameter passed each equation (`_passages`): decided by the analysis,
        # followed by the evaluation.
        self.passages: dict[tuple, str | None] = {} if passages is None else passages
        self.leaf_shapes = leaf_shapes or {}
        self.sites: dict[tuple, int] = sites or {}
        self.taps: dict[tuple, Tap] = taps or {}
        self.carriers: dict[tuple, tuple] = {}  # first site of a pair -> (carrier, record)
        self.probes: dict[tuple, Any] = probes or {}
        self.uses: list[Use] = []
        self.records: dict[tuple, tuple] = {}
        self.checkpoints = 0  # how many checkpoints the walk is inside (analysis)
        # A body's walker: its inputs' tags, its records' layout, its outputs' tags;
        # entering one: (sites, taps, probes, tags, layout) and the body's walker.
        self.arg_tags, self.layout, self.out_tags = [], {}, []
        self.entering: tuple = ()
        self.entered: Walker | None = None

    def run(self, jaxpr, consts, args, tags, taints=None, path=()):
        """Returns `(outputs, output tags, output taints)`; a taint marks a value that
        depends on the example (analysis only)."""
        taints = taints if taints is not None else [True] * len(jaxpr.invars)
        ins = [Value(x, t, d) for x, t, d in zip(args, tags, taints)]
        outs = self.run_jaxpr(jaxpr, [Value(x, None, False) for x in consts], ins, path)
        return [v.x for v in outs], [v.tag for v in outs], [v.taint for v in outs]

    def literal(self, v):
        return Value(v.val, None, False)

    def equation(self, eqn, invals, at):
        outs = self._equation(
            eqn, at, [v.x for v in invals], [v.tag for v in invals], [v.taint for v in invals]
        )
        return [Value(*v) for v in zip(*outs)]

    def _equation(self, eqn, key, invals, intags, intaints):
        n_out = len(eqn.outvars)
        tagged = [j for j, t in enumerate(intags) if t is not None]
        taint = any(intaints)
        if tagged and eqn.primitive is SCAN:
            return self._scan(eqn, key, invals, intags, intaints)
        body = call_body(eqn) if tagged else None
        if body is not None:
            return self._call(eqn, key, body, invals, intags, intaints)
        outs = bind_equation(eqn, invals) if self.evaluate else [None] * n_out
        outtags: list = [None] * n_out
        name = eqn.primitive.name
        if not tagged or name == "stop_gradient":
            return outs, outtags, [taint] * n_out  # stopped: no gradient flows back, not a use
        tag = intags[tagged[0]]
        if name in VIEWS and len(eqn.invars) == 1:
            return outs, [tag.then(eqn)], [taint]
        if self.evaluate:
            how = self.passages.get(key)
        else:
            how = passage(eqn, tagged, tag, intaints)
            self.passages[key] = how
        if how == "region":  # its own sites: W[:, :k] @ x, jnp.split(W, 3, axis=-1)
            return outs, [tag.then(region_of(eqn, k)) for k in range(n_out)], [taint] * n_out
        if how == "gathered":  # W[expert_ids]: its products are sites of their own
            return outs, [tag.then(Gathered(eqn), rows=invals[1])], [taint]
        if how == "shift":  # W + c: W's rule; c - W: -1 times W's
            negated = name == "sub" and tagged[0] == 1
            return outs, [tag.scaled(-1.0) if negated and self.evaluate else tag], [taint]
        if how == "derived":  # followed in the analysis only: its uses are never sites
            derived = None if self.evaluate else tag.then(eqn, derived=name)
            return outs, [derived] * n_out, [taint] * n_out
        is_scale, factor = _scale_of(eqn, intags, invals, self.evaluate)
        if is_scale:
            return outs, [tag.scaled(factor) if self.evaluate else tag], [taint]
        if not self.evaluate and with_constants(eqn, tagged, intaints):
            return outs, [tag.then(eqn, derived=name)], [taint]
        if not self.evaluate:
            self._record_uses(eqn, key, intags, intaints, tagged)
        elif key in self.sites or key in self.taps:
            j = self.taps[key].use.operand if key in self.taps else self.sites[key]
            # The other operands (the layer's input, or the token ids), and the scale.
            others = [jnp.asarray(x) for k, x in enumerate(invals) if k != j]
            if intags[j].rows is not None:  # a product of gathered matrices: their ids
                others.append(jnp.asarray(intags[j].rows))
            out = outs[0]
            assert out is not None  # evaluated
            scale = intags[j].scale
            scale = jnp.ones((), out.dtype) if scale is None else jnp.asarray(scale)
            record = (*others, scale.astype(out.dtype))
            t = self.taps.get(key)
            if t is not None and t.first is not None:
                carrier, first_record = self.carriers[t.first.site or ()]
                outs[0] = tap_second(t, out, record, self.probes[key], carrier, first_record)
            elif t is not None and t.pairs:
                outs[0], carrier = tap(t, out, record, self.probes[key])
                self.carriers[key] = (carrier, record)
            elif t is not None:
                outs[0] = tap(t, out, record, self.probes[key])
            else:
                self.records[key] = record
                outs[0] = out + self.probes[key]
        return outs, outtags, [taint] * n_out

    def _record_uses(self, eqn, key, intags, intaints, tagged):
        name = eqn.primitive.name
        # Whether the operation meets the example: `x * scale`, `x + bias`, not `W * mask`.
        meets_example = any(d for k, d in enumerate(intaints) if k not in tagged)
        if len(tagged) > 1:  # W @ W, [cls, registers, x]: one operation of two parameters
            for j in tagged:
                self.uses.append(Use(intags[j].leaf, name, None, meets_example=meets_example))
            return
        j = tagged[0]
        tag = intags[j]
        through = tag.derived
        if any(isinstance(s, Gathered) for s in tag.chain):
            signature = classify_gathered(eqn, j, tag.chain)
            kind, through = ("gdot", "") if signature else (name, through or "gather")
        else:
            kind, signature = classify(eqn, j, tag.chain, self.leaf_shapes[tag.leaf])
        if tag.derived:
            kind, signature = name, None
        site = key if signature is not None else None
        under = self.checkpoints > 0
        use = Use(tag.leaf, kind, site, signature, eqn, j, tag.chain, meets_example, under)
        use.through = through
        self.uses.append(use)

    def _enter(self, eqn, key, invals, tags):
        """Evaluates the body of `eqn` (a call or a scan) with walkers whose inputs have
        the tags `tags`, with the sites inside it and their probes (inside a scan: the
        whole stacks, sliced per iteration); returns its outputs and the last walker."""

        def inside(d):
            return {s: x for s, x in d.items() if s[: len(key)] == key and s != key}

        self.entering = (inside(self.sites), inside(self.taps), inside(self.probes), tags, {})
        outs = self.enter(eqn, invals, key)
        assert self.entered is not None  # the body was evaluated
        return outs, self.entered

    def side_in(self, eqn, body):
        return self.entering[2]

    def inner(self, eqn, side):
        sites, taps, _, tags, layout = self.entering
        self.entered = inner = Walker(
            True, sites=sites, probes=side, taps=taps, passages=self.passages
        )
        inner.arg_tags, inner.layout = tags, layout
        return inner

    def body(self, jaxpr, consts, args, path):
        outs, self.out_tags, _ = self.run(jaxpr, consts, args, self.arg_tags, None, path)
        return outs

    def side_out(self):
        return pack(self.records, self.layout)

    def took(self, eqn, out):
        self.records.update(unpack(out, self.entering[4]))

    def _call(self, eqn, key, body, invals, intags, intaints):
        jaxpr, consts = body
        n = len(eqn.outvars)
        remat = eqn.primitive is REMAT
        if self.evaluate:
            outs, inner = self._enter(eqn, key, invals, intags)
            # Evaluated in place, its tags stay valid; of a checkpoint, only the
            # parameters it returns as they came in (Flax's `nnx.remat`).
            outtags = _passed_through(jaxpr, intags) if remat else inner.out_tags
            return outs, outtags, [True] * n
        self.checkpoints += remat
        outs, outtags, outtaints = self.run(jaxpr, consts, invals, intags, intaints, key)
        self.checkpoints -= remat
        if remat:  # a parameter view made inside a checkpoint, out of it: no rule
            passed = _passed_through(jaxpr, intags)
            for t, p in zip(outtags, passed):
                if t is not None and p is None:
                    self.uses.append(Use(t.leaf, "checkpoint (as its output)", None))
            outtags = passed
        return outs, outtags, outtaints

    def _scan(self, eqn, key, invals, intags, intaints):
        p = eqn.params
        closed, nc, nk, length = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"]
        tags = [
            None if t is None else t.then(Loop(length, sliced=k >= nc + nk))
            for k, t in enumerate(intags)
        ]
        n_out = len(eqn.outvars)
        if self.evaluate:
            outs, _ = self._enter(eqn, key, invals, tags)
            return outs, [None] * n_out, [True] * n_out
        for k in range(nc, nc + nk):
            if intags[k] is not None:  # a parameter in the carry: no rule
                self.uses.append(Use(intags[k].leaf, "scan (as its carry)", None))
                tags[k] = None
        taints = _loop_taints(closed.jaxpr, nc, nk, intaints)
        _, outtags, _ = self.run(closed.jaxpr, closed.consts, invals, tags, taints, key)
        for t in outtags:
            if t is not None:  # a parameter returned from the body: no rule
                self.uses.append(Use(t.leaf, "scan (as its output)", None))
        return [None] * n_out, [None] * n_out, [any(intaints)] * n_out


def _passed_through(jaxpr, intags: list) -> list:
    """The tags of a call's outputs that are its inputs returned unchanged, else None."""
    where = {v: j for j, v in enumerate(jaxpr.invars)}
    return [None if is_literal(v) or v not in where else intags[where[v]] for v in jaxpr.outvars]


def pack(records: dict, layout: dict) -> list:
    """The records' arrays, each once (the projections q, k, v share their input): what
    leaves a scan or a checkpoint, and is stored for the backward pass. `layout` is filled
    with what `unpack` needs."""
    unique: dict[int, int] = {}
    arrays: list = []
    for site, record in records.items():
        places = []
        for x in record:
            if id(x) not in unique:
                unique[id(x)] = len(arrays)
                arrays.append(x)
            places.append(unique[id(x)])
        layout[site] = places
    return arrays


def unpack(arrays: list, layout: dict) -> dict:
    """The records, by site, from `pack`'s arrays."""
    return {site: tuple(arrays[i] for i in places) for site, places in layout.items()}


def _loop_taints(body, nc: int, nk: int, intaints: list) -> list:
    """The taints of a scan body's inputs: a carry is tainted if its initial value is or
    if an iteration makes it so (a fixed point)."""
    taints = list(intaints)
    for _ in range(nk + 1):
        n = len(taints)
        nones = [None] * len(body.constvars)
        _, _, outtaints = Walker(False).run(body, nones, [None] * n, [None] * n, taints)
        new = [taints[nc + k] or outtaints[k] for k in range(nk)]
        if new == taints[nc : nc + nk]:
            break
        taints[nc : nc + nk] = new
    return taints

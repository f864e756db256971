"""Sites: the uses of a parameter with a ghost rule, and their factors.

A use of a parameter view by a `dot_general` (every `eqn.nn.Linear`, the projections of
`eqx.nn.MultiheadAttention`, any `W @ x`), a `conv_general_dilated` without groups
(`eqx.nn.Conv1d/2d/3d`) or a row `gather` / `dynamic_slice` (`eqx.nn.Embedding`) is a
*site*. Example `i`'s gradient of the parameter at one site is a sum over the positions
`p` at which it was applied of an outer product `F0_p ⊗ F1_p`: the layer's input `a_p`
(or the im2col patch, or the one-hot row of a token id) and the output gradient `g_p`.
`factors` gives them, `(P, d)` arrays (an index array for one-hot rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import bind_equation
from ._gathered import Gathered, gathered_factors

# Views that keep a matrix a matrix, axis for axis: those a tied weight may go through.
_AXIS_VIEWS = frozenset({"transpose", "convert_element_type", "copy", "copy_p", "reduce_precision"})


@dataclasses.dataclass(frozen=True)
class Loop:
    """A scan a parameter entered: `sliced` for a scanned input (a slice per iteration),
    not for a constant of the body (the same value every iteration)."""

    length: int
    sliced: bool


@dataclasses.dataclass(frozen=True)
class Region:
    """A static slice of a parameter view, `[start, limit)` on each axis: `lax.slice`
    with unit strides (`W[:, :k]`, `E[i]` with a static `i`) or output `output` of
    `split` (`jnp.split(W, 3, axis=-1)`). Its uses are sites of their own; the
    parameter's gradient is its regions' gradients, each placed in its range."""

    eqn: Any
    output: int
    start: tuple
    limit: tuple

    @property
    def size(self) -> int:
        return int(np.prod([b - a for a, b in zip(self.start, self.limit)], dtype=int))

    def apply(self, view: Any) -> Any:
        return bind_equation(self.eqn, [view])[self.output]


def region_of(eqn: Any, output: int) -> Region | None:
    """The region that output `output` of a `slice` or `split` equation cuts, if static
    with unit strides."""
    shape = eqn.invars[0].aval.shape
    if eqn.primitive.name == "slice":
        strides = eqn.params["strides"]
        if strides is not None and any(s != 1 for s in strides):
            return None
        start, limit = tuple(eqn.params["start_indices"]), tuple(eqn.params["limit_indices"])
        return Region(eqn, 0, start, limit)
    if eqn.primitive.name == "split":
        axis, sizes = eqn.params["axis"], [int(n) for n in eqn.params["sizes"]]
        begin = sum(sizes[:output])
        start = tuple(begin if d == axis else 0 for d in range(len(shape)))
        limit = tuple(begin + sizes[output] if d == axis else n for d, n in enumerate(shape))
        return Region(eqn, output, start, limit)
    return None


def region_key(use: Use) -> tuple | None:
    """Which region of its parameter a use reads: the chain up to the region, and its
    box; None for the whole parameter."""
    for k, step in enumerate(use.chain):
        if isinstance(step, Region):
            return chain_key(use.chain[:k]), step.start, step.limit
    return None


def disjoint(a: tuple, b: tuple) -> bool:
    """Whether two `region_key`s cut disjoint boxes of one view of the parameter."""
    if a[0] != b[0]:
        return False  # cut from different views: not compared
    return any(la <= sb or lb <= sa for sa, la, sb, lb in zip(a[1], a[2], b[1], b[2]))


def by_region(uses: list) -> list[list]:
    """The uses grouped by the region of the parameter they read."""
    groups: dict = {}
    for u in uses:
        groups.setdefault(region_key(u), []).append(u)
    return list(groups.values())


@dataclasses.dataclass
class Use:
    """One use of parameter `leaf`: `kind` "dot", "conv", "gather" for a site (`site`, the
    equation's path, not None), else the primitive's name."""

    leaf: int
    kind: str
    site: tuple | None
    signature: Any = None
    eqn: Any = None
    operand: int = 0
    chain: tuple = ()
    meets_example: bool = False
    under_checkpoint: bool = False
    through: str = ""  # the elementwise function or slice of the parameter it uses

    @property
    def label(self) -> str:
        """What the warning calls the use: `dot_general through slice`."""
        return f"{self.kind} through {self.through}" if self.through else self.kind

    @property
    def loops(self) -> tuple[Loop, ...]:
        return tuple(s for s in self.chain if isinstance(s, Loop))

    @property
    def slices(self) -> tuple[int, ...]:
        """The lengths of the scans that slice the parameter, outermost first."""
        return tuple(s.length for s in self.loops if s.sliced)


def chain_key(chain: tuple) -> tuple:
    """What of a chain fixes the layout of the view: its views and slicing scans."""
    return tuple(
        ("slice", s.length)
        if isinstance(s, Loop)
        else ("region", s.start, s.limit)
        if isinstance(s, Region)
        else ("gather", repr(sorted(s.eqn.params.items())))
        if isinstance(s, Gathered)
        else (s.primitive.name, repr(sorted(s.params.items())))
        for s in chain
        if not (isinstance(s, Loop) and not s.sliced)
    )


def classify(eqn: Any, index: int, chain: tuple, leaf_shape: tuple) -> tuple[str, Any]:
    """(kind, signature) of a use of a parameter view by one equation; signature None
    when the use has no ghost rule."""
    name = eqn.primitive.name
    view = eqn.invars[index].aval
    regions = [k for k, s in enumerate(chain) if isinstance(s, Region)]
    after = chain[regions[-1] :] if regions else chain
    slices = [s.length for s in after if isinstance(s, Loop) and s.sliced]
    size = chain[regions[-1]].size if regions else int(np.prod(leaf_shape))
    whole = size // int(np.prod(slices, dtype=int))
    if len(eqn.outvars) != 1 or int(np.prod(view.shape)) != whole:
        return name, None
    key = chain_key(chain)
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if lb or rb:
            return name, None
        pc = tuple(int(d) for d in (lc if index == 0 else rc))
        pf = tuple(d for d in range(len(view.shape)) if d not in pc)
        return "dot", ("dot", key, pc, pf, view.shape)
    if name == "conv_general_dilated" and index == 1:
        p = eqn.params
        if p["batch_group_count"] != 1:
            return name, None
        rhs_spec = tuple(p["dimension_numbers"].rhs_spec)
        return "conv", ("conv", key, rhs_spec, view.shape, p["feature_group_count"])
    if name == "gather" and index == 0 and len(view.shape) == 2:
        p = eqn.params
        dn = p["dimension_numbers"]
        ok = (
            tuple(p["slice_sizes"]) == (1, view.shape[1])
            and 0 in dn.start_index_map
            and not dn.operand_batching_dims
            and set(dn.collapsed_slice_dims) <= {0}
            and eqn.invars[1 - index].aval.ndim >= 1
            and eqn.invars[1 - index].aval.shape[-1] == len(dn.start_index_map)
        )
        if ok:
            return "gather", ("gather", key, view.shape)
    if name == "dynamic_slice" and index == 0 and len(view.shape) == 2:
        # `weight[i]` with a traced scalar `i`: one row, its start clamped into range.
        if tuple(eqn.params["slice_sizes"]) == (1, view.shape[1]):
            return "gather", ("gather", key, view.shape)
    return name, None


def leaf_axis_of_first_factor(use: Use) -> int | None:
    """For a matrix parameter (after its slicing scans): the parameter axis that the
    site's first factor runs over, or None if the chain is not a plain relabelling."""
    axes = [0, 1]
    for step in use.chain:
        if isinstance(step, Region | Gathered):
            return None
        if isinstance(step, Loop):
            if step.sliced and axes != [0, 1]:
                return None
            continue
        if step.primitive.name not in _AXIS_VIEWS:
            return None
        if step.primitive.name == "transpose":
            axes = [axes[d] for d in step.params["permutation"]]
    if use.eqn.invars[use.operand].aval.ndim != 2:
        return None
    if use.kind == "dot":
        pc = use.signature[2]
        return axes[pc[0]] if len(pc) == 1 else None
    if use.kind == "gather":
        return axes[0]
    return None


# --------------------------------------------------------------------------- factors


def _dot_rows(use: Use, other, g):
    """(a, g) of one dot_general site as (T, K), (T, N) in the parameter view's layout."""
    eqn, j = use.eqn, use.operand
    (lc, rc), _ = eqn.params["dimension_numbers"]
    xc = [int(d) for d in (rc if j == 0 else lc)]
    xf = [d for d in range(other.ndim) if d not in xc]
    a = jnp.transpose(other, xf + xc)
    t = int(np.prod([other.shape[d] for d in xf]))
    k = int(np.prod([other.shape[d] for d in xc]))
    n_pf = len(use.signature[3])
    if j == 0:  # output = (parameter free dims..., other free dims...)
        g = jnp.transpose(g, list(range(n_pf, g.ndim)) + list(range(n_pf)))
    return a.reshape(t, k), g.reshape(t, -1)


def _conv_rows(use: Use, lhs, g):
    """(patches, g) of one conv site as (G, T, C/G·k), (G, T, O/G) via im2col: a grouped
    convolution is `G` convolutions, group `g` of the input channels to group `g` of the
    output channels, each a slice of the kernel."""
    p = use.eqn.params
    dn = p["dimension_numbers"]
    rhs_shape = use.eqn.invars[1].aval.shape
    lhs = jnp.transpose(lhs, tuple(dn.lhs_spec))  # N, C, spatial...
    g = jnp.transpose(g, tuple(dn.out_spec))  # N, O, spatial...
    filter_shape = [rhs_shape[d] for d in dn.rhs_spec[2:]]
    patches = lax.conv_general_dilated_patches(
        lhs,
        filter_shape,
        p["window_strides"],
        p["padding"],
        lhs_dilation=p["lhs_dilation"],
        rhs_dilation=p["rhs_dilation"],
        precision=lax.Precision.HIGHEST,
    )
    groups = p["feature_group_count"]
    ck, o = patches.shape[1] // groups, g.shape[1] // groups
    # The patches' channels are (input channel, filter position), the input channel major.
    patches = jnp.moveaxis(patches, 1, -1).reshape(-1, groups, ck)
    g = jnp.moveaxis(g, 1, -1).reshape(-1, groups, o)
    return jnp.swapaxes(patches.astype(g.dtype), 0, 1), jnp.swapaxes(g, 0, 1)


def _gather_rows(use: Use, indices, g):
    """(row ids, g) of one embedding-row lookup as (T,), (T, D); g is zero where the
    lookup reads no row (out of range in fill mode)."""
    p = use.eqn.params
    vocab, width = use.eqn.invars[0].aval.shape
    if use.eqn.primitive.name == "dynamic_slice":
        rows = jnp.clip(jnp.reshape(indices, (1,)), 0, vocab - 1)
        return rows, g.reshape(1, width)
    dn = p["dimension_numbers"]
    offset = list(dn.offset_dims)
    batch = [d for d in range(g.ndim) if d not in offset]
    g = jnp.transpose(g, batch + offset).reshape(-1, width)
    idx = indices.reshape(-1, indices.shape[-1])
    rows = idx[:, list(dn.start_index_map).index(0)]
    if "CLIP" not in str(p["mode"]):
        valid = (rows >= 0) & (rows < vocab)
        if 1 in dn.start_index_map:
            valid = valid & (idx[:, list(dn.start_index_map).index(1)] == 0)
        g = jnp.where(valid[:, None], g, jnp.zeros((), g.dtype))
    return jnp.clip(rows, 0, vocab - 1), g


def factors(use: Use, record: tuple, g) -> tuple[Any, ...]:
    """The factors `(F0, F1)` of one site for one example, stacked: shapes `(S, P, d)`
    (or `(S, P)` for row ids), `S` the slices of the parameter (those of the scans that
    slice it, times a grouped convolution's groups; 1 if none), `P` the positions, with
    the iterations of scans that share it among them. A "gdot" site (`_gathered`) has
    three: the rows `(S, P)`, then `a` and `g`."""
    loops = use.loops

    def one(record, g):  # each with a leading axis of groups
        first, scale = record[0], record[-1]
        if use.kind == "gdot":  # (rows, a, g)
            rows, a, g = gathered_factors(use, first, g, record[-2])
            return rows[None], a[None], (g * scale.astype(g.dtype))[None]
        if use.kind == "dot":
            a, g = (x[None] for x in _dot_rows(use, first, g))
        elif use.kind == "conv":
            a, g = _conv_rows(use, first, g)
        else:
            a, g = (x[None] for x in _gather_rows(use, first, g))
        return a, g * scale.astype(g.dtype)

    fn = one
    for _ in loops:
        fn = jax.vmap(fn)
    fs = fn(record, g)
    f0 = fs[0]
    # Scan axes: the slicing ones and the groups first (S), the sharing ones joined to
    # the positions.
    n = len(loops)
    sliced = [k for k, s in enumerate(loops) if s.sliced] + [n]
    shared = [k for k, s in enumerate(loops) if not s.sliced]
    s = int(np.prod([f0.shape[k] for k in sliced], dtype=int))

    def arrange(f):
        f = jnp.transpose(f, sliced + shared + list(range(n + 1, f.ndim)))
        return f.reshape(s, -1, *f.shape[n + 2 :])

    return tuple(arrange(f) for f in fs)

"""Every Flax internal that jhooks uses, in one place (as `_core/_jax_compat/` for JAX).

Flax NNX's public API has no way to ask whether a module class is a pytree, to list
a node's children held in plain containers (`nnx.data([...])`), to store
an attribute that NNX keeps in the static graph structure whatever its value, or to
swap a parameter's value for one call without NNX's trace-level check. What jhooks
needs of those lives here, written against Flax 0.12, so that a Flax release that
changes one of them breaks this file with a clear message.

Importing this module imports Flax: only `jhooks._nnx`'s lazy paths do, after
`_framework.NNX.owns` has seen an NNX module (so Flax was imported already).
"""

from __future__ import annotations

from typing import Any

import flax
from flax import nnx
from flax.nnx import graphlib

_MESSAGE = (
    f"jhooks' Flax NNX support was written against flax 0.12 and this Flax "
    f"({flax.__version__}) changed {{what}}: install flax>=0.12.8,<0.13, or report it."
)


def is_pytree_class(cls: type) -> bool:
    """Whether instances of the NNX class `cls` are JAX pytrees (`pytree=True`, the default)."""
    try:
        return bool(cls._pytree__is_pytree)  # type: ignore[attr-defined]
    except AttributeError as e:  # pragma: no cover - depends on the installed Flax
        raise ImportError(_MESSAGE.format(what="Pytree._pytree__is_pytree")) from e


def set_static(module: nnx.Module, name: str, value: Any) -> None:
    """Sets attribute `name` of `module`, kept in NNX's static graph structure (the
    `GraphDef` of `nnx.split`, the pytree's aux data): every module that `nnx.merge`
    or an NNX transform makes from it holds the same object. Bypasses NNX's
    `__setattr__`, which refuses changes from inside a trace."""
    object.__setattr__(module, name, value)
    nodes = getattr(module, "_pytree__nodes", None)
    if nodes is None:  # pragma: no cover - depends on the installed Flax
        raise ImportError(_MESSAGE.format(what="Pytree._pytree__nodes"))
    if nodes.get(name, None) is not False:
        object.__setattr__(module, "_pytree__nodes", nodes.update({name: False}))


def children(node: Any) -> list[tuple[Any, Any]]:
    """The children of the NNX graph node `node` that are nodes themselves (modules,
    `nnx.List`s, and the plain lists, tuples and dicts of `nnx.data`), with their keys,
    as `nnx.iter_graph` walks them. `nnx.iter_children` leaves out the pytree
    containers (it yields graph nodes only), so the modules they hold."""
    try:
        impl = graphlib.get_node_impl(node)
        is_node = graphlib.is_node
    except AttributeError as e:  # pragma: no cover - depends on the installed Flax
        raise ImportError(_MESSAGE.format(what="graphlib.get_node_impl")) from e
    if impl is None:
        return []
    return [(key, child) for key, child in impl.node_dict(node).items() if is_node(child)]


def get_raw(variable: nnx.Variable) -> Any:
    """The value `variable` holds."""
    return variable.get_raw_value()


def set_raw(variable: nnx.Variable, value: Any) -> None:
    """Puts `value` in `variable` for the length of one call (restored after it), from any
    trace level: the swap never outlives the trace that made `value`."""
    if "_raw_value" not in nnx.Variable.__slots__:  # pragma: no cover - depends on Flax
        raise ImportError(_MESSAGE.format(what="Variable._raw_value"))
    object.__setattr__(variable, "_raw_value", value)

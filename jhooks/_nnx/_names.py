"""Dotted names of the modules and parameters of a Flax NNX model, from NNX's graph.

A path is NNX's (`nnx.iter_graph`): attribute names, and the indices of `nnx.List`
and keys of `nnx.Dict` (which are modules, as `torch.nn.ModuleList` is) or of the plain
lists, tuples and dicts of `nnx.data` (which are not), joined by dots:
`"layers.0.attn"`. A module or variable reached twice (shared) is listed once, under
its first path (or, with `remove_duplicate=False`, under each). Modules and parameters
come in pre-order, children in NNX's order (sorted by name, NNX's own order for
`nnx.split` and `nnx.state`), where PyTorch keeps the order of assignment.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flax import nnx

from ._flax_compat import children


def dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _order(path: tuple) -> tuple:
    # Pre-order: a parent's path is a prefix of its children's; ints before names.
    return tuple((isinstance(part, str), part) for part in path)


def _graph(model: Any) -> list[tuple[tuple, Any]]:
    return sorted(nnx.iter_graph(model), key=lambda item: _order(item[0]))


def named_modules(model: Any, remove_duplicate: bool = True) -> Iterator[tuple[str, nnx.Module]]:
    """Every NNX module in `model` (itself first) with its dotted path; with
    `remove_duplicate=False`, a shared module under each of its paths."""
    if remove_duplicate:
        for path, node in _graph(model):
            if isinstance(node, nnx.Module):
                yield dotted(path), node
        return

    def walk(path: tuple, node: Any, above: frozenset[int]) -> Iterator[tuple[str, Any]]:
        if isinstance(node, nnx.Module):
            yield dotted(path), node
        # Not `nnx.iter_children`, which skips the lists, tuples and dicts of
        # `nnx.data` and so the modules in them (issue 35).
        for key, child in sorted(children(node), key=lambda kv: _order((kv[0],))):
            if id(child) not in above:
                yield from walk((*path, key), child, above | {id(child)})

    yield from walk((), model, frozenset({id(model)}))


def parameter_variables(model: Any) -> list[tuple[str, nnx.Variable]]:
    """Every `nnx.Param` in `model` (what `nnx.grad` differentiates), with its path."""
    return [(dotted(path), v) for path, v in _graph(model) if isinstance(v, nnx.Param)]


def named_parameters(model: Any) -> Iterator[tuple[str, Any]]:
    """Every `nnx.Param`'s array in `model` (a model, or an `nnx.State` such as the
    gradients of `nnx.grad`) with its dotted path (`"linear1.kernel"`)."""
    for name, variable in parameter_variables(model):
        yield name, variable.get_value()

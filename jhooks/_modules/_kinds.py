"""The four kinds of module hooks, named once, and the registry that holds them by kind.

A kind is named as the keyword of `register_module_hooks` and the attribute of
`ModuleHooks`: `forward_pre`, `forward`, `full_backward_pre`, `full_backward` (PyTorch's
`register_<kind>_hook`). Every list of the kinds in jhooks is `KINDS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from .._core import Hooks

Kind = Literal["forward_pre", "forward", "full_backward_pre", "full_backward"]

KINDS: tuple[Kind, ...] = ("forward_pre", "forward", "full_backward_pre", "full_backward")


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardEntry:
    """A registered forward or forward pre-hook and its options."""

    fn: Callable[..., Any]
    with_kwargs: bool = False
    always_call: bool = False


class ModuleHooks:
    """Ordered registries of module hooks, one per kind (one per module, and one global)."""

    def __init__(self) -> None:
        self.forward_pre = Hooks()  # id -> ForwardEntry
        self.forward = Hooks()  # id -> ForwardEntry
        self.full_backward_pre = Hooks()  # id -> hook(module, grad_output)
        self.full_backward = Hooks()  # id -> hook(module, grad_input, grad_output)

    def of_kind(self, kind: Kind) -> Hooks:
        """The registry of one kind."""
        return getattr(self, kind)

    def active(self) -> bool:
        return any(self.of_kind(kind) for kind in KINDS)

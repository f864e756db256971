"""`register_module_hooks`: one hook on every module of a type, or whose path matches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from .._core import RemovableHandle, check_callable
from .._runs import Selector, did_you_mean
from ._kinds import KINDS, Kind
from ._names import named_modules
from ._register import REGISTER
from ._registry import registry_of
from ._types import AnyModule

Where: TypeAlias = type | tuple[type, ...] | str | Callable[[str, AnyModule], bool]


class HandleGroup(RemovableHandle):
    """The handle of several registrations: `remove()` removes them all.

    `handles` holds one [`jhooks.RemovableHandle`][] per registration and `names` the
    path of each module a hook was put on. Its `id` is its first registration's.
    """

    def __init__(self, handles: list[RemovableHandle], names: list[str]):
        self.id = handles[0].id
        self._refs = ()
        self.handles = handles
        self.names = names

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        super().remove()


def _matcher(where: Where) -> Callable[[str, Any], bool]:
    if isinstance(where, str):
        selector = Selector(where, "register_module_hooks' `where`")
        return lambda path, module: selector(path)
    if isinstance(where, type) or (
        isinstance(where, tuple) and where and all(isinstance(t, type) for t in where)
    ):
        return lambda path, module: isinstance(module, where)
    if callable(where):
        return lambda path, module: bool(where(path, module))
    raise TypeError(
        "register_module_hooks: `where` must be a module type (or a tuple of types), a "
        f"glob pattern on module paths such as 'blocks.*.attn', or a predicate "
        f"`fn(path, module) -> bool`; got {where!r}."
    )


def _no_match(where: Where, modules: list[tuple[str, Any]]) -> str:
    if isinstance(where, str):
        paths = [path for path, _ in modules if path]
        hint = did_you_mean(where, paths, "module paths")
        return f"register_module_hooks: no module path matches {where!r}. {hint}"
    if isinstance(where, (type, tuple)):
        types = sorted({type(m).__name__ for _, m in modules})
        return (
            f"register_module_hooks: no module is an instance of {where!r}. The model "
            f"holds: {', '.join(types)}."
        )
    return f"register_module_hooks: predicate {where!r} matched no module."


def register_module_hooks(
    model: AnyModule,
    where: Where,
    *,
    forward_pre: Callable | None = None,
    forward: Callable | None = None,
    full_backward_pre: Callable | None = None,
    full_backward: Callable | None = None,
    prepend: bool = False,
    with_kwargs: bool = False,
    always_call: bool = False,
) -> HandleGroup:
    """Registers the same hooks on every module of a type, or whose path matches.

    **Arguments:**

    - `model`: a hookable model (see [`jhooks.hookable`][]).
    - `where`: which modules: a type or a tuple of types (`eqx.nn.Linear`), a glob
        pattern on the dotted paths of [`jhooks.named_modules`][] (`"blocks.*.attn"`,
        `"*.mlp"`), or a predicate `where(path, module) -> bool`.
    - `forward_pre`, `forward`, `full_backward_pre`, `full_backward`: the hooks,
        with PyTorch's signatures (`hook(module, args, output)`, …), registered with
        `register_forward_pre_hook`, `register_forward_hook`,
        `register_full_backward_pre_hook` and `register_full_backward_hook`.
    - `prepend`, `with_kwargs`, `always_call`: passed on where those methods take them.

    **Returns:**

    One handle whose `remove()` removes every hook registered; its `names` lists the
    paths of the modules hooked. A `where` that matches no module raises a
    `ValueError` (for a pattern, listing the close matches).

    For hooks that should last one call only, the outputs of hookable modules are
    also named points for [`jhooks.run_with_hooks`][] and [`jhooks.run_with_cache`][],
    which take predicates on those paths.

    **Example:**

    ```python
    h = jhooks.register_module_hooks(net, eqx.nn.Linear, forward=lambda m, a, out: out * 2)
    h = jhooks.register_module_hooks(net, "blocks.*.mlp", full_backward=print_grads)
    h.remove()
    ```
    """
    hooks: dict[Kind, Callable | None] = dict(
        zip(KINDS, (forward_pre, forward, full_backward_pre, full_backward))
    )
    if all(h is None for h in hooks.values()):
        raise TypeError(
            "register_module_hooks needs at least one hook: forward_pre=, forward=, "
            "full_backward_pre= or full_backward=."
        )
    for kind, hook in hooks.items():
        if hook is not None:
            check_callable(hook, f"the {kind} hook of register_module_hooks")
    match = _matcher(where)
    modules = list(named_modules(model))  # Equinox's internal modules are not listed
    for _, module in modules:
        registry_of(module)  # raises unless the model is hookable
    chosen = [(path, module) for path, module in modules if match(path, module)]
    if not chosen:
        raise ValueError(_no_match(where, modules))
    options: dict[Kind, dict[str, bool]] = {
        "forward_pre": {"prepend": prepend, "with_kwargs": with_kwargs},
        "forward": {"prepend": prepend, "with_kwargs": with_kwargs, "always_call": always_call},
        "full_backward_pre": {"prepend": prepend},
        "full_backward": {"prepend": prepend},
    }
    handles = [
        REGISTER[kind](module, hook, **options[kind])
        for _, module in chosen
        for kind, hook in hooks.items()
        if hook is not None
    ]
    return HandleGroup(handles, [path for path, _ in chosen])

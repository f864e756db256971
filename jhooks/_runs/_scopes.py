"""Hook point names scoped by the hookable module whose call reaches them.

`jhooks.hook_point(z, "hook_z")` inside the call of the hookable module at path
`blocks.0.attn` is the point `blocks.0.attn.hook_z`, as TransformerLens names its
`HookPoint`s: one attention class used in two blocks gives two names. The module call
(`_modules/_call.py`) enters `point_scope(path)`; `scoped(name)` prefixes the innermost.
The same call enters `jax.named_scope("module:" + path)`, which names the module's
operations (`_staging/_addresses.py`). `users_vmap_base` is the trace of the user's
`jax.vmap` around a model's call (`_users_vmap.py`). `HookName` is a point's name as
hooks get it.

A library whose modules jhooks cannot wrap (Flax Linen, Haiku: `jhooks/_linen_haiku`)
names its module calls from an interceptor of its own that it registers here
(`register_interceptor`); `intercepting()` installs them for the length of a run's
call of its function (and of `jhooks.ops`'s trace), once however deep runs nest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

from .._core import ThreadStack
from .._staging import module_scope

_SCOPES: ThreadStack[tuple[str, tuple[str, ...]]] = ThreadStack(
    "hookable module calls (hook point scopes)"
)


@contextmanager
def point_scope(path: str, aliases: tuple[str, ...] = ()) -> Iterator[None]:
    """Hook points reached inside the block are named under `path` ("" for the root);
    `aliases` are the module's other paths (a module shared by several parents). The
    block is also `jax.named_scope("module:" + path)`: the operations made in it are addressed under
    `path` (`_staging/_addresses.py`)."""
    with _SCOPES.pushed((path, aliases)), module_scope(path):
        yield


# The trace of each user's `jax.vmap` around a hookable model's outermost call inside a
# run's function (`_users_vmap.py`), innermost last.
_USERS_VMAPS: ThreadStack[object] = ThreadStack("models called under the user's vmap")


def users_vmap() -> ThreadStack[object]:
    """The traces of the user's `jax.vmap`s around the model calls running."""
    return _USERS_VMAPS


def users_vmap_base() -> object | None:
    """The trace of the user's `jax.vmap` around the model call running, if any: hooks
    there see one example, as from that trace (`named_point`)."""
    return _USERS_VMAPS.top()


_INTERCEPTORS: list[Callable[[], AbstractContextManager[object]]] = []
_INTERCEPTING: ThreadStack[bool] = ThreadStack("module call interceptors installed")


def register_interceptor(install: Callable[[], AbstractContextManager[object]]) -> None:
    """Adds `install()`, a context manager inside which a module library's method calls
    are scopes (`point_scope`); entered by `intercepting`. Done once per library."""
    if install not in _INTERCEPTORS:
        _INTERCEPTORS.append(install)


@contextmanager
def intercepting() -> Iterator[None]:
    """Inside: every registered interceptor installed (once: a nested block adds none)."""
    if _INTERCEPTING or not _INTERCEPTORS:
        yield
        return
    with ExitStack() as stack, _INTERCEPTING.pushed(True):
        for install in _INTERCEPTORS:
            stack.enter_context(install())
        yield


def current_scope() -> str:
    """The path of the innermost hookable module being called, "" outside any."""
    top = _SCOPES.top()
    return "" if top is None else top[0]


def scope_aliases(name: str) -> tuple[str, ...]:
    """`name` (scoped) under each other path of the innermost module being called."""
    top = _SCOPES.top()
    if top is None or not top[0] or not name.startswith(top[0] + "."):
        return ()
    path, aliases = top
    return tuple(alias + name[len(path) :] for alias in aliases)


def in_module_call() -> bool:
    """Whether a hookable module's call (the root's too) is running."""
    return bool(_SCOPES)


def scoped(name: str) -> str:
    """`name` under the innermost module's path. A name that already starts with that
    path (a model that spells its points' full names out) is kept as it is."""
    prefix = current_scope()
    if not prefix or name == prefix or name.startswith(prefix + "."):
        return name
    return f"{prefix}.{name}"


class HookName(str):
    """A point's name as passed to hooks: a `str`, with TransformerLens' `hook.name`.

    TransformerLens calls hooks as `hook(value, hook=hook_point)` and hooks read
    `hook.name`; jhooks passes the name. This `str` subclass serves both habits.

    **Example:**

    ```python
    def ablate(z, hook):
        print(hook.name, hook.layer())  # "blocks.3.attn.hook_z" 3
        return jnp.zeros_like(z)

    jhooks.run_with_hooks(model, x, fwd_hooks=[("blocks.3.attn.hook_z", ablate)])
    ```
    """

    __slots__ = ()

    @property
    def name(self) -> str:
        """The point's name as a plain `str` (TransformerLens' `hook.name`).

        **Example:** `hook.name == "blocks.3.attn.hook_z"`.
        """
        return str(self)

    def layer(self) -> int:
        """The layer index in the name (`"blocks.3.attn.hook_z"` -> 3), as in TransformerLens.

        **Example:** `hook.layer() == 3` for the point `"blocks.3.attn.hook_z"`.
        """
        for part in self.split("."):
            if part.isdigit():
                return int(part)
        raise ValueError(f"hook point {str(self)!r} has no layer index in its name.")

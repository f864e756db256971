"""What a run's hooks kept: PyTorch's `acts.append(out)`, given the concrete value.

A hook runs on abstract values of its point (`_hookpass.py`), so what it keeps in a
list, a dict or an attribute is a tracer of its own trace. Where that tracer is a value
of the hook's computation, the trace makes it an extra output (`Traced.kept`, with the
places that hold it), the program returns it, and `deliver` puts the concrete value in
its place: the user's list holds the activation, as in PyTorch. A value kept where the
program cannot return it (inside a loop or a `lax.cond` branch, or under a
transformation around the run) is named in a warning, on every call that keeps one
(by what the hook's own code reaches: no search of the heap), and taken out of the
place it was kept in, where that place is known: the container holds a concrete value
or nothing.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import Any

from .._core import differentiated_primal, hook_name, reached_by, take_out, user_stacklevel
from ._hookpass import Owner


def deliver(owner: Owner, kept_from: list, values: list) -> None:
    """Puts the concrete values the program computed where the hooks kept their traced
    values (`acts.append(out)` gets the activation, as in PyTorch), and warns of every
    traced value a hook kept that the program could not give back (kept in a loop, or
    under a transformation around the run)."""
    if not kept_from and not any(c.traced.leaked or c.traced.kept for c in owner.calls):
        return
    for (position, k), value in zip(kept_from, values):
        # Under the user's `jax.grad` around the run, the forward's value (the backward
        # hooks that read it run later, in the backward pass, on values).
        value = differentiated_primal(value)
        if value is None:
            continue
        for container, key, tracer in owner.calls[position].traced.kept[k]:
            if not _holds(container, key, tracer):
                continue  # moved or removed since: the place no longer holds it
            if isinstance(container, (list, dict)):
                container[key] = value
            else:
                setattr(container, key, value)
    for call in owner.calls:
        places = [(c, k, t) for kept in call.traced.kept for c, k, t in kept if _holds(c, k, t)]
        left = list(call.traced.leaked) + [t for _, _, t in places]
        call.traced.leaked, call.traced.kept = [], [[] for _ in call.traced.kept]
        if left:
            _warn_leak(owner.hooks[call.index], call.name, left, bool(places))
        # Where the place is known, the tracer is taken out again: concrete or absent.
        for container, key, tracer in places:
            take_out(container, key, tracer)


def _holds(container: Any, key: Any, tracer: Any) -> bool:
    if isinstance(container, list):
        return key < len(container) and container[key] is tracer
    if isinstance(container, dict):
        return container.get(key) is tracer
    return getattr(container, key, None) is tracer


def _warn_leak(hook: Callable, name: str, tracers: list, taken: bool) -> None:
    warnings.warn(
        f"jhooks: hook {hook_name(hook)} at point {name!r} kept a traced value in "
        f"{_holders(hook, tracers)} (a leaked tracer, as under jax.jit): a run calls hooks "
        "on abstract values of their point, and what a hook keeps fails wherever it is "
        f"used{'; jhooks took it out of there again' if taken else ''}. Keep values with "
        "jhooks.run_with_cache, jhooks.emit or jhooks.host (a hook run on the host with "
        "NumPy values on every call).",
        stacklevel=user_stacklevel(),
    )


def _holders(hook: Callable, tracers: list) -> str:
    """Where the kept tracers are, named as the user would (`Keeper.kept`, a global), among
    what the hook's own code reaches (a few reads: never a search of the heap)."""
    found = [
        label if held is tracer else f"{label} (a {type(held).__name__})"
        for tracer in tracers[:3]
        for label, held in reached_by(hook)
        if held is tracer or _inside(held, tracer)
    ]
    return ", ".join(dict.fromkeys(found)) or "an object"


def _inside(held: Any, tracer: Any) -> bool:
    if isinstance(held, dict):
        return any(v is tracer for v in held.values())
    if isinstance(held, (list, tuple, set, frozenset, collections.deque)):
        return any(v is tracer for v in held)
    return False

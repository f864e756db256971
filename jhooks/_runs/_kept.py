"""What a run's hooks kept: PyTorch's `acts.append(out)`, given the concrete value.

A hook runs on abstract values of its point (`_hookpass.py`), so what it keeps in a
list, a dict, an attribute or a closure variable (or in a tuple there) is a tracer of
its own trace. Where that tracer is a value
of the hook's computation, the trace makes it an extra output (`Traced.kept`, with the
places that hold it), the program returns it, and `deliver` puts the concrete value in
its place: the user's list holds the activation, as in PyTorch. A value kept where the
program cannot return it (inside a loop or a `lax.cond` branch, or under a
transformation around the run) is named in a warning, on every call that keeps one
(by what the hook's own code reaches: no search of the heap), and taken out of the
place it was kept in, where that place is known: the container holds a concrete value
or nothing (`_core/_entries.py`). A run that raised has no values: all are taken out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .._core import (
    GONE,
    differentiated_primal,
    entries,
    holds,
    hook_name,
    how_of,
    inside,
    is_tracer,
    made_again,
    put,
    reached_by,
    take_out,
    user_stacklevel,
)
from ._hookpass import Owner


def deliver(owner: Owner, kept_from: list, values: list) -> None:
    """Puts the concrete values the program computed where the hooks kept their traced
    values (`acts.append(out)` gets the activation, as in PyTorch), and warns of every
    traced value a hook kept that the program could not give back (kept in a loop, or
    under a transformation around the run), taking it out of the place it was kept in
    (`_core/_entries.py`: a tuple there made again, or the entry taken out). With no
    values (the run failed), every one kept is taken out."""
    calls = [c for c in owner.calls if c.traced is not None]
    if not kept_from and not any(c.traced.leaked or c.traced.kept for c in calls):
        return
    given: dict[int, Any] = {}  # a kept tracer's id -> its concrete value
    for (position, k), value in zip(kept_from, values):
        # Under the user's `jax.grad` around the run, the forward's value (the backward
        # hooks that read it run later, in the backward pass, on values).
        value = differentiated_primal(value)
        if value is not None:
            given.update((id(t), value) for _, _, _, t in owner.calls[position].traced.kept[k])
    done: set[tuple[int, Any]] = set()
    for call in calls:
        places = [p for kept in call.traced.kept for p in kept if holds(*p[:3])]
        left, out = list(call.traced.leaked), []
        where = _holders(owner.hooks[call.index], left + [p[3] for p in places])
        call.traced.leaked, call.traced.kept = [], [[] for _ in call.traced.kept]
        for container, key, held, tracer in places:
            if (id(container), key) in done:
                continue
            done.add((id(container), key))
            again = made_again(held, is_tracer, lambda t: given.get(id(t)))
            if again is GONE:  # the place is known: taken out again, concrete or absent
                out.append(take_out(container, key, held))
                left.append(tracer)
            else:
                put(how_of(container), container, key, again)
        if left:
            taken = bool(out) and all(out) and len(out) == len(left)  # every one of them
            _warn_leak(owner.hooks[call.index], call.name, where, taken)


def _warn_leak(hook: Callable, name: str, where: str, taken: bool) -> None:
    warnings.warn(
        f"jhooks: hook {hook_name(hook)} at point {name!r} kept a traced value in "
        f"{where} (a leaked tracer, as under jax.jit): a run calls hooks "
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
    """Whether `held` holds `tracer`: in an entry, or inside a tuple (one level of
    holders down: `box.t = (z,)` is in `box`)."""

    def found(v: Any) -> bool:
        return v is tracer

    if inside(held, found):
        return True
    return any(inside(v, found) for _, _, v in entries(held) or ())

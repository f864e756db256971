"""The errors of a run whose program failed to trace: what was traced, and why."""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

from .._core import Walk, is_tracer

if TYPE_CHECKING:
    from ._program import Spec


def mentions_tracer(err: Exception) -> bool:
    """An error from Python code given a tracer: a key or index made from one, a slice."""
    text = str(err)
    return any(word in text for word in ("Traced<", "Tracer", "must be static"))


def state_error(spec: Spec, walk: Walk, traced: list[int], err: Exception) -> Exception:
    """Flax refused a change of an NNX module's state made inside the program."""
    places = sorted({walk.where[i] for i in traced if not walk.where[i].startswith("args")})
    return TypeError(
        f"{spec.caller}: a Flax NNX module that the run reads ({'; '.join(places[:4])}) "
        "changed its state (a Dropout's random count, a BatchNorm's statistics) inside the "
        "compiled program, which Flax allows only for a module passed in as an argument. "
        f"Pass it: `jhooks.{spec.caller}(model, x)` or "
        f"`jhooks.{spec.caller}(lambda model, x: model(x), model, x)`. "
        f"Flax said: {str(err).splitlines()[0]}"
    )


def traced_error(spec: Spec, err: Exception) -> Exception:
    err.add_note(
        f"jhooks.{spec.caller} compiles `fn` (once per structure, eager calls too), "
        "so `fn` must be traceable by jax.jit."
    )
    return err


_warned: set[str] = set()


def warn_leaks(spec: Spec, walk: Walk, before: Walk) -> None:
    """Warns of each traced value that a trace left in the user's objects (PyTorch's
    `acts.append(out)` in a hook): a leaked tracer, which fails wherever it is used. A
    tracer there before the trace is a transformation's around the run (`jax.grad`)."""
    there = {id(x) for x in before.sites if is_tracer(x)}
    places = [
        w
        for x, w in zip(walk.sites, walk.where)
        if is_tracer(x) and id(x) not in there and w not in _warned
    ]
    if places:
        _warned.update(places)
        warnings.warn(
            f"jhooks.{spec.caller}: the trace left a traced value in {', '.join(places[:3])}"
            f"{' and elsewhere' if len(places) > 3 else ''}: it exists only while the program "
            "is traced (a leaked tracer, as under jax.jit), and fails wherever it is used. "
            "Keep values with jhooks.run_with_cache, jhooks.emit or jhooks.host.",
            stacklevel=_outside_jhooks(),
        )


def _outside_jhooks() -> int:
    """The `stacklevel` of the first caller that is not jhooks (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("jhooks"):
        frame, level = frame.f_back, level + 1
    return level

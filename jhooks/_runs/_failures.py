"""The errors of a run whose program failed to trace: what was traced, and why."""

from __future__ import annotations

import re
import types
import warnings
from typing import TYPE_CHECKING, Any

from .._core import (
    GONE,
    Bounded,
    Walk,
    attribute,
    closure_cells,
    concrete_value,
    drop_items,
    held_in,
    hook_name,
    how_of,
    inside,
    is_sequence,
    is_tracer,
    made_again,
    of_ended_program,
    put,
    reached_by,
    registered_hooks,
    remove,
    take_out,
    text,
    user_stacklevel,
)

if TYPE_CHECKING:
    from ._program import Spec


def mentions_tracer(err: Exception) -> bool:
    """An error from Python code given a tracer: a key or index made from one, a slice."""
    text = str(err)
    return any(word in text for word in ("Traced<", "Tracer", "must be static"))


def state_error(spec: Spec, walk: Walk, err: Exception) -> Exception:
    """Flax refused a change of an NNX module's state made inside the program: a module
    the run reads outside its arguments, whose arrays are constants of the trace."""
    places = sorted({_named(text(w)) for w in walk.constants})
    return TypeError(
        f"{spec.caller}: a Flax NNX module that the run reads ({'; '.join(places[:4])}) "
        "changed its state (a Dropout's random count, a BatchNorm's statistics) inside the "
        "compiled program, which Flax allows only for a module passed in as an argument. "
        f"Pass it: `jhooks.{spec.caller}(model, x)` or "
        f"`jhooks.{spec.caller}(lambda model, x: model(x), model, x)`. "
        f"Flax said: {str(err).splitlines()[0]}"
    )


# Per run and function code: the arrays it read as constants at its traces, by place
# (weakly: an id is reused once its array is gone), and how many of its traces met a new
# array at a place.
_rebound: Bounded[Any, tuple[dict[str, list], int]] = Bounded(256)


def warn_rebound(spec: Spec, fn: Any, walk: Walk) -> None:
    """Tells, once per function, when a run traced its function a second time because a
    JAX array it reads from outside its arguments is a new array (a model rebound at each
    step, closed over): keyed by identity, never stale, it is traced and compiled again
    on every such call; passed as an argument, it is an input."""
    if not walk.constants:
        return
    key = (spec.caller, *_function_key(fn))
    seen, times = _rebound.pop(key, ({}, 0))
    rebound = set()
    for place, ref in zip(map(text, walk.constants), walk.constant_refs):
        array = ref()
        if array is None:
            continue
        refs = seen.setdefault(place, [])
        if refs and not any(r() is array for r in refs):
            rebound.add(_named(place))
        if len(refs) < 64:
            refs.append(ref)
    times += bool(rebound)
    _rebound[key] = (seen, times)
    if times != 2:
        return
    places = "; ".join(sorted(rebound)[:4])
    name = getattr(fn, "__qualname__", type(fn).__name__)
    warnings.warn(
        f"jhooks.{spec.caller}: {name} was traced and compiled again because a JAX "
        "array (or an object whose class compares by identity) it reads from outside its "
        f"arguments is a new one ({places}): a run keys such values by identity, so that it "
        "is never stale, and a model rebound at each step is compiled again at each step. "
        "Pass it as an argument, where its arrays are inputs of one program: "
        f"`jhooks.{spec.caller}(lambda model, x: model(x), model, x)`; an object made "
        "afresh each call: make it once, or give its class an `__eq__` and `__hash__` "
        "(a frozen dataclass), so that equal ones share a program.",
        stacklevel=user_stacklevel(),
    )


def _function_key(fn: Any) -> tuple:
    """A function as `warn_rebound` counts its traces: its code and the cells it closes
    over (a lambda made again over the same variables is the same function; made over
    another model's, another), a method's with its `self`, any other callable itself."""
    if isinstance(fn, types.MethodType):
        return (*_function_key(fn.__func__), id(fn.__self__))
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("object", id(fn))
    return (code, *map(id, getattr(fn, "__closure__", None) or ()))


def _named(place: str) -> str:
    """A place up to the variable it starts from (`f: closure variable `model``)."""
    found = re.match(r"[^`]*`[^`]*`", place)
    return found.group(0) if found else place


def traced_error(spec: Spec, err: Exception) -> Exception:
    err.add_note(
        f"jhooks.{spec.caller} compiles `fn` (once per structure, eager calls too), "
        "so `fn` must be traceable by jax.jit."
    )
    return err


_warned: set[str] = set()


def take_back_tracers(walk: Walk, before: Walk, written: dict) -> dict[tuple[int, Any], str | None]:
    """Where the trace left a traced value in the user's objects, puts what eager code
    leaves there, or nothing: a traced value exists only while the program is traced.

    One the program computed from constants alone (`jnp.float32(3.0)`, the same on every
    call) becomes its concrete value. Any other is taken out: in an entry the trace
    wrote (the model's `memo["k"] = x * 2`), what the entry held before the trace is put
    back, or the entry it made removed; anywhere in an object the trace made (a
    singleton made lazily) or made reachable, and in a list, it is removed; in an object
    an earlier trace wrote (`written`), removed. Every holder the walk read is looked
    into (`_core/_entries.py`: lists, deques, dicts, objects, classes, closure cells),
    and a traced value in a tuple there is the tuple's (made again, or taken out). The
    places: `(id, name)` to a description, `None` where a concrete value was put."""
    taken: dict[tuple[int, Any], str | None] = {}
    for i, (obj, held) in walk.held.items():
        old = before.held.get(i)
        new = old is None or old[0] is not obj or is_sequence(obj)
        was = {} if new or old is None else old[1]
        traced = of_ended_program if new else is_tracer
        left = []  # a list's traced values that have no concrete value
        for name, (how, value) in list(held.items()):
            if name in was and was[name][1] is value or not inside(value, traced):
                continue
            again = made_again(value, traced, concrete_value)
            if again is not GONE:
                put(how, obj, name, again)
                taken[(i, name)] = None
                continue
            if is_sequence(obj):
                left.append(value)
                continue
            if name in was:
                put(how, obj, name, was[name][1])
            else:
                remove(how, obj, name)
            taken[(i, name)] = _entry(obj, name)
        if left:
            drop_items(obj, left)
            taken[(i, "*")] = _list_left(obj)
    for i, (obj, names) in list(written.items()):  # no longer reached: taken out
        if is_sequence(obj):
            left = [v for v in obj if inside(v, is_tracer)]
            if left:
                drop_items(obj, left)
                taken[(i, "*")] = _list_left(obj)
            continue
        for name in names:
            held = obj.get(name) if isinstance(obj, dict) else attribute(obj, name)
            if inside(held, is_tracer) and take_out(obj, name, held):
                taken[(i, name)] = _entry(obj, name)
    return taken


_told_hooks: set[str] = set()


def take_back_from_registered_hooks(spec: Spec) -> None:
    """What a registered hook kept of the run's program (`acts.append(output)` in a
    module's forward hook, traced with the model inside a run): its concrete value where
    the program computed it from constants alone, else taken out of what the hook's code
    reaches, with a warning naming the hook and the way to keep values in a run."""
    for hook in registered_hooks():
        reach = [held for _, held in reached_by(hook)] + closure_cells(hook)
        places = [p for p in held_in(reach) if inside(p[2], of_ended_program)]
        for holder, key, value in places:
            again = made_again(value, of_ended_program, concrete_value)
            if again is not GONE:
                put(how_of(holder), holder, key, again)
            elif take_out(holder, key, value) and hook_name(hook) not in _told_hooks:
                _told_hooks.add(hook_name(hook))
                warnings.warn(
                    f"jhooks.{spec.caller}: registered hook {hook_name(hook)} kept a traced "
                    "value: inside a run, the hooks registered on the model's modules are "
                    "traced with the model, so what they keep has no value; jhooks took it "
                    "out again. In a run, keep values with a run hook "
                    "(fwd_hooks=[(module_path, hook)], which runs on values) or "
                    "run_with_cache; or call the model outside a run, where its module "
                    "hooks run on values.",
                    stacklevel=user_stacklevel(),
                )


def _list_left(obj: Any) -> str:
    return f"a {type(obj).__name__} ({len(obj)} item{'s' * (len(obj) != 1)} left)"


def _entry(obj: Any, name: Any) -> str:
    if isinstance(obj, dict):
        return f"the entry {name!r} of a dict"
    if isinstance(obj, type):
        return f"the attribute {name!r} of the class {obj.__qualname__}"
    if isinstance(obj, types.CellType):
        return f"the closure variable `{name}`"
    return f"the attribute {name!r} of a {type(obj).__name__}"


def warn_leaks(spec: Spec, walk: Walk, before: Walk, taken: dict[Any, str | None]) -> None:
    """Warns of each traced value that a trace left in the user's objects (PyTorch's
    `acts.append(out)` in a hook): a leaked tracer, which fails wherever it is used, or
    one taken out again (`taken`). A tracer there before the trace is a
    transformation's around the run (`jax.grad`)."""
    there = {id(x) for x in before.sites if is_tracer(x)}
    new = [
        (w, walk.owner.get(p) in taken)
        for p, (x, w) in enumerate(zip(walk.sites, walk.where))
        if is_tracer(x)
        and id(x) not in there
        and w not in _warned
        and taken.get(walk.owner.get(p), "") is not None  # its concrete value put there
    ]
    sites = {walk.owner.get(p) for p in range(len(walk.sites))}
    new += [(w, True) for at, w in taken.items() if at not in sites and w and w not in _warned]
    for was_taken in (False, True):
        places = [w for w, t in new if t is was_taken]
        if not places:
            continue
        _warned.update(places)
        what = (
            "jhooks put back what was there (or removed the entry): a traced value"
            if was_taken
            else "it"
        )
        warnings.warn(
            f"jhooks.{spec.caller}: the trace {'wrote' if was_taken else 'left'} a traced "
            f"value in {', '.join(places[:3])}{' and elsewhere' if len(places) > 3 else ''}"
            f": {what} exists only while the program is traced (a leaked tracer, as under "
            "jax.jit), and fails wherever it is used. The function's own writes happen "
            "once per trace; return the value instead, or keep it with "
            "jhooks.run_with_cache, jhooks.emit or jhooks.host.",
            stacklevel=user_stacklevel(),
        )

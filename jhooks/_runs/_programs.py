"""One compiled program per run structure: the model's, chosen by guards on what it
reads, and the hooks', by what they computed this call.

`compiled(spec, fn, args, kwargs)` walks the function and its arguments with
`_closures.Walk` into a *key* of what they read, by content, and *sites*: the arrays
and Python numbers found, which are the program's arguments. The hooks are not
walked: they run their Python on every call (`_hookpass.py`), each traced on its own
where the run's *layout* (the points the model's trace reached) says it is called,
and the structure of what they computed is the rest of the key, their constants more
arguments. A model structure seen for the first time is traced once abstractly to
find its layout (the hooks run there, traced where their points are), then the
program is traced with the hook calls evaluated at their points.

The model's rule, `jax.jit`'s: the arrays and numbers of the arguments' pytree are
traced arguments; everything else the function reads is the user's own object, never
copied, and in the key (JAX arrays by identity, as constants of the trace; the rest by
content; library code by identity), checked on every call, or, where no guard can
watch it (a random generator), the run is uncached, with one warning.

A program dies with its key: when an object the key holds by identity is collected,
and beyond `MAX_PROGRAMS`, least recently used first.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from .._core import (
    NAMES_KEYED,
    Bounded,
    Walk,
    is_batched,
    is_differentiated,
    left_key,
    refreshed_hook_keys,
    under_staging,
    unwrap_jit,
)
from . import _fast
from ._failures import (
    mentions_tracer,
    state_error,
    take_back_from_registered_hooks,
    take_back_tracers,
    traced_error,
    warn_leaks,
    warn_rebound,
)
from ._hookpass import Layout, LayoutChanged, Owner, hook_pass
from ._host_calls import CONCRETE, failure, ran, warn_once_per_compilation
from ._kept import deliver
from ._nested import Nested, nested_failure
from ._places import Key, Places, numbers_of
from ._program import (
    LIVE,
    MAX_PROGRAMS,
    NUMBERS,
    Call,
    Program,
    Spec,
    selector_key,
    shape_key,
    unbox,
    walk_roots,
    written,
)
from ._run import selects
from ._waits import wait_for

_places = Places(MAX_PROGRAMS * 16)
_programs: Bounded[Hashable, Program] = Bounded(MAX_PROGRAMS)
_warned: set[str] = set()


def _remember(cache: Bounded, key: Hashable, value: Any, refs: list) -> None:
    """Caches `value` until an object `key` holds by identity dies, or it is too old."""
    cache[key] = value
    drop = functools.partial(_fast.forget, cache, key)
    held = [o for o in (r() for r in refs if r.weak) if o is not None]
    value.watch = [weakref.ref(o, drop) for o in held]
    value.hold_weakly(held)


def compiled(spec: Spec, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Runs `spec.body(fn, args, kwargs, fwd, bwd)` in the program of this structure."""
    if LIVE or under_staging():
        # Inside another run's program: traced inline, in its trace (a nested program
        # would hide this run's points from the outer cache). Inside a function the user
        # stages out (`jax.jit`, `lax.scan`...), whose cache is the user's: traced inline
        # too, so the run is what any Python code is there, traced once per trace of
        # that function, its side effects made on the user's objects.
        # Inside another run's program that gives values, the hooks that must run on
        # values are host calls (`_nested.py`).
        outer = LIVE.top()
        nested = Nested(outer) if outer is not None and outer.values else None
        if not LIVE:
            warn_once_per_compilation(spec)
        return spec.run(fn, args, kwargs, None, nested)
    # Its key shows which modules it reads: names are keyed (`_core/_handles.py`).
    with NAMES_KEYED.pushed(spec):
        return _keyed(spec, fn, args, kwargs)


# Each model structure's layout: the points its trace reached, the hooks called there.
_layouts: Bounded[Hashable, Layout] = Bounded(MAX_PROGRAMS)


def _keyed(spec: Spec, fn: Callable, args: tuple, kwargs: dict) -> Any:
    roots = [unwrap_jit(fn), args, kwargs]
    hooks = [h for _, h in spec.fwd] + [h for _, h in spec.bwd]
    selectors = tuple(selector_key(sel) for sel, _ in (*spec.fwd, *spec.bwd))
    # The registered hooks as they read now: a change is a program of its own.
    spec.registered = refreshed_hook_keys()
    fast_key = _fast.entry_key((spec.caller, spec.options, spec.registered, selectors), roots)
    for attempt in range(3):
        fast = _fast.lookup(fast_key, roots, _places.generation, 3) if attempt == 0 else None
        walk: Walk | None = None
        plans: list | None = None
        if fast is not None:  # nothing the last walk read has changed
            (numbers, key, dynamic, traced, _), sites = fast
        else:
            walk, structure, plans = walk_roots(spec, roots, selectors=selectors)
            numbers = numbers_of(walk)
            key, dynamic = _places.key(structure, numbers, walk.sites)
            key = Key(key)
            traced = sorted(
                [i for i, x in enumerate(walk.sites) if type(x) not in NUMBERS] + dynamic
            )
            sites = walk.sites
            if walk.opaque:
                _warn_uncached(spec, walk)
        call = Call(spec, roots, walk, plans, traced, sites)
        leaves = [sites[i] for i in traced]
        # Tracers of a transformation around the run that the function closes over
        # (constants of its trace) make it differentiated or batched as leaves do.
        outer = leaves + (walk.tracers if walk is not None else [])
        call.values = not any(is_batched(x) for x in outer)
        pkey: Hashable = key
        LIVE.push(call)
        passing = False  # in the hook pass: a hook's own error, raised as it is
        try:
            program = None
            before = 0
            if hooks:
                passing = True
                program, owner = _hook_calls(call, key, hooks, leaves, outer)
                passing = False
                pkey = Key((key, owner.key()))
            if program is not None:  # traced now, with the hooks where they are called
                _remember(_programs, pkey, program, walk.refs if walk is not None else [])
            else:
                program = _programs.get(pkey)
                if walk is not None and walk.opaque:
                    program = Program()  # for this call only
                elif program is None:
                    program = Program()
                    _remember(_programs, pkey, program, walk.refs if walk is not None else [])
                else:
                    _programs.move_to_end(pkey)
                before = program.traces
            waits = call.values and _backward_on_values(call, program)
            out, kept = program.jitted(*leaves, *program.arguments(call.owner), waits=waits)
            on_values = call.owner.host_entries() if call.owner is not None else []
            if on_values:
                wait_for(out)  # the hooks on values have run when it returns (`_waits.py`)
                if call.owner is not None and not call.owner.differentiated:
                    # Differentiated, a `jax.checkpoint` in the model computes its forward
                    # again in the backward pass, and calls its hooks again, as PyTorch's
                    # checkpoint does: their entries stay (the latest 4,096 are kept).
                    ran(on_values)
            out = unbox(out) if program.boxed else out
            if call.owner is not None:
                deliver(call.owner, program.kept_from, kept)
        except LayoutChanged:
            # The model's trace reached other points than its layout said: found again.
            _take_back_failed(spec, roots, call)
            _layouts.clear()
            _programs.pop(pkey, None)
            continue
        except BaseException as err:
            _take_back_failed(spec, roots, call)
            entries = call.owner.host_entries() if call.owner is not None else []
            failed = failure(entries) or nested_failure()
            if failed is not None:
                raise failed.with_traceback(failed.__traceback__) from failed.__cause__
            if not isinstance(err, Exception):
                raise
            if passing and call.owner is not None and call.owner.mode == "replay":
                raise
            if attempt == 0 and dynamic:
                # A number needed concretely (a string, a loop bound, a shape), or made
                # the trace fail otherwise: back into the key, for good.
                _places.pin({numbers[i][0] for i in dynamic})
                _programs.pop(pkey, None)
                continue
            walk = walk or call.walk or walk_roots(spec, roots, selectors=selectors)[0]
            if type(err).__name__ == "TraceContextError":  # Flax NNX: no flax import
                raise state_error(spec, walk, err) from err
            if not (isinstance(err, CONCRETE) or mentions_tracer(err)):
                raise
            raise traced_error(spec, err) from err
        finally:
            LIVE.pop()
        traced_now = program.traces != before and call.before is not None
        if traced_now and call.walk is not None:
            warn_rebound(spec, roots[0], call.walk)
        if traced_now and call.walk is not None and not call.walk.opaque:
            _after_trace(spec, roots, call, key, pkey, program)
        elif walk is not None and plans is not None and not (walk.opaque or walk.unguarded):
            found = (numbers, key, dynamic, traced, None)
            _fast.remember(fast_key, roots, walk, plans[1], _places.generation, found, dynamic)
        return out
    raise AssertionError("unreachable")  # pragma: no cover


def _hook_calls(
    call: Call, key: Hashable, hooks: list, leaves: list, outer: list
) -> tuple[Program | None, Owner]:
    """The hooks' calls this call (`call.owner`): by the layout of the model's
    structure, or, for a structure seen for the first time, recorded as the program is
    traced (the program is returned then: the hooks ran in its trace)."""
    differentiated = any(is_differentiated(x) for x in outer)
    values = call.values  # under the user's vmap: traced
    # The points' values have the shapes of this call's arguments: a layout per shape.
    key = call.layout_key = (key, tuple(shape_key(x) for x in leaves))
    layout = _layouts.get(key)
    given = None
    if layout is not None and layout.chosen:
        now = _chosen_now(layout, call.spec)
        if now != layout.chosen:
            # A predicate chose other points: the layout of that choice, or recorded.
            points, layout = layout.points, _layouts.get(_by_choice(key, now))
            given = (points, now) if layout is None else None
    if layout is not None:
        _layouts.move_to_end(key)
        call.owner = owner = Owner(hooks, "replay", differentiated=differentiated)
        owner.values = values
        hook_pass(owner, layout, differentiated)
        return None, owner
    call.owner = owner = Owner(hooks, "record", differentiated=differentiated)
    owner.given = given
    owner.values = values
    program = Program()
    program.record(call, leaves)
    _layouts[key] = layout = owner.layout()
    if layout.chosen:
        _layouts[_by_choice(key, layout.chosen)] = layout
    owner.mode = "replay"
    return program, owner


def _backward_on_values(call: Call, program: Program) -> bool:
    """Whether the program's backward pass may run hooks on values: the backward pass
    then waits for it (`_waits.py`)."""
    owner = call.owner
    if owner is not None and any(c.backward and c.host is not None for c in owner.calls):
        return True
    return program.backward_on_values  # a nested run's backward hook, met by a trace


def _by_choice(key: Hashable, chosen: dict[int, frozenset[str]]) -> Hashable:
    """Where the layout of what the predicate hooks chose (`chosen`) is kept."""
    return (key, tuple(sorted(chosen.items())))


def _chosen_now(layout: Layout, spec: Spec) -> dict[int, frozenset[str]]:
    """What the predicate hooks choose of the layout's points, asked again now (once
    per point, as TransformerLens asks them on every call), by the hook's index."""
    selectors = [sel for sel, _ in (*spec.fwd, *spec.bwd)]
    return {
        index: frozenset(str(p) for p in layout.points if selects(selectors[index], p))
        for index in layout.chosen
    }


def _take_back_failed(spec: Spec, roots: list, call: Call) -> None:
    """A call that failed after its trace began (the model raised after `s.last = y`):
    the traced values it left in the user's objects, and those its hooks kept, are
    taken back as after a trace that ended (`_failures.take_back_tracers`), with the
    warning naming each place: the values no longer exist."""
    before, call.before = call.before, None
    if before is not None:
        walk = walk_roots(spec, roots, record=True)[0]
        warn_leaks(spec, walk, before, take_back_tracers(walk, before, written))
        take_back_from_registered_hooks(spec)
    if call.owner is not None:
        deliver(call.owner, [], [])


def _after_trace(
    spec: Spec, roots: list, call: Call, key: Hashable, pkey: Hashable, program: Program
) -> None:
    """The key again, after a trace that may have changed what it read.

    An object, dict, list or set that the trace changed (a counter, a list of traces) is
    its output, as under `jax.jit`: from now on keyed by identity, and by the entries
    the trace did not write. The program is that object's: another one, equal to what
    this one held before the trace, gets a trace of its own (and its side effects).
    """
    before = call.before
    assert before is not None
    _places.generation += 1  # what the trace wrote is keyed otherwise from now on
    walk, structure, _ = walk_roots(spec, roots, record=True)
    warn_leaks(spec, walk, before, take_back_tracers(walk, before, written))
    take_back_from_registered_hooks(spec)
    wrote: set[tuple[int, Any]] = set()
    for i, (obj, entries) in walk.entries.items():
        old = before.entries.get(i)
        if old is None or old[0] is not obj:
            continue
        changed = {n for n in old[1].keys() | entries.keys() if old[1].get(n) != entries.get(n)}
        if not changed:
            continue
        if isinstance(obj, list) or "*" in changed:
            changed = {"*"}
        known = written.get(i)
        names = changed | (set(known[1]) if known and known[0] is obj else set())
        # What the trace left there (tracers taken back by now): read again once changed.
        written[i] = (obj, {name: left_key(obj, name) for name in names})
        wrote.update((i, n) for n in changed)
    if wrote:
        places = numbers_of(before)
        _places.pin(
            {places[s][0] for s, owner in before.owner.items() if owner in wrote and s in places}
        )
        if _programs.get(pkey) is program:
            del _programs[pkey]
    walk, structure, _ = walk_roots(spec, roots)  # as the trace left what it read
    numbers = numbers_of(walk)
    after = Key(_places.key(structure, numbers, walk.sites)[0])
    if call.owner is not None:
        layout = _layouts.get(call.layout_key)
        if layout is not None:  # the same points, under the key the model has now
            _layouts[(after, call.layout_key[1])] = layout
        after = Key((after, call.owner.key()))
    if after not in _programs:
        _remember(_programs, after, program, walk.refs)


def _warn_uncached(spec: Spec, walk: Walk) -> None:
    """Once per place: a run that reads what no guard can watch is traced every call."""
    for place in walk.opaque:
        if place not in _warned:
            _warned.add(place)
            warnings.warn(
                f"jhooks.{spec.caller}: {place} holds state that cannot be guarded (a random "
                "generator, an opaque object), so this run is traced again on every call, "
                "which is slow. Pass the values the hooks need as arrays or Python numbers.",
                stacklevel=4,
            )

"""One compiled program per run structure, chosen by guards on everything the run reads.

`compiled(spec, fn, args, kwargs)` walks the function, its arguments and the hooks with
`_closures.Walk` (their code, closures, globals, attributes, containers, to any depth)
into a *key* of everything read, by content, and *sites*: the arrays and Python numbers
found. The key selects a program from a cache this module owns; the arrays, and the
numbers seen to change, are the program's arguments. Tracing it gives the hooks copies
holding their tracers (`_plans.install`: fresh cells, an overlay of globals, shallow
copies of the dicts, lists and objects on the way), so the user's objects never hold a
tracer; what the trace writes is written back after it (`_plans.restore`).

The rule: every value a run reads is a traced argument (arrays; numbers once seen to
change), or in the key (everything else, by content; library code by identity),
checked on every call, or, where no guard can watch it (a random generator), the run
is uncached, with one warning. A number is kept as a Python value, in the key, until a
call sees a new value at its place (`_places`): from then on it is an argument, and
where a trace needs its value (a string, `range(n)`, a shape) or fails, it goes back
into the key. The key is taken again after a call that traced: an object the trace
wrote (a counter) is keyed by identity from then on, and what the trace read of a
large dict (`_reads`) is all of that dict in the key.

A program dies with its key: when an object the key holds by identity is collected,
and beyond `MAX_PROGRAMS`, least recently used first.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import jax

from .._core import (
    NAMES_KEYED,
    READS,
    RUN,
    Install,
    NeedsConcrete,
    ThreadStack,
    Walk,
    concrete_only,
    hook_name,
    program_key,
    restore,
    sites_in,
    static_key,
    touched,
    under_staging,
    unwrap_jit,
)
from . import _fast
from ._failures import mentions_tracer, state_error, traced_error, warn_leaks
from ._places import Key, Places, numbers_of
from ._scopes import HookName

MAX_PROGRAMS = 256
_NUMBERS = (int, float, complex)
_CONCRETE = (
    NeedsConcrete,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerArrayConversionError,
)

# The calls whose program is being traced, innermost last.
_LIVE: ThreadStack[Call] = ThreadStack("run programs being traced")


class NamedCall:
    """Calls a hook with a `HookName`; errors name the user's hook.

    For a backward hook, `plan` and `sites` say where the values it reads live, so
    that the backward pass can put them back (`_backward.py`).
    """

    def __init__(self, fn: Callable, plan: Any = None, values: list | None = None):
        self.fn = fn
        self.__wrapped__ = fn
        self.__qualname__ = hook_name(fn)
        self.plan = plan
        self.values = values or []
        self.sites = sorted(sites_in(plan)) if plan is not None else []

    def __call__(self, value: Any, name: str) -> Any:
        return self.fn(value, HookName(name))


class Spec:
    """What a run does besides calling `fn`: its hooks, and its body.

    `body(fn, args, kwargs, fwd, bwd)` runs the function under the run; `options` is
    the key of whatever else it depends on (the cache filter...).
    """

    def __init__(
        self, caller: str, body: Callable, options: Hashable, fwd: list, bwd: list
    ) -> None:
        self.caller, self.body, self.options = caller, body, options
        self.fwd, self.bwd = fwd, bwd


class Call:
    """One call of a run: its roots (function, arguments, hooks), the walk of what they
    read, each root's plan, and which sites are traced."""

    def __init__(
        self,
        spec: Spec,
        roots: list,
        walk: Walk | None,
        plans: list | None,
        traced: list[int],
        sites: list,
    ):
        # A warm call (`_fast`) has no walk: a trace walks again, and finds the sites
        # in the same order, as nothing the last walk read has changed.
        self.spec, self.roots, self.walk = spec, roots, walk
        self.plans, self.traced, self.sites = plans, traced, sites
        self.before: Walk | None = None  # what the roots held when the trace began
        self.reads: dict = {}  # what traces had read of large dicts, then


_places = Places(MAX_PROGRAMS * 16)


class _Program:
    """One compiled program: its own `jax.jit`, so it is freed with this object."""

    def __init__(self) -> None:
        self.watch: list = []
        self.traces = 0
        self.boxed = False  # whether a trace returned Python values (`_Box`)
        self.jitted = jax.jit(self._trace)

    def _trace(self, *leaves: Any) -> Any:
        self.traces += 1
        call = _LIVE.items()[-1]
        spec = call.spec
        if call.plans is None:
            call.walk, _, call.plans = _walk(spec, call.roots)
        call.reads = dict(READS)
        call.before = _walk(spec, call.roots, record=True, reads=call.reads)[0]
        values = list(call.sites)
        for i, x in zip(call.traced, leaves):
            # A number is traced only as an operand: where its value is needed (a
            # string, a loop bound) the trace fails and it is static again.
            values[i] = concrete_only(x) if type(values[i]) in _NUMBERS else x
        undo: list = []
        needed = touched(call.plans, set(call.traced))
        install = Install(values, needed, undo)
        try:
            fn, args, kwargs, *hooks = (
                p
                if plan is None or not (type(plan) is int or id(plan) in needed)
                else install(plan)
                for p, plan in zip(call.roots, call.plans)
            )
            nf = len(spec.fwd)
            fwd = [(sel, NamedCall(h)) for (sel, _), h in zip(spec.fwd, hooks[:nf])]
            bwd = [
                (sel, NamedCall(hook, plan, values))
                for (sel, hook), plan in zip(spec.bwd, call.plans[3 + nf :])
            ]
            with program_key(Token()):
                out = spec.body(fn, args, kwargs, fwd, bwd)
            leaves_out = jax.tree.leaves(out)
            self.boxed = self.boxed or not all(isinstance(x, jax.Array) for x in leaves_out)
            return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else _Box(x), out)
        finally:
            restore(undo)


@jax.tree_util.register_static
class _Box:
    """A Python value a program returns (a string, a name): in the output's structure."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Box) and other.value is self.value


def _unbox(out: Any) -> Any:
    return jax.tree.map(
        lambda x: x.value if isinstance(x, _Box) else x, out, is_leaf=lambda x: isinstance(x, _Box)
    )


class Token:
    """A fresh jit context per traced program: jits inside it retrace in each new one."""

    __slots__ = ("__weakref__",)


_programs: OrderedDict[Hashable, _Program] = OrderedDict()


def _remember(cache: OrderedDict, key: Hashable, value: Any, refs: list) -> None:
    """Caches `value` until an object `key` holds by identity dies, or it is too old."""
    cache[key] = value
    drop = functools.partial(_drop, cache, key)
    value.watch = [weakref.ref(o, drop) for o in (r() for r in refs if r.weak) if o is not None]
    while len(cache) > MAX_PROGRAMS:
        cache.popitem(last=False)


def _drop(cache: OrderedDict, key: Hashable, _: Any) -> None:
    cache.pop(key, None)


def selector_key(sel: Any) -> Hashable:
    return (sel.names, None if sel.predicate is None else static_key(sel.predicate))


# Objects a trace wrote (see `_after_trace`), by id: (object, the entries written);
# held, so that ids stay theirs.
_written: OrderedDict[int, Any] = OrderedDict()
_warned: set[str] = set()


def _walk(
    spec: Spec,
    roots: list,
    record: bool = False,
    names: set | None = None,
    reads: dict | None = None,
    selectors: tuple | None = None,
) -> tuple[Walk, Hashable, list]:
    walk = Walk(RUN, _written, record, reads=reads)
    walk.names.update(names or ())
    keys: list = [spec.caller, spec.options, len(spec.fwd), len(spec.bwd)]
    plans = []
    for i, root in enumerate(roots):
        if i == 3:
            walk.first_hook_site = len(walk.sites)  # type: ignore[attr-defined]
        label = ("fn", "args", "kwargs")[i] if i < 3 else f"hook {_label(root)}"
        keys.append(walk(root, label))
        plans.append(walk.plan)
    if selectors is None:
        selectors = tuple(selector_key(sel) for sel, _ in (*spec.fwd, *spec.bwd))
    keys.extend(selectors)
    if walk.names_grew():  # a user module met before the code that reads it
        return _walk(spec, roots, record, walk.names, reads, selectors)
    return walk, tuple(keys), plans


def _label(hook: Any) -> str:
    """A hook's name, cheap and stable (no repr of the values it holds)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    name = getattr(hook, "__qualname__", None)
    return name if isinstance(name, str) else type(hook).__qualname__


def compiled(spec: Spec, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Runs `spec.body(fn, args, kwargs, fwd, bwd)` in the program of this structure."""
    if _LIVE or under_staging():
        # Inside another run's program: traced inline, in its trace (a nested program
        # would hide this run's points from the outer cache). Inside a function the user
        # stages out (`jax.jit`, `lax.scan`...), whose cache is the user's: traced inline
        # too, so the run is what any Python code is there, traced once per trace of
        # that function, its side effects made on the user's objects.
        fwd = [(sel, NamedCall(hook)) for sel, hook in spec.fwd]
        bwd = [(sel, NamedCall(hook)) for sel, hook in spec.bwd]
        return spec.body(fn, args, kwargs, fwd, bwd)
    # Its key shows which modules it reads: names are keyed (`_core/_handles.py`).
    with NAMES_KEYED.pushed(spec):
        return _keyed(spec, fn, args, kwargs)


def _keyed(spec: Spec, fn: Callable, args: tuple, kwargs: dict) -> Any:
    roots = [unwrap_jit(fn), args, kwargs, *(h for _, h in spec.fwd), *(h for _, h in spec.bwd)]
    selectors = tuple(selector_key(sel) for sel, _ in (*spec.fwd, *spec.bwd))
    fast_key = _fast.entry_key((spec.caller, spec.options, selectors), roots)
    for attempt in range(2):
        fast = _fast.lookup(fast_key, roots, _places.generation, 3) if attempt == 0 else None
        walk: Walk | None = None
        plans: list | None = None
        if fast is not None:  # nothing the last walk read has changed
            (numbers, key, dynamic, traced, program), sites = fast
        else:
            walk, structure, plans = _walk(spec, roots, selectors=selectors)
            numbers = numbers_of(walk)
            _places.observe(numbers, walk.sites)
            key, dynamic = _places.key(structure, numbers, walk.sites)
            key = Key(key)
            traced = sorted(
                [i for i, x in enumerate(walk.sites) if type(x) not in _NUMBERS] + dynamic
            )
            program = _programs.get(key)
            sites = walk.sites
            if walk.opaque:
                program = _uncached(spec, walk)
            elif program is None:
                program = _Program()
                _remember(_programs, key, program, walk.refs)
            else:
                _programs.move_to_end(key)
        before = program.traces
        call = Call(spec, roots, walk, plans, traced, sites)
        _LIVE.push(call)
        try:
            out = program.jitted(*(sites[i] for i in traced))
            out = _unbox(out) if program.boxed else out
        except Exception as err:
            if attempt == 0 and dynamic:
                # A number needed concretely (a string, a loop bound, a shape), or made
                # the trace fail otherwise: back into the key, for good.
                _places.pin({numbers[i][0] for i in dynamic})
                _programs.pop(key, None)
                continue
            walk = walk or call.walk or _walk(spec, roots, selectors=selectors)[0]
            if type(err).__name__ == "TraceContextError":  # Flax NNX: no flax import
                raise state_error(spec, walk, traced, err) from err
            if not (isinstance(err, _CONCRETE) or mentions_tracer(err)):
                raise
            raise traced_error(spec, walk, traced, err) from err
        finally:
            _LIVE.pop()
        traced_now = program.traces != before and call.before is not None
        if traced_now and call.walk is not None and not call.walk.opaque:
            _after_trace(spec, roots, call, key, program)
        elif walk is not None and plans is not None and not (walk.opaque or walk.unguarded):
            found = (numbers, key, dynamic, traced, program)
            _fast.remember(fast_key, roots, walk, plans[1], _places.generation, found, dynamic)
        return out
    raise AssertionError("unreachable")  # pragma: no cover


def _after_trace(spec: Spec, roots: list, call: Call, key: Hashable, program: _Program) -> None:
    """The key again, after a trace that may have changed what it read.

    An object, dict, list or set that the trace changed (a counter, a list of traces) is
    its output, as under `jax.jit`: from now on keyed by identity, and by the entries
    the trace did not write. The program is that object's: another one, equal to what
    this one held before the trace, gets a trace of its own (and its side effects).
    """
    before = call.before
    assert before is not None
    _places.generation += 1  # what the trace wrote is keyed otherwise from now on
    walk, structure, _ = _walk(spec, roots, record=True, reads=call.reads)
    warn_leaks(spec, walk, before)
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
        known = _written.get(i)
        _written[i] = (obj, frozenset(changed | (known[1] if known and known[0] is obj else set())))
        wrote.update((i, n) for n in changed)
        while len(_written) > MAX_PROGRAMS * 4:
            _written.popitem(last=False)
    if wrote:
        places = numbers_of(before)
        _places.pin(
            {places[s][0] for s, owner in before.owner.items() if owner in wrote and s in places}
        )
        if _programs.get(key) is program:
            del _programs[key]
    walk, structure, _ = _walk(spec, roots)  # with what the trace read of large dicts
    numbers = numbers_of(walk)
    for where, k in numbers.values():
        _places.last[where] = k
    after = Key(_places.key(structure, numbers, walk.sites)[0])
    if after not in _programs:
        _remember(_programs, after, program, walk.refs)


def _uncached(spec: Spec, walk: Walk) -> _Program:
    """A program for one call, for a run that reads what no guard can watch."""
    for place in walk.opaque:
        if place not in _warned:
            _warned.add(place)
            warnings.warn(
                f"jhooks.{spec.caller}: {place} holds state that cannot be guarded (a random "
                "generator, an opaque object), so this run is traced again on every call, "
                "which is slow. Pass the values the hooks need as arrays or Python numbers.",
                stacklevel=4,
            )
    return _Program()

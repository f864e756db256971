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
from ._places import Places, numbers_of
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

    def __init__(self, spec: Spec, roots: list, walk: Walk, plans: list, traced: list[int]):
        self.spec, self.roots, self.walk = spec, roots, walk
        self.plans, self.traced = plans, traced
        self.before: Walk | None = None  # what the roots held when the trace began
        self.reads: dict = {}  # what traces had read of large dicts, then


_places = Places(MAX_PROGRAMS * 16)


class _Program:
    """One compiled program: its own `jax.jit`, so it is freed with this object."""

    def __init__(self) -> None:
        self.watch: list = []
        self.traces = 0
        self.jitted = jax.jit(self._trace)

    def _trace(self, *leaves: Any) -> Any:
        self.traces += 1
        call = _LIVE.items()[-1]
        spec = call.spec
        call.reads = dict(READS)
        call.before = _walk(spec, call.roots, record=True, reads=call.reads)[0]
        values = list(call.walk.sites)
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
    keys.extend(selector_key(sel) for sel, _ in (*spec.fwd, *spec.bwd))
    if walk.names_grew():  # a user module met before the code that reads it
        return _walk(spec, roots, record, walk.names, reads)
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
    for attempt in range(2):
        walk, structure, plans = _walk(spec, roots)
        numbers = numbers_of(walk)
        _places.observe(numbers, walk.sites)
        key, dynamic = _places.key(structure, numbers, walk.sites)
        traced = sorted([i for i, x in enumerate(walk.sites) if type(x) not in _NUMBERS] + dynamic)
        program = _programs.get(key)
        if walk.opaque:
            program = _uncached(spec, walk)
        elif program is None:
            program = _Program()
            _remember(_programs, key, program, walk.refs)
        else:
            _programs.move_to_end(key)
        before = program.traces
        call = Call(spec, roots, walk, plans, traced)
        _LIVE.push(call)
        try:
            out = _unbox(program.jitted(*(walk.sites[i] for i in traced)))
        except Exception as err:
            if attempt == 0 and dynamic:
                # A number needed concretely (a string, a loop bound, a shape), or made
                # the trace fail otherwise: back into the key, for good.
                _places.pin({numbers[i][0] for i in dynamic})
                _programs.pop(key, None)
                continue
            if type(err).__name__ == "TraceContextError":  # Flax NNX: no flax import
                raise _state_error(spec, walk, traced, err) from err
            if not (isinstance(err, _CONCRETE) or _mentions_tracer(err)):
                raise
            raise _traced_error(spec, walk, traced, err) from err
        finally:
            _LIVE.pop()
        if program.traces != before and call.before is not None and not walk.opaque:
            _after_trace(spec, roots, call, key, program)
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
    walk, structure, _ = _walk(spec, roots, record=True, reads=call.reads)
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
    after, _ = _places.key(structure, numbers, walk.sites)
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


def _mentions_tracer(err: Exception) -> bool:
    """An error from Python code given a tracer: a key or index made from one, a slice."""
    text = str(err)
    return any(word in text for word in ("Traced<", "Tracer", "must be static"))


def _state_error(spec: Spec, walk: Walk, traced: list[int], err: Exception) -> Exception:
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


def _traced_error(spec: Spec, walk: Walk, traced: list[int], err: Exception) -> Exception:
    caller = spec.caller
    first = getattr(walk, "first_hook_site", len(walk.sites))
    hooks = [
        w if w.startswith("hook ") else f"hook {w}"
        for w in (walk.where[i] for i in traced if i >= first)
    ]
    if not hooks:
        err.add_note(
            f"jhooks.{caller} compiles `fn` (once per hook structure, eager calls too), "
            "so `fn` must be traceable by jax.jit."
        )
        return err
    return TypeError(
        f"{caller}: tracing the run needed a concrete Python value, but the arrays (and "
        "numbers seen to change) that hooks read are traced arguments of the compiled "
        f"program, so that new values do not recompile. Traced: {'; '.join(hooks[:8])}. "
        "Read an array's value outside the run and pass a Python number (made static "
        "with `jhooks.static(value)` if it changes), e.g. "
        "`functools.partial(hook, n=jhooks.static(int(n)))`: each new static value "
        f"compiles a new program. JAX said: {type(err).__name__}: {str(err).splitlines()[0]}"
    )

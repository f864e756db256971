"""What a traced run reads: its guards, and the values it takes as arguments.

`Walk(mode)(obj)` walks everything Python code in `obj` can read: a function's closure
cells, defaults, attributes and the globals its code names (and the attributes it names
of the user's own modules), `functools.partial` arguments, a bound method's function
and `self`, an object's attributes (`__dict__`, `__slots__`) and its class's attributes
(user classes, bases and metaclass included), containers, pytrees (Equinox modules), the
state of library values (`_kinds.parts`), to any depth up to `MAX_DEPTH`, each object
once (a shared or cyclic object is a back-reference). It returns a hashable *key* that
holds every value read, compared by content: strings, numbers bit for bit (`0.0` and
`-0.0` differ), code objects, pytree structures, and library code (functions, classes,
modules) by identity, held weakly where Python allows it (`Walk.refs`), so that a key
never keeps a model alive. What cannot be keyed (`_kinds.OPAQUE`) is listed in
`Walk.opaque`: the caller does not cache such a run.

Mode `RUN` (a run's function and arguments), as `jax.jit` keys them: an array or Python
number that is a pytree leaf of the roots (reached through tuples, lists, dicts and
pytree nodes only) is a *site* (`Walk.sites`), a program input left out of the key;
`Walk.plan` says where each lives (`_plans.Install` makes that pytree again around
tracers). Anywhere else (a closure cell, a global, an object's attributes) the user's
object is read, never copied: a JAX array there is a constant of the trace, keyed by
identity, a number by value. Mode `STATIC` (registered hooks, predicates): arrays and
numbers are in the key by content (a large JAX array by identity, as it is immutable).

An object or dict that a trace wrote (`written`, id -> (object, {entry: what the trace
left there})) is keyed by identity, and by the content of the entries the trace did not
write; once a written entry holds something else (the user set it), by all its content.
With `record`, each container's entries are kept as `written_key` compares them
(shallow), and what the entries written hold is read too, out of the key.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._code import (
    RUN,
    STATIC,
    Ref,
    add_guard,
    array_key,
    as_left,
    attributes_of,
    by_identity,
    class_key,
    container_slots,
    function_key,
    items_of,
    library_key,
    library_module_key,
    module_key,
    names_grew,
    text,
    vars_of,
    written_key,
)
from ._entries import ATTR, ITEM, entries, is_sequence, record
from ._guards import NOT_NUMBERS, Guard, flat
from ._kinds import attribute
from ._parts import node_parts, partial_parts, wrapped
from ._plans import Copied, Rebuilt
from ._reach import LIBRARIES, _library_module, library, node_children
from ._static import Static, number_key

# Library code and constants: their modules' attributes are not looked into.
CONSTANT_MODULES = LIBRARIES | {"sys", "typing", "builtins"}
MAX_DEPTH = 256  # levels of nesting a walk follows before it refuses
_NUMBER_TYPES = (int, float, complex)
_EXACT_ATOMS = frozenset({str, bytes, type(None), bool})
_ARRAY_TYPES: set[type] = {np.ndarray}  # and each JAX array type met (a fast path)
_ATOMS = (str, bytes, type(None), bool, type(Ellipsis), types.CodeType, range, slice)


class Walk:
    """One walk of the values a run reads: `key = Walk(mode)(obj)`; see the module doc.

    `record`: keep each container's entries' keys (`entries`), to find what a trace wrote.
    """

    def __init__(
        self,
        mode: str,
        written: dict[int, Any] | None = None,
        record: bool = False,
        parent: Walk | None = None,
    ):
        self.mode = mode
        self.written = written if written is not None else {}
        self.record = record
        self.sites: list[Any] = []  # RUN: the arrays and numbers found, in order
        self.where: list[str] = []  # RUN: a description of each site
        self.constants: list[Any] = []  # RUN: where each JAX array read as a constant is
        self.constant_refs: list[Any] = []  # RUN: and a weak reference to it
        self.tracers: list[Any] = []  # RUN: the constants that are a transformation's tracers
        self.owner: dict[int, tuple[int, Any]] = {}  # site -> (container id, entry)
        # Objects keyed by identity, places of values that cannot be keyed: shared.
        self.refs: list[Ref] = [] if parent is None else parent.refs
        self.opaque: list[str] = [] if parent is None else parent.opaque
        # What it read of each object, checked again next call (`_guards`), unless unguarded.
        self.guards: list[Guard] = [] if parent is None else parent.guards
        self.unguarded: list[str] = [] if parent is None else parent.unguarded
        self._inner: Walk | None = None
        # id -> (container, {entry: key}): shared with the walks of classes inside.
        self.entries: dict[int, tuple[Any, Any]] = {} if parent is None else parent.entries
        # With `record`, what each holder's entries held (`_entries.record`), closure cells too.
        self.held: dict[int, tuple[Any, dict]] = {} if parent is None else parent.held
        self.names: set[str] = set() if parent is None else parent.names
        self._modules: list = []  # (module, the names known when it was walked)
        self._seen: dict[int, tuple[int, Any]] = {}  # id -> (index, plan)
        self._keep: list[Any] = []  # objects visited, so their ids stay theirs
        self._classes: dict[int, Any] = {} if parent is None else parent._classes
        self._depth = 0
        self.plan: Any = None  # the plan of the last object walked
        self._tree = False  # RUN: whether the value walked is a pytree leaf of the root

    def __call__(self, obj: Any, where: str = "") -> Any:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 6 * MAX_DEPTH + 1000))
        self._tree = self.mode == RUN
        try:
            key, self.plan = self._walk(obj, where)
        finally:
            sys.setrecursionlimit(limit)
            self._tree = False
        return key

    def names_grew(self) -> bool:
        """Whether a module was walked before all the names code reads were known."""
        return names_grew(self.names, self._modules)

    def _ref(self, obj: Any) -> Ref:
        ref = Ref(obj)
        self.refs.append(ref)
        return ref

    def _site(self, obj: Any, where: Any, key: Any) -> tuple[Any, Any]:
        self.sites.append(obj)
        self.where.append(text(where))
        return key, len(self.sites) - 1

    def _walk(self, obj: Any, where: Any) -> tuple[Any, Any]:
        """`(key, plan)`; the plan is `None` when nothing in `obj` is a site."""
        kind = type(obj)
        if kind in _EXACT_ATOMS:
            return obj, None
        if (
            kind in _ARRAY_TYPES
            and self._tree
            and getattr(obj.dtype, "kind", "") not in NOT_NUMBERS
        ):
            return self._site(obj, where, "a")
        if kind is int or kind is float or kind is complex:
            if self._tree:
                return self._site(obj, where, ("n", kind.__name__))
            return number_key(obj), None
        if isinstance(obj, _ATOMS):
            return obj, None
        if isinstance(obj, Static):
            value = tuple(map(number_key, obj)) if isinstance(obj, tuple) else number_key(obj)
            return ("static", value), None
        if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
            if isinstance(obj, jax.Array):
                _ARRAY_TYPES.add(kind)
            if isinstance(obj, np.bool_):
                return (kind, bool(obj)), None
            return array_key(self, obj, where)
        if isinstance(obj, (int, float, complex)):  # a subclass (an IntEnum...): by value
            return (kind, obj), None
        seen = self._seen.get(id(obj))
        if seen is not None:
            if seen[1] is not None and not self._tree:  # no key is sound: uncached
                self.opaque.append(f"{text(where)}: an argument also read as a constant")
                return ("@", seen[0]), None
            return ("@", seen[0]), seen[1]
        index = len(self._seen)
        self._seen[id(obj)] = (index, None)
        self._keep.append(obj)
        self._depth += 1
        tree = self._tree
        try:
            if self._depth > MAX_DEPTH:
                raise TypeError(
                    f"{text(where) or 'a value'} holds objects nested too deeply to guard "
                    f"(over {MAX_DEPTH} levels): pass the values the run needs as arguments."
                )
            # Only a pytree's children are pytree leaves: `_compound` keeps `_tree` there.
            self._tree = False
            key, plan = self._compound(obj, where, tree)
        finally:
            self._tree = tree
            self._depth -= 1
        self._seen[id(obj)] = (index, plan)
        return key, plan

    def _compound(self, obj: Any, where: Any, tree: bool = False) -> tuple[Any, Any]:
        if isinstance(obj, types.FunctionType):
            if library(obj) and obj.__closure__ is None:
                # Library code is constant; a library closure (a namedtuple's `_make`,
                # made per class) is its code and what its cells hold.
                return ("lib", self._ref(obj)), None
            return function_key(self, obj, where)
        if isinstance(obj, functools.partial):
            parts_ = [obj.func, *obj.args, *obj.keywords.values()]
            guard = add_guard(self, obj, partial_parts, partial_parts(obj))
            return self._rebuilt(
                obj,
                ("partial", type(obj)),
                parts_,
                [where, *((where, "{}: partial argument {}", i) for i in range(len(obj.args)))]
                + [(where, "{}: partial keyword `{}`", k) for k in obj.keywords],
                guard=guard,
            )
        if isinstance(obj, types.MethodType):
            return self._rebuilt(
                obj,
                ("method",),
                [obj.__func__, obj.__self__],
                [where, (where, "{}: self{}", "")],
            )
        if type(obj) is tuple or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
            self._tree = tree
            return self._rebuilt(
                obj,
                ("tuple", class_key(self, type(obj))),
                list(obj),
                [(where, "{}[{}]", i) for i in range(len(obj))],
                (lambda p: tuple(p)) if type(obj) is tuple else (lambda p: type(obj)(*p)),
            )
        if isinstance(obj, types.ModuleType):
            if obj.__name__.partition(".")[0] in CONSTANT_MODULES:
                return ("module", obj.__name__), None
            if _library_module(obj.__name__):
                return library_module_key(self, obj, where)
            return module_key(self, obj, where)
        if isinstance(obj, type):
            return ("class", class_key(self, obj)), None
        if isinstance(obj, (list, dict)):
            head = ("container", class_key(self, type(obj)))
            exact = type(obj) is dict or type(obj) is list
            self._tree = tree and exact
            fast = (items_of, range(len(obj))) if exact else None
            return self._mutable(obj, head, container_slots, where, fast)
        if isinstance(obj, (set, frozenset, tuple)):
            head = ("items", class_key(self, type(obj)))
            return self._frozen(obj, head, lambda o: [*o, vars_of(o)], where)
        if isinstance(obj, (staticmethod, classmethod)):
            return self._walk(obj.__func__, where)
        if isinstance(obj, property):
            return self._rebuilt(obj, ("property",), [obj.fget, obj.fset, obj.fdel], [where] * 3)
        node = node_children(obj)
        if node is not None:
            children, treedef = node
            try:
                hash(treedef)
            except TypeError:
                return ("node?", self._ref(obj)), None
            guard = add_guard(self, obj, node_parts, (*children, treedef))
            self._tree = tree
            # A pytree's Python numbers are static, as under `eqx.filter_jit`: a field
            # `idx` may name a point (`f"blocks.{self.idx}"`) in a trace of its own.
            return self._rebuilt(
                obj,
                ("node", treedef),
                children,
                [where] * len(children),
                lambda p: jax.tree_util.tree_unflatten(treedef, p),
                static_numbers=True,
                guard=guard,
            )
        unwrapped = attribute(obj, "__wrapped__")
        if unwrapped is not None and library(type(obj)) and callable(obj):
            # A library wrapper of user code (`jax.jit(f)`): f is what runs.
            add_guard(self, obj, wrapped, (unwrapped,))
            key, _ = self._walk(unwrapped, where)
            return ("wrapped", type(obj), key), None
        if library(type(obj)):
            return library_key(self, obj, where)
        head = ("object", class_key(self, type(obj)))
        if type(obj).__eq__ is object.__eq__:  # equal only to itself: so is its key
            head = (*head, by_identity(self, obj, where))
        return self._mutable(obj, head, attributes_of, where)

    def _frozen(
        self,
        obj: Any,
        head: tuple,
        read: Callable[[Any], list],
        where: Any = "",
        guard: Callable[[Any], tuple] | None = None,
    ) -> tuple[Any, Any]:
        """Keys `read(obj)` by content: a class, a library value. `guard`
        reads what `read` reads, flat (by default, `read` and the type)."""
        values = read(obj)
        if guard is None:
            check = add_guard(self, obj, lambda o: (*read(o), type(o)), (*values, type(obj)))
        else:
            check = add_guard(self, obj, guard, guard(obj))
        inner = self
        if self.mode != STATIC:
            inner = self._inner
            if inner is None:
                inner = self._inner = Walk(STATIC, self.written, self.record, self)
            inner._depth = self._depth
        keys = tuple(inner._walk(v, where)[0] for v in values)
        if self.record:  # what the guard reads, shallow (`written_key`); a deque's items
            self.entries[id(obj)] = (obj, {"*": written_key(check.seen)})
            record(self.held, obj, entries(obj) if is_sequence(obj) else ())
        return (*head, keys), None

    def _rebuilt(
        self,
        obj: Any,
        head: tuple,
        parts_: list,
        wheres: list,
        make: Callable | None = None,
        static_numbers: bool = False,
        guard: Guard | None = None,
    ) -> tuple[Any, Any]:
        """`obj` made of `parts_`; `guard`, what re-reads them, learns which are sites."""
        keys, plans = [], []
        for part, at in zip(parts_, wheres):
            if static_numbers and type(part) in _NUMBER_TYPES:
                k, p = number_key(part), None
            else:
                k, p = self._walk(part, at)
            keys.append(k)
            plans.append(p)
        key = (*head, tuple(keys))
        if guard is not None:
            guard.sites.update((j, p) for j, p in enumerate(plans) if type(p) is int)
        if all(p is None for p in plans) or make is None:
            return key, None
        return key, Rebuilt(obj, make, parts_, plans)

    def _mutable(
        self,
        obj: Any,
        head: tuple,
        read: Callable[[Any], list | None],
        where: Any,
        guard: tuple[Callable[[Any], tuple], Sequence[int]] | None = None,
    ) -> tuple[Any, Any]:
        """`read(obj)`: its slots, `(how, name, value)`, or with a fourth item, the
        value's place. `guard`: what reads them again quickly, and where in what it
        reads each slot's value is (by default `flat(read(obj))`)."""
        slots = read(obj)
        assert slots is not None
        if guard is None:
            check = add_guard(self, obj, lambda o: flat(read(o), o), flat(slots, obj))
            at_slot = range(len(slots))
        else:
            check = add_guard(self, obj, guard[0], guard[0](obj))
            at_slot = guard[1]
        plan = Copied(obj)
        if self._tree:  # registered before the children: a cycle back to `obj` finds it
            self._seen[id(obj)] = (self._seen.get(id(obj), (len(self._seen), None))[0], plan)
        written = self.written.get(id(obj))
        skip = written[1] if written is not None and written[0] is obj else {}
        if skip:  # keyed by what the trace left there (a program per trace), or read again
            head = (*head, "written", id(obj), frozenset(skip.items()))
            if not as_left(obj, skip):  # changed since the trace wrote it
                skip, head = {}, (*head, "changed since")
        keys, entries = [], {}
        listed = isinstance(obj, list)  # else a dict's keys, an object's names are in the key
        for j, slot in enumerate(slots):
            how, name, value = slot[:3]
            if len(slot) > 3:
                at = slot[3]
            else:
                at = (where, "{}.{}" if how == ATTR else "{}[{!r}]", name)
            if name in skip or "*" in skip:
                if self.record:  # out of the key, but read: a traced value in it is found
                    tree, self._tree = self._tree, False
                    self._walk(value, at)
                    self._tree = tree
                continue
            k, p = self._walk(value, at)
            keys.append(k if listed and how == ITEM else (name, k))
            # What a trace wrote shows by the entry's own value (a site's, by identity).
            entries[name] = ("is", id(value)) if type(p) is int else written_key(value)
            if p is not None:
                plan.slots.append((how, name, p))
                if type(p) is int:
                    self.owner[p] = (id(obj), name)
                    check.sites[at_slot[j]] = p
        if self.record:
            known = self.entries.get(id(obj))  # a module's globals, read by several functions
            if known is not None and known[0] is obj:
                entries = {**known[1], **entries}
            self.entries[id(obj)] = (obj, entries)
            record(self.held, obj, slots)
        return (*head, tuple(keys)), (plan if plan.slots else None)

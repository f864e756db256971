"""One active run, as its points see it: `Run` (its hooks, cache and names), and how a
point is named for one reach (`PointName`: `rope`, then `rope:1`) and selected
(`selects`: a point's own name selects every call of it, and a shared module's other
paths select it too).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .._autograd import register_hook
from .._core import (
    check_like,
    describe,
    hook_name,
    run_chain,
    trace_path,
    vmapped_between,
)
from .._staging import bind_point
from . import _hookpass, _loops
from ._active import ACTIVE_RUNS
from ._backward import as_gradient
from ._hookpass import SiteHook
from ._scopes import HookName
from ._select import Selector, did_you_mean, is_operation


class _NamedHook:
    """`hook(grad, name)` as a value hook `fn(grad)`; errors name the user's hook."""

    def __init__(self, hook: Callable, name: str):
        self.__wrapped__ = hook
        self.name = name

    def __call__(self, grad: Any) -> Any:
        return as_gradient(self.__wrapped__(grad, HookName(self.name)), grad)


@contextmanager
def no_run_active() -> Iterator[None]:
    """Points reached inside the block (a trace made only for a shape, such as
    `jhooks.generate`'s first step under `jax.eval_shape`) are no run's points: no run
    is active there, so no hook is called (a hook returns what it is given, or a value
    of its shape, so the shapes are the run's), and the next reach of each point is
    named as if the block had not run."""
    runs = ACTIVE_RUNS.items()
    saved = runs[:]
    runs.clear()
    try:
        yield
    finally:
        runs[:] = saved


class Run:
    """One active `run_with_hooks` or `run_with_cache` call."""

    def __init__(
        self,
        fwd: list[tuple[Selector, SiteHook]],
        bwd: list[tuple[Selector, SiteHook]],
        cache: Selector | None,
        grads: Selector | None,
        caller: str,
    ):
        self.fwd = fwd
        self.bwd = bwd
        self.cache_selector = cache
        self.grad_selector = grads
        self.caller = caller
        self.seen: dict[str, int] = {}
        # Each point name's reaches so far: (where in the trace, its call index).
        self.reached: dict[str, list[tuple[Any, int]]] = {}
        # Where `loop_index` counts loops from; a staged run (see `_loops.staged_run`)
        # sets it to its own trace, and its place in the run stack (`tag`).
        self.base = _loops.current_trace()
        self.staged = False
        self.tag = -1
        self.operations: list[str] = []  # every operation's address, once looked for
        # Addresses selected in model calls under the user's vmap (`_operations.py`),
        # and how many such calls the trace made.
        self.chosen_per_example: set[str] = set()
        self.regions = 0
        # `jhooks.ops`' own run: it selects nothing, and keeps each such call's
        # operations, one example's (by the call's number).
        self.listing = False
        self.listed: dict[int, list] = {}
        # Every reach of a point, and what each predicate said of it (asked once per
        # point per call, as TransformerLens asks: `selects`).
        self.points: list[str] = []
        self.choices: dict[tuple[int, str], bool] = {}
        owners = {id(h.owner): h.owner for _, h in fwd + bwd if h.owner is not None}
        for owner in owners.values():
            owner.latest = self  # its layout's points are this run's
            if owner.given is not None:  # what the predicates chose this call
                points, chosen = owner.given
                for selector, hook in fwd + bwd:
                    if hook.index in chosen:
                        made = chosen[hook.index]
                        self.choices.update(
                            ((id(selector), str(p)), str(p) in made) for p in points
                        )

    def selects(self, selector: Selector, name: str) -> bool:
        """`selects(selector, name)`, a predicate asked once per point in this call."""
        if not selector.chooses:
            return selects(selector, name)
        key = (id(selector), str(name))
        chosen = self.choices.get(key)
        if chosen is None:
            chosen = self.choices[key] = selects(selector, name)
        return chosen

    def chosen(self) -> dict[int, frozenset[str]]:
        """Each predicate hook's points this call, by the hook's index."""
        return {
            hook.index: frozenset(
                n for (i, n), yes in self.choices.items() if yes and i == id(selector)
            )
            for selector, hook in self.fwd + self.bwd
            if selector.chooses
        }

    def call_name(self, name: str) -> str:
        """The name of this reach of point `name`: `name` the first time in the run,
        `name:1` the second, and so on. Reaches in the two branches of one `lax.cond`
        (or two traces of one loop body) are one call: one of them runs."""
        where = trace_path(self.base)
        earlier = self.reached.setdefault(name, [])
        index = 1 + max(
            (i for w, i in earlier if not _alternatives(w, where)),
            default=-1,
        )
        earlier.append((where, index))
        return name if index == 0 else f"{name}:{index}"

    def next_region(self) -> int:
        """The number of the next model call under the user's vmap in this trace."""
        self.regions += 1
        return self.regions - 1

    def selectors(self) -> list[Selector]:
        selectors = [sel for sel, _ in self.fwd + self.bwd]
        return selectors + [sel for sel in (self.cache_selector, self.grad_selector) if sel]

    def names_operations(self) -> bool:
        """Whether a hook or filter of this run names an operation address (or the run
        lists them: `jhooks.ops`)."""
        return self.listing or any(sel.names_operations for sel in self.selectors())

    def selects_operation(self, address: str) -> bool:
        return any(sel.selects_operation(address) for sel in self.selectors())

    def asks_for(self, name: str) -> bool:
        """Whether a hook or filter of this run names the point `name` (a module input,
        there only when asked): by a name or pattern with `:in` in it."""
        return any(
            any(INPUT in n for n in sel.names) and self.selects(sel, name)
            for sel in self.selectors()
        )

    def uses(self, name: str) -> bool:
        """Whether a hook or filter of this run selects the point `name`."""
        return any(self.selects(sel, name) for sel in self.selectors())

    def refuse_inside_vmap(self, name: str, base: Any = None) -> None:
        """Raises if a hook of this run selects `name` where it would see one example of
        a `jax.vmap` inside the run (a jit or loop traced inside that vmap); `base`: the
        trace hooks see values as from (the run's own by default)."""
        if not vmapped_between(self.base if base is None else base):
            return
        self._refuse_under_vmap(
            name,
            "point",
            "with a jitted function or loop traced inside that vmap: the hook would see "
            "one example's value, not the batched value that run_with_cache shows, and a "
            "patch of one index would edit every example. Select a point outside that jit "
            "or loop, or",
        )

    def refuse_vmapped_operation(self, address: str) -> None:
        """Raises if a hook of this run selects the operation at `address`, made under a
        `jax.vmap` inside the run's function, outside every hookable module."""
        self._refuse_under_vmap(
            address,
            "operation",
            "outside every hookable module: the hook would see the batched operation's "
            "value, with the vmap's axis where JAX's batching rule put it, not one "
            "example's value as jhooks.ops(f, x) lists it, and a patch of one index would "
            "edit the wrong axis. Make the function a hookable module (jhooks.hookable), "
            "whose operations hooks see one example of, or",
        )

    def refuse_unplaced_operation(self, address: str) -> None:
        """Raises if a hook of this run selects the operation at `address`, made under a
        `jax.vmap` of the model's own code where jhooks did not see where the vmap put its
        axis (a hook, or the filter of a cache: `names_filter`, `incl_bwd`)."""
        hooks = [hook for sel, hook in self.fwd + self.bwd if self.selects(sel, address)]
        who = f"hook {hook_name(hooks[0])}" if hooks else "names_filter"
        raise ValueError(
            f"{self.caller}: {who} selects operation {address!r}, made under a jax.vmap "
            "of the model's own code where jhooks cannot tell which axis is the vmap's "
            "(JAX's batching made it inside a rule, or it is under a second vmap there), "
            "so a patch of one index could edit the wrong axis. "
            "Select the operation the vmapped function returns, or put a jhooks.hook_point "
            "in that function (its hooks see the vmap's axis first)."
        )

    def refuse_ambiguous_operation(self, address: str) -> None:
        """Raises if a hook of this run selects the operation at `address`, counted
        otherwise in a model's call under the user's vmap than in the function."""
        self._refuse_under_vmap(
            address,
            "operation",
            "around a model's call that counts its operations from the first, as "
            "jhooks.ops(model, x) does, while the function makes operations of that name "
            "in that module elsewhere too, which it counts on from there: the address "
            "names two operations. Call that model once, or",
        )

    def _refuse_under_vmap(self, name: str, kind: str, why: str) -> None:
        for selector, hook in self.fwd + self.bwd:
            if self.selects(selector, name):
                raise ValueError(
                    f"{self.caller}: hook {hook_name(hook)} selects {kind} {name!r}, which is "
                    f"inside a jax.vmap in the function, {why} call the run inside the vmap "
                    "(jax.vmap(lambda x: jhooks.run_with_hooks(...))), where hooks see one "
                    "example."
                )

    def forward(self, name: str, value: Any) -> Any:
        """Runs this run's forward hooks at point `name`."""
        for one in name.all() if isinstance(name, PointName) else (name,):
            self.seen[one] = self.seen.get(one, 0) + 1
        self.points.append(name)
        hooks = [hook for selector, hook in self.fwd if self.selects(selector, name)]
        operation = is_operation(name)
        where = f"at {'operation' if operation else 'hook point'} {name!r}"
        check = _operation_value if operation else check_like
        return run_chain(
            hooks,
            value,
            lambda hook, v: hook.forward(v, name, self),
            lambda hook, new, old: check(hook, new, old, "activation", where),
            where=where,
        )

    def backward(self, name: str, value: Any) -> Any:
        """Registers this run's backward hooks at point `name` on its value."""
        hooks: list[SiteHook] = [h for selector, h in self.bwd if self.selects(selector, name)]
        if not hooks:
            return value
        if hooks[0].owner is not None:  # a run's own program: hook calls traced this call
            return _hookpass.backward(hooks, value, name, self)
        # Inline (a run inside a staged function): the hooks, as value hooks.
        return register_hook(
            value,
            *(
                _NamedHook(h.hook if h.nested is None else h.nested.backward(h.hook, name), name)
                for h in hooks
            ),
        )

    def keep(self, name: str, value: Any) -> Any:
        """Marks the value at point `name` for the cache if it is selected.

        The run is staged (`_loops.staged_run`): the mark is an identity primitive that
        the run finds in its jaxpr, inside loops, conds, jit and checkpoint too.
        """
        if self.cache_selector is None or not self.selects(self.cache_selector, name):
            return value
        return bind_point(value, str(name), self.tag)

    def check_names(self, seen: frozenset[str]) -> None:
        """Raises for a hook or filter naming a point that `fn` does not have."""
        entries = [(sel, f"hook {hook_name(hook)}") for sel, hook in self.fwd + self.bwd]
        for sel in (self.cache_selector, self.grad_selector):
            if sel is not None:
                entries.append((sel, "names_filter"))
        for sel, what in entries:
            for name in sel.unmatched(seen):
                if is_operation(name):
                    raise ValueError(
                        f"{self.caller} ({what}): no operation at address {name!r}. "
                        + did_you_mean(name, self.operations, "operations (jhooks.ops)")
                    )
                below = sorted(s for s in seen if s.startswith(name + "."))
                hint = (
                    f" Points under {name!r} were reached ({', '.join(map(repr, below[:5]))}), "
                    "but not its own: a module's point is the output of its __call__, and "
                    "a module whose class has no __call__ (used through other methods) has "
                    "a point per method instead, `<path>.<method>`."
                    if below
                    else ""
                    if seen
                    else (
                        " A model's modules are points only once it is hookable: "
                        "`model = jhooks.hookable(model)` (an Equinox or Flax NNX model), then "
                        "run that model; points of your own are marked with jhooks.hook_point."
                    )
                )
                raise ValueError(
                    f"{self.caller} ({what}): no hook point named {name!r}. "
                    + did_you_mean(name, seen, "points reached")
                    + hint
                )


INPUT = ":in"  # the suffix of a module input's point name
_CALL_INDEX = re.compile(r":[0-9]+$")


class PointName(str):
    """A point's name for one reach (`rope:1`), with the names that select it too: the
    same under a shared module's other paths (`aliases`)."""

    aliases: tuple[str, ...] = ()

    @staticmethod
    def of(indexed: str, name: str, aliases: tuple[str, ...]) -> PointName:
        out = PointName(indexed)
        out.aliases = tuple(alias + indexed[len(name) :] for alias in aliases)
        return out

    def all(self) -> tuple[str, ...]:
        return (str(self), *self.aliases)


def selects(selector: Selector, name: str) -> bool:
    """Whether `selector` selects the point `name`: by that name (or an alias), or, for
    a later call (`rope:1`), by the point's own name (`rope`), which selects every call
    of it, as a PyTorch hook on a module runs at every call."""
    for one in name.all() if isinstance(name, PointName) else (name,):
        if selector(one):
            return True
        base = _CALL_INDEX.sub("", one)
        if base != one and selector(base):
            return True
    return False


def _operation_value(hook: Any, new: Any, old: Any, what: str, where: str) -> Any:
    """`check_like` for what a forward hook at an operation returned: an operation with
    several outputs (`jnp.split`) is given a list of them, and takes back any sequence of
    that length (a list or a tuple)."""
    if not isinstance(old, list):
        return check_like(hook, new, old, what, where)
    if not isinstance(new, Sequence) or isinstance(new, str) or len(new) != len(old):
        raise ValueError(
            f"hook {hook_name(hook)} {where} returned {describe(new)}, expected None or a "
            f"list or tuple of the operation's {len(old)} outputs, like {describe(old)}."
        )
    return check_like(hook, list(new), old, what, where)


def _alternatives(a: Any, b: Any) -> bool:
    """Whether two reaches (`trace_path`s) are in different branches of one `lax.cond`
    (or two traces of one loop body): traces that diverge from one parent at one
    point of it, for the same kind of staged function."""
    if a is None or b is None:
        return False
    for (ta, na, ka), (tb, nb, kb) in zip(a, b):
        if ta is not tb:
            return ka is not None and ka == kb and na == nb
    return False

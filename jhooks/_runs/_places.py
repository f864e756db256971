"""Which Python numbers a run traces, by their place.

A number passed as an argument (`run_with_hooks(f, x, 0.5)`, or in a tuple, list or
dict passed so: a site of the walk) is an input of the program from the first call,
as under `jax.jit`: a hook at a point made from it gets the same kind of value on every
call. A number outside int32, or one a trace needed the value of (a shape, a loop
bound, a string), is kept as a Python value, in the key (its place is then pinned).
Any other number the run reads (a closure's, a global, an object's) is no site: the
walk keys it by value.
"""

from __future__ import annotations

from collections.abc import Hashable

from .._core import Bounded, Walk, fits_int32, number_key

_NUMBERS = (int, float, complex)


class Places:
    """The places of numbers that a trace needed the value of (`pin`): static there.

    Kept across structures; at most `size` places are remembered.
    """

    def __init__(self, size: int) -> None:
        self.pinned: Bounded[str, None] = Bounded(size)
        # Bumped whenever what `key` gives may change (and by a trace that wrote to
        # the user's objects): a warm call's fast path (`_fast`) checks it.
        self.generation = 0

    def pin(self, places: set[str]) -> None:
        self.generation += 1
        self.pinned.update(dict.fromkeys(places))

    def key(
        self, structure: Hashable, numbers: dict[int, tuple[str, tuple]], sites: list
    ) -> tuple[Hashable, list[int]]:
        """The program's key (the static numbers' values in it) and the dynamic sites:
        a number outside int32 stays static (a traced one would overflow)."""
        pinned = self.pinned
        dynamic = [i for i, (w, _) in numbers.items() if w not in pinned and fits_int32(sites[i])]
        static = tuple(k for i, (_, k) in numbers.items() if i not in dynamic)
        return (structure, static, tuple(numbers[i][0] for i in dynamic)), dynamic


def numbers_of(walk: Walk) -> dict[int, tuple[str, tuple]]:
    """The number sites of a walk: their place (named, to survive other sites coming
    and going) and value."""
    numbers: dict[int, tuple[str, tuple]] = {}
    names: set[str] = set()
    for i, x in enumerate(walk.sites):
        if type(x) in _NUMBERS:
            where = walk.where[i]
            while where in names:
                where += "'"
            names.add(where)
            numbers[i] = (where, number_key(x))
    return numbers


class Key:
    """A program's key, its hash computed once (a warm call looks it up again)."""

    __slots__ = ("key", "hash")

    def __init__(self, key: Hashable):
        self.key, self.hash = key, hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        # `type(self)`, not the name `Key`: a weak reference's callback may compare keys
        # while the interpreter exits, when module globals are gone.
        return type(other) is type(self) and self.hash == other.hash and self.key == other.key

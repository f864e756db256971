"""`Name` and `NameMap`: names a user knows (TransformerLens') translated to jhooks addresses.

A map holds templates (`"blocks.{i}.attn.hook_z"`) and what each stands for: a jhooks
address with the same `{i}` (`"layers.{i}.attn.o_proj:in"`), and optionally functions to
and from the name's layout. A name asked for (`"blocks.3.attn.hook_z"`, or
`"blocks.*.attn.hook_z"`) is translated to the address it stands for, which the ordinary
runs select; what comes back under an address is keyed by the names asked for again
(`_translated.py`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._runs import did_you_mean

_INDEX = "{i}"


@dataclasses.dataclass(frozen=True)
class Name:
    """What one name of a [`jhooks.NameMap`][] stands for.

    **Arguments:**

    - `address`: the jhooks name selected for it: a point or module path
        (`"layers.{i}.mlp"`), a module's input (`"layers.{i}:in"`) or an operation
        address (`"layers.{i}.attn/softmax"`), with `{i}` where the name has it.
    - `read`: `read(value) -> value`, the value at `address` in the name's layout
        (`lambda out: out[1]` for the second output of a module returning
        `(cache, x)`; `lambda s: s.transpose(0, 2, 1, 3)`). `None`: the value as it is.
        Attribution applies it to elementwise scores, so it must only rearrange
        (index, transpose, reshape).
    - `write`: `write(value, new) -> value`, the value at `address` with `new` (in
        the name's layout) put in: what a patch hook's return becomes. Given with
        `read`, and only with it.
    - `layout`: the name's layout in words (`"(batch, head, query, key)"`), for the
        docs and `repr`.
    """

    address: str
    read: Callable[[Any], Any] | None = None
    write: Callable[[Any, Any], Any] | None = None
    layout: str = ""

    def __post_init__(self):
        if not isinstance(self.address, str) or not self.address:
            raise TypeError(f"Name: address must be a non-empty str, got {self.address!r}.")
        if (self.read is None) != (self.write is None):
            raise TypeError(
                f"Name({self.address!r}): read and write go together (a value read in "
                "another layout must be written back from it); got only "
                f"{'read' if self.read is not None else 'write'}."
            )


@dataclasses.dataclass(frozen=True)
class Asked:
    """One name asked for, resolved: the template, its entry, and the layer index
    (`None` for a template without `{i}`, `"*"` for every layer)."""

    template: str
    entry: Name
    index: str | None

    @property
    def address(self) -> str:
        """The address selected for it (a glob where the index is `*`)."""
        return self.entry.address.replace(_INDEX, self.index or "")

    def name_at(self, address: str) -> str | None:
        """The name asked for that `address` (a name a run reached) stands for, or
        `None` where the address is not this entry's."""
        if self.index != "*":
            return (
                self.template.replace(_INDEX, self.index or "") if address == self.address else None
            )
        found = re.fullmatch(_regex(self.entry.address, r"(\d+)"), address)
        return None if found is None else self.template.replace(_INDEX, found.group(1))


def _regex(template: str, index: str) -> str:
    return re.escape(template).replace(re.escape(_INDEX), index)


class NameTable:
    """The translation of a [`jhooks.NameMap`][]: its names and what they stand for
    (the runs are `_translated.py`'s `NameMap`)."""

    def __init__(self, names: Mapping[str, str | Name], family: str = ""):
        entries = {}
        for template, entry in names.items():
            if not isinstance(template, str) or template.count(_INDEX) > 1:
                raise TypeError(
                    f"NameMap {family!r}: a name is a str with '{{i}}' at most once, got "
                    f"{template!r}."
                )
            entry = Name(entry) if isinstance(entry, str) else entry
            if not isinstance(entry, Name):
                raise TypeError(
                    f"NameMap {family!r}: {template!r} stands for an address string or a "
                    f"jhooks.Name, got {entry!r}."
                )
            if (_INDEX in template) != (_INDEX in entry.address):
                raise ValueError(
                    f"NameMap {family!r}: {template!r} and its address {entry.address!r} "
                    "must both hold '{i}', or neither."
                )
            entries[template] = entry
        self.family = family
        self.names: dict[str, Name] = entries

    def __or__(self, other: Mapping[str, str | Name] | NameTable) -> Any:
        """A copy of this map with `other`'s names added (replacing those it repeats)."""
        more = other.names if isinstance(other, NameTable) else other
        return type(self)({**self.names, **more}, self.family)

    def __repr__(self) -> str:
        return f"NameMap({self.family!r}, {len(self.names)} names)"

    def resolve(self, name: str) -> Asked:
        """The entry `name` stands for: an exact name (`"blocks.3.attn.hook_z"`), or
        one with `*` for the layer index (`"blocks.*.attn.hook_z"`)."""
        if not isinstance(name, str):
            raise TypeError(
                f"NameMap {self.family!r}: names are strings such as "
                f"'blocks.0.hook_resid_pre', got {name!r}."
            )
        if name in self.names:
            return Asked(name, self.names[name], None)
        for template, entry in self.names.items():
            if _INDEX in template:
                found = re.fullmatch(_regex(template, r"(\d+|\*)"), name)
                if found is not None:
                    return Asked(template, entry, found.group(1))
        hint = did_you_mean(name, self.names, kind=f"{self.family or 'map'} names")
        stars = " Only the layer index may be '*'." if "*" in name else ""
        raise ValueError(f"NameMap {self.family!r}: no name {name!r}.{stars} {hint}")

    def address(self, name: str) -> str:
        """The jhooks address `name` stands for (`"blocks.0.attn.hook_z"` ->
        `"layers.0.attn.o_proj:in"`)."""
        return self.resolve(name).address

    def asked(self, names: None | str | Iterable[str], what: str) -> list[Asked]:
        """The names given (`None`: every name of the map, each layer), resolved."""
        if names is None:
            names = [t.replace(_INDEX, "*") for t in self.names]
        elif isinstance(names, str):
            names = [names]
        elif callable(names) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"NameMap {self.family!r}: {what} takes names, '*' patterns of the layer "
                f"index ('blocks.*.attn.hook_z') or a list of those, got {names!r}."
            )
        return [self.resolve(n) for n in names]

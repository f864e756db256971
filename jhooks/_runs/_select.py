"""Which names a hook or a filter applies to, and the one "did you mean" text.

`Selector` is the one selector of point and module names: `run_with_hooks`'
`fwd_hooks`/`bwd_hooks`, `run_with_cache`'s `names_filter` and the path patterns of
`register_module_hooks` all go through it. `did_you_mean` is the one text for a name
that matches nothing: the close names, then every name there is (up to 20).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias

NamesFilter: TypeAlias = None | str | Sequence[str] | Callable[[str], bool]


def _everything(name: str) -> bool:
    return True


def is_operation(name: str) -> bool:
    """Whether `name` is an operation address (`"blocks.0.attn/softmax"`) or a pattern
    of them: it holds a `/`."""
    return "/" in name


def is_pattern(name: str) -> bool:
    """Whether `name` is a glob pattern (it holds `*`, `?` or `[`) rather than one name."""
    return any(c in name for c in "*?[")


def _fnmatch_body(pattern: str) -> str:
    # `fnmatch.translate` gives `(?s:<body>)\Z`.
    return fnmatch.translate(pattern)[len("(?s:") : -len(")\\Z")]


def translate(name: str) -> str:
    """The regular expression of the name or glob pattern `name`, matched whole.

    A point name's pattern is `fnmatch`'s: `*` matches anything, dots included
    (`*.o_proj:in`). In an operation address (`<module path>/<operation>`) the module
    path is matched by segments: `*` matches within one dotted segment, so
    `layers.*/add:1` is each layer's own second `add` (`layers.0/add:1`), not one in a
    module below it (`layers.0.attn/add:1`); `**` matches any part of the path, dots
    included (`**/softmax`: every module's; `blocks**.attn/softmax`: `blocks.0.attn`
    and, under a scan, `blocks.attn`). The operation's own part is `fnmatch`'s.
    """
    if not is_operation(name):
        return fnmatch.translate(name)
    path, op = name.split("/", 1)
    marked = path.replace("**", "\x00").replace("*", "\x01").replace("?", "\x02")
    body = _fnmatch_body(marked)
    body = body.replace("\x00", ".*").replace("\x01", "[^.]*").replace("\x02", "[^.]")
    return f"(?s:{body}/{_fnmatch_body(op)})\\Z"


class Selector:
    """Which names a hook or a filter applies to.

    Made from `None` (every name), a name, a glob pattern (`fnmatch`'s, with `*`:
    `"blocks.*.attn.hook_z"`; in an operation address's module path `*` matches one
    segment, `?` one character of one, `**` any part: `translate`), a list of those, or a predicate
    `fn(name) -> bool`.
    `names` holds the names and patterns given (each must match something: see
    `unmatched`), `predicate` the function given.
    """

    def __init__(self, spec: NamesFilter, what: str):
        self.what = what
        self.predicate: Callable[[str], bool] | None = None
        self.names: tuple[str, ...] = ()
        if spec is None:
            self.predicate = _everything
        elif isinstance(spec, str):
            self.names = (spec,)
        elif callable(spec):
            self.predicate = spec
        elif isinstance(spec, Sequence) and all(isinstance(n, str) for n in spec):
            self.names = tuple(spec)
        else:
            raise TypeError(
                f"{what} must be a point name, a glob pattern such as 'blocks.*.attn', a "
                f"list of those or a predicate `fn(name) -> bool`, got {spec!r}."
            )
        self._exact = frozenset(n for n in self.names if not is_pattern(n))
        patterns = [translate(n) for n in self.names if is_pattern(n)]
        self._pattern = re.compile("|".join(patterns)) if patterns else None
        operations = [translate(n) for n in self.names if is_operation(n)]
        self._operations = re.compile("|".join(operations)) if operations else None

    @property
    def chooses(self) -> bool:
        """Whether it is a predicate of the user's (called on every call, per point)."""
        return self.predicate is not None and self.predicate is not _everything

    def __call__(self, name: str) -> bool:
        if is_operation(name):
            return self.selects_operation(name)
        if self.predicate is not None:
            return bool(self.predicate(name))
        if name in self._exact:
            return True
        return self._pattern is not None and self._pattern.match(name) is not None

    @property
    def names_operations(self) -> bool:
        """Whether a name or pattern given is an operation address (holds a `/`)."""
        return self._operations is not None

    def selects_operation(self, address: str) -> bool:
        """Whether the operation at `address` is selected: only names and patterns
        holding a `/` select operations (not `None`, a predicate or a point's name)."""
        return self._operations is not None and self._operations.match(address) is not None

    def unmatched(self, seen: Iterable[str]) -> list[str]:
        """The names and patterns given that match none of `seen`."""
        seen = list(seen)
        return [
            n
            for n in self.names
            if not (
                n in seen
                if not is_pattern(n)
                else any(re.match(translate(n), s) is not None for s in seen)
            )
        ]


def did_you_mean(name: str, known: Iterable[str], kind: str = "names") -> str:
    """The hint for `name`, which matches none of `known`: the close ones (by spelling,
    or ending with the same dotted part), then every one of `known` (up to 20)."""
    known = sorted(set(known))
    if not known:
        return f"The {kind}: none."
    last = name.rsplit(".", 1)[-1].replace("*", "")
    close = [k for k in known if last and k.rsplit(".", 1)[-1] == last]
    close += [k for k in difflib.get_close_matches(name, known, n=5) if k not in close]
    listed = ", ".join(repr(k) for k in known[:20]) + (", ..." if len(known) > 20 else "")
    hint = f"Did you mean {', '.join(repr(c) for c in close[:5])}? " if close else ""
    return f"{hint}The {kind}: {listed}."

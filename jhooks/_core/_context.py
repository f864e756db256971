"""One thread-local context type, `ThreadStack`; and `Bounded`, the one bounded cache.

Every piece of state that jhooks keeps while a function is traced (the active runs, the
`jhooks.grad` calls, the collectors of `emit`, the running hook) is a stack of contexts,
one stack per thread, innermost last. A context is pushed for the length of a `with`
block and popped when it ends, raised exceptions included, so no stack is left stale.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Generator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


class Bounded(OrderedDict[K, T]):
    """A cache of at most `size` entries: beyond it, the oldest set goes first."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def __setitem__(self, key: K, value: T) -> None:
        super().__setitem__(key, value)
        while len(self) > self.size:
            self.popitem(last=False)


class ThreadStack(Generic[T]):
    """A stack of contexts per thread, innermost last."""

    def __init__(self, what: str):
        self.what = what  # for `repr` only
        self._local = threading.local()

    def items(self) -> list[T]:
        """This thread's stack (a live list: innermost last)."""
        return self._local.__dict__.setdefault("items", [])

    def top(self) -> T | None:
        """The innermost context, or `None` when the stack is empty."""
        items = self.items()
        return items[-1] if items else None

    def __len__(self) -> int:
        return len(self.items())

    def __bool__(self) -> bool:
        return bool(self.items())

    def push(self, item: T) -> None:
        """Pushes without a `with` block: pair it with `pop` in a `try`/`finally`."""
        self.items().append(item)

    def pop(self) -> T:
        return self.items().pop()

    @contextmanager
    def pushed(self, item: T) -> Generator[T]:
        """`item` is the innermost context for the length of the block."""
        items = self.items()
        items.append(item)
        try:
            yield item
        finally:
            items.pop()

    def __repr__(self) -> str:
        return f"<ThreadStack of {self.what}: {len(self)} in this thread>"

"""Side-by-side timing: variants run in turn, round after round, compared round by round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


class Timed:
    """A function run in a timed loop: `step()` runs one step, `block()` waits for it."""

    def __init__(
        self,
        step: Callable[[], Any],
        block: Callable[[], Any] = lambda: None,
        threads: int | None = None,
    ):
        self.step = step
        self.block = block
        self.threads = threads  # PyTorch's intra-op threads while this runs
        self.inner = 1

    def run(self, n: int) -> float:
        if self.threads is not None:
            import torch  # only PyTorch's variants set threads: JAX-only runs skip the import

            torch.set_num_threads(self.threads)
        start = time.perf_counter()
        for _ in range(n):
            self.step()
        self.block()
        return (time.perf_counter() - start) / n

    def calibrate(self, min_time: float) -> None:
        n = 1
        while True:
            elapsed = self.run(n) * n
            if elapsed >= min_time or n >= 1 << 16:
                break
            n = max(n * 2, int(n * 1.2 * min_time / max(elapsed, 1e-9)))
        self.inner = n


def interleave(
    timed: dict[str, Timed], reps: int, min_time: float, calibrate: bool = True
) -> dict[str, list[float]]:
    """Per-step times of every variant, round after round, in a rotating order.

    Each variant runs enough steps per round to last `min_time`; with `calibrate=False`,
    the `inner` steps each `Timed` already holds (processes that run one program together
    must run it equally often).
    """
    for t in timed.values():
        t.run(2)
        if calibrate:
            t.calibrate(min_time)
    names = list(timed)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed[name].run(timed[name].inner))
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))

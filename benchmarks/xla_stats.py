"""What XLA made of a jitted step: trace and compile time, memory, operations by opcode."""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable
from typing import Any


def count_ops(hlo_text: str) -> dict[str, int]:
    """How many of each XLA operation an optimized HLO module holds (fusion bodies too)."""
    ops: collections.Counter[str] = collections.Counter()
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
        if m and m.group(1) != "parameter":
            ops[m.group(1)] += 1
    return dict(sorted(ops.items()))


def count_lowered_ops(mlir_text: str) -> dict[str, int]:
    """How many of each operation the lowered (not yet optimized) StableHLO holds."""
    ops = collections.Counter(re.findall(r"\b((?:stablehlo|chlo|func)\.[a-z_]+)\b", mlir_text))
    return dict(sorted(ops.items()))


def compiled_stats(step: Callable, args: tuple) -> dict[str, Any]:
    """Trace + lower time, compile time, memory and operations of `step(*args)`."""
    t0 = time.perf_counter()
    lowered = step.lower(*args)  # type: ignore[attr-defined]
    t1 = time.perf_counter()
    runnable = lowered.compile()
    t2 = time.perf_counter()
    compiled = runnable.compiled
    mem = compiled.memory_analysis()
    memory = {
        key: int(getattr(mem, key + "_in_bytes"))
        for key in ("argument_size", "output_size", "alias_size", "temp_size")
    }
    return {
        "trace_lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "memory": memory,
        "ops": count_ops(compiled.as_text()),
        "lowered_ops": count_lowered_ops(lowered.as_text()),
    }


def ops_diff(a: dict[str, int], b: dict[str, int]) -> str:
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k} {b.get(k, 0)}->{a.get(k, 0)}" for k in keys if a.get(k) != b.get(k))

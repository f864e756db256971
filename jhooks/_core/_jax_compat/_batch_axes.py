"""Where a `jax.vmap` of the model's own code put its axis (part of the fence,
`__init__.py` beside this file), for operation addresses (`_staging/_addresses.py`).

A jaxpr does not say which axis of a value under a `jax.vmap` is the vmap's: JAX's
batching rule for each primitive puts it where it likes (`dot_general` of a weight with
a mapped vector puts it last). While a model is traced for its operations,
`recording_batch_axes` wraps `BatchTrace`'s processing of primitives and calls, and
records, for each value it hands back whose own value is an equation's output in the
jaxpr being made, that axis (or none: the value is the same for every example).
Nothing else changes: the wrapped methods return what JAX's do, and in a thread that
records nothing they only call them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax

try:  # jax 0.10
    from jax._src.interpreters import batching as _batching
    from jax._src.interpreters import partial_eval as _pe
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"jhooks reads a vmap's batch axes through jax._src.interpreters.batching, which "
        f"moved in this JAX ({jax.__version__}); jhooks supports jax 0.10. Please report it."
    ) from e

_METHODS = (
    "process_primitive",
    "process_call",
    "process_custom_jvp_call",
    "process_custom_vjp_call",
)
_lock = threading.Lock()
_installed = [0]
_originals: dict[str, Any] = {}
_local = threading.local()
# The wrapped methods' frames are JAX's plumbing, not jhooks' code, in an equation's
# traceback (`_staging/_addresses.py` tells the model's operations by their frames).
BATCH_AXES_FILE = __file__


class BatchAxes:
    """The batch axis of each equation output recorded while a jaxpr was traced (that
    jaxpr and the ones traced inside it): `axis(var)` is an `int`, `None` (the value is
    not batched) or `UNKNOWN` (no vmap's batching was seen giving this value as it is:
    made inside a batching rule, or in a jaxpr JAX had from a cache; runs and
    `jhooks.ops` trace under a jit context of their own, where JAX's caches miss)."""

    def __init__(self) -> None:
        self._axes: dict[int, tuple[Any, int | None]] = {}

    def record(self, out: Any) -> None:
        if isinstance(out, _batching.BatchTracer):
            val, axis = out.val, out.batch_dim
            if not isinstance(axis, int):
                return
        else:
            val, axis = out, None
        if isinstance(val, _pe.DynamicJaxprTracer):
            # The var is kept alive with its axis: an id is not reused while recorded.
            self._axes[id(val.val)] = (val.val, axis)

    def axis(self, var: Any) -> Any:
        held = self._axes.get(id(var))
        return held[1] if held is not None and held[0] is var else UNKNOWN


UNKNOWN = "unknown"


def _wrapped(name: str) -> Any:
    original = getattr(_batching.BatchTrace, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        outs = original(self, *args, **kwargs)
        records = getattr(_local, "records", None)
        if records:
            for out in outs if isinstance(outs, (list, tuple)) else (outs,):
                records[-1].record(out)
        return outs

    _originals[name] = original
    return method


@contextlib.contextmanager
def recording_batch_axes() -> Iterator[BatchAxes]:
    """Inside: the batch axes of what `jax.vmap`s give back in this thread, recorded in
    the `BatchAxes` yielded."""
    with _lock:
        if not _installed[0]:
            for name in _METHODS:
                setattr(_batching.BatchTrace, name, _wrapped(name))
        _installed[0] += 1
    records = _local.__dict__.setdefault("records", [])
    axes = BatchAxes()
    records.append(axes)
    try:
        yield axes
    finally:
        records.pop()
        with _lock:
            _installed[0] -= 1
            if not _installed[0]:
                for name in _METHODS:
                    setattr(_batching.BatchTrace, name, _originals.pop(name))

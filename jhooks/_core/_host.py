"""Host hooks: run a hook on the host, with concrete NumPy values, every time a step runs."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._checks import check_callable, hook_name


def _to_numpy(x: Any) -> Any:
    # NumPy has no PRNG key dtype: a key (a module's `nnx.Rngs`) stays a JAX array.
    return x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)


def host(fn: Callable[..., Any], *, ordered: bool = True) -> Callable[..., None]:
    """Wraps a hook so that it runs on the host with concrete NumPy values.

    A hook runs while JAX traces the program, on tracers; a host hook instead runs each
    time the compiled program executes, through `jax.debug.callback`. Use it to print,
    log, or collect values in Python lists.

    **Arguments:**

    - `fn`: any hook. It receives the hook's arguments with every array converted to a
        NumPy array (non-array parts, such as a module's structure, are kept; PRNG key
        arrays, such as those of a Flax NNX `nnx.Rngs`, stay JAX arrays). It must
        return `None`: host hooks observe, they cannot replace values.
    - `ordered`: keep host hooks in program order, the order PyTorch calls hooks in.
        Ordered callbacks are not supported on more than one device: pass
        `ordered=False` in sharded programs.

    **Returns:**

    A hook that returns `None`.

    **Example:**

    ```python
    norms = []
    y = jhooks.register_hook(y, jhooks.host(lambda g: norms.append(np.linalg.norm(g))))
    ```

    If `fn` returns something other than `None`, the step raises a `ValueError` when it
    runs.
    """
    check_callable(fn, "the function passed to jhooks.host")

    @functools.wraps(fn)
    def host_hook(*args: Any, **kwargs: Any) -> None:
        arrays, static = eqx.partition((args, kwargs), eqx.is_array)

        def on_host(arrays: Any) -> None:
            call_args, call_kwargs = eqx.combine(jax.tree.map(_to_numpy, arrays), static)
            result = fn(*call_args, **call_kwargs)
            if result is not None:
                raise ValueError(
                    f"host hook {hook_name(fn)} returned {type(result).__name__}: host "
                    "hooks observe values and must return None. To replace a value, use "
                    "a hook without jhooks.host."
                )

        jax.debug.callback(on_host, arrays, ordered=ordered)

    _HOST_HOOKS.add(host_hook)
    return host_hook


_HOST_HOOKS: weakref.WeakSet = weakref.WeakSet()


def is_host_hook(hook: Any) -> bool:
    """Whether `hook` was made by `jhooks.host`: it runs on the host on every call, under
    the user's jit too."""
    try:
        return hook in _HOST_HOOKS
    except TypeError:  # unhashable
        return False

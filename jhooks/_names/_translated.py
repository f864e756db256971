"""The runs of a `NameMap`: names translated to addresses, results keyed by the names.

Each run is the ordinary one (`run_with_cache`, `run_with_hooks`, `attribution`) called
with the addresses the names stand for: one selection mechanism. A name with `*` for the
layer index selects a glob of its address (`"layers.*.attn/softmax"`), and only the
values at addresses its template matches exactly (`layers.<digits>.attn/softmax`) come
back or reach its hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp

from .._attribution import attribution as _attribution
from .._runs import HookName, run_with_cache, run_with_hooks
from ._map import Asked, NameTable

_SUFFIXES = ("_grad",)


def _read(asked: Asked, value: Any) -> Any:
    return value if asked.entry.read is None else asked.entry.read(value)


def _named(asked: list[Asked], address: str) -> list[tuple[str, Asked]]:
    """The names asked for that the value at `address` stands for, in the order asked."""
    out = []
    for a in asked:
        name = a.name_at(address)
        if name is not None and all(name != n for n, _ in out):
            out.append((name, a))
    return out


@contextmanager
def _said_of_names(names: NameTable, asked: list[Asked]) -> Iterator[None]:
    """A run's refusal of an address, said of the names that stand for it."""
    try:
        yield
    except ValueError as error:
        text = str(error)
        held = [a for a in asked if repr(a.address) in text]
        if not held:
            raise
        which = ", ".join(
            f"{a.template.replace('{i}', a.index or '')!r} stands for {a.address!r}" for a in held
        )
        raise ValueError(f"NameMap {names.family!r}: {which}: {text}") from None


def cache(
    names: NameTable,
    fn: Callable,
    args: tuple,
    names_filter: Any,
    incl_bwd: bool,
    return_output: bool,
    dtype: Any,
    kwargs: dict,
) -> tuple[Any, dict[str, Any]]:
    if "max_steps" in kwargs:
        # Its values are (max_steps, ...) buffers, which a name's layout does not read.
        raise TypeError(
            f"NameMap {names.family!r}.run_with_cache does not take max_steps: call "
            "jhooks.run_with_cache with the addresses (NameMap.address(name))."
        )
    asked = names.asked(names_filter, "names_filter")
    addresses = list(dict.fromkeys(a.address for a in asked))
    with _said_of_names(names, asked):
        out, raw = run_with_cache(
            fn,
            *args,
            names_filter=addresses,
            incl_bwd=incl_bwd,
            return_output=return_output,
            dtype=dtype,
            **kwargs,
        )
    result: dict[str, Any] = {}
    for key, value in raw.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s) and key[: -len(s)] in raw), "")
        for name, a in _named(asked, key[: len(key) - len(suffix)]):
            result[name + suffix] = _read(a, value)
    return out, result


def _hooks(names: NameTable, hooks: Sequence[tuple[str, Callable]], what: str) -> tuple:
    out, every = [], []
    for entry in hooks:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise TypeError(
                f"NameMap {names.family!r}: {what} takes a list of (name, hook) pairs, got "
                f"{entry!r} in it."
            )
        name, hook = entry
        [asked] = names.asked(name, what)
        every.append(asked)
        out.append((asked.address, _in_layout(asked, hook)))
    return out, every


def _in_layout(asked: Asked, hook: Callable) -> Callable:
    """`hook(value_in_layout, name)` as a hook on the address: the value read into the
    name's layout, a value returned written back; addresses of a glob that the name's
    template does not match are left as they are."""

    def at_address(value: Any, address: str) -> Any:
        name = asked.name_at(str(address))
        if name is None:
            return None
        new = hook(_read(asked, value), HookName(name))
        if new is None or asked.entry.write is None:
            return new
        return asked.entry.write(value, new)

    at_address.__wrapped__ = hook  # type: ignore[attr-defined]  # the user's, for purity
    return at_address


def hooks(
    names: NameTable,
    fn: Callable,
    args: tuple,
    fwd_hooks: Sequence[tuple[str, Callable]],
    bwd_hooks: Sequence[tuple[str, Callable]],
    kwargs: dict,
) -> Any:
    fwd, fwd_asked = _hooks(names, fwd_hooks, "fwd_hooks")
    bwd, bwd_asked = _hooks(names, bwd_hooks, "bwd_hooks")
    with _said_of_names(names, fwd_asked + bwd_asked):
        return run_with_hooks(fn, *args, fwd_hooks=fwd, bwd_hooks=bwd, **kwargs)


_REFUSED = ("edges", "writers", "readers", "softmax", "queries", "keys", "graddrop", "interpolate")


def attribution(
    names: NameTable,
    metric: Callable,
    fn: Callable,
    clean: Any,
    corrupt: Any,
    nodes: Any,
    sum_axes: None | int | Sequence[int],
    options: dict,
) -> dict[str, Any]:
    given = [k for k in _REFUSED if options.get(k) not in (None, False)]
    if given:
        raise TypeError(
            f"NameMap {names.family!r}.attribution scores nodes by name; {given} name points "
            "in the model's own layout: call jhooks.attribution with addresses "
            f"(NameMap.address(name)) for {', '.join(given)}."
        )
    asked = names.asked(nodes, "nodes")
    addresses = list(dict.fromkeys(a.address for a in asked))
    with _said_of_names(names, asked):
        raw = _attribution(metric, fn, clean, corrupt, nodes=addresses, sum_axes=(), **options)
    # Elementwise scores, read into each name's layout, then summed there.
    result = {}
    for key, value in raw.items():
        for name, a in _named(asked, key):

            def in_layout(scores: Any, a: Asked = a) -> Any:
                return _summed(_read(a, scores), sum_axes)

            result[name] = (
                jax.vmap(in_layout)(value) if options.get("per_example") else in_layout(value)
            )
    return result


def _summed(scores: Any, sum_axes: None | int | Sequence[int]) -> Any:
    def one(s: Any) -> Any:
        if s is None:
            return None
        return jnp.sum(s, axis=None if sum_axes is None else sum_axes)

    return jax.tree.map(one, scores, is_leaf=lambda s: s is None)


class NameMap(NameTable):
    """Names you already know, translated to the jhooks addresses they stand for.

    A declarative map from templates of names (TransformerLens' `"blocks.{i}.hook_resid_pre"`)
    to what they stand for in one model family: an address string, or a [`jhooks.Name`][]
    with functions to and from the name's layout. Its runs take the names: they translate
    each name to its address, run [`jhooks.run_with_cache`][], [`jhooks.run_with_hooks`][]
    or [`jhooks.attribution`][] with it, and key what comes back by the names asked for,
    in their layout. `jhooks.transformer_lens_names` holds the maps of the published families.

    **Arguments:**

    - `names`: a mapping from template (`{i}` for the layer index, at most once) to an
        address (`"layers.{i}:in"`) or a `jhooks.Name`.
    - `family`: what the map is for (`"llama3"`), named in errors.

    **Example:**

    ```python
    tl = jhooks.transformer_lens_names("llama3")
    logits, cache = tl.run_with_cache(model, tokens, positions, None, mask,
                                      names_filter=["blocks.0.attn.hook_pattern"])
    cache["blocks.0.attn.hook_pattern"]        # (batch, head, query, key)
    mine = tl | {"blocks.{i}.hook_gate": "layers.{i}.mlp/silu"}   # extended copy
    ```
    """

    def run_with_cache(
        self,
        fn: Callable,
        *args: Any,
        names_filter: None | str | Sequence[str] = None,
        incl_bwd: bool = False,
        return_output: bool = True,
        dtype: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, dict[str, Any]]:
        """[`jhooks.run_with_cache`][] with the map's names.

        **Arguments:**

        - `fn`, `*args`, `**kwargs`: as `jhooks.run_with_cache` takes them.
        - `names_filter`: a name of the map (`"blocks.0.hook_resid_pre"`), one with `*`
            for the layer index (`"blocks.*.attn.hook_z"`), or a list of those; `None`:
            every name of the map, each layer (each must be reached).
        - `incl_bwd`, `return_output`, `dtype`: as `jhooks.run_with_cache` takes them
            (`max_steps` is refused: its buffers are not in a name's layout).

        **Returns:**

        `(out, cache)`: the cache keyed by the names asked for (and `name + "_grad"`),
        each value in the name's layout (its `read`), in the order the points were
        reached.
        """
        return cache(self, fn, args, names_filter, incl_bwd, return_output, dtype, kwargs)

    def run_with_hooks(
        self,
        fn: Callable,
        *args: Any,
        fwd_hooks: Sequence[tuple[str, Callable]] = (),
        bwd_hooks: Sequence[tuple[str, Callable]] = (),
        **kwargs: Any,
    ) -> Any:
        """[`jhooks.run_with_hooks`][] with the map's names.

        A hook `hook(value, name)` named by a name of the map (or one with `*` for the
        layer index) sees the value in the name's layout and the name
        (`"blocks.3.attn.hook_z"`, with TransformerLens' `hook.name` and `hook.layer()`);
        a value it returns, in that layout, is written back (the name's `write`).
        Backward hooks see the gradient in the name's layout likewise.
        """
        return hooks(self, fn, args, fwd_hooks, bwd_hooks, kwargs)

    def attribution(
        self,
        metric: Callable[..., Any],
        fn: Callable,
        clean: Any,
        corrupt: Any,
        *,
        nodes: None | str | Sequence[str] = None,
        sum_axes: None | int | Sequence[int] = (-1,),
        **options: Any,
    ) -> dict[str, Any]:
        """[`jhooks.attribution`][] of nodes named by the map's names.

        The scores are computed elementwise at the addresses, read into each name's
        layout, then summed over `sum_axes` there (`(-1,)`: `hook_z`'s
        `(batch, pos, head, d_head)` scores `(batch, pos, head)`). `method`, `steps`,
        `rule`, `batch_size`, `per_example` and `metric_args` are passed on; options that
        name other points (`edges`, `softmax`, `queries`...) raise a `TypeError`: give
        them addresses (`NameMap.address`) with `jhooks.attribution`.
        """
        return attribution(self, metric, fn, clean, corrupt, nodes, sum_axes, options)

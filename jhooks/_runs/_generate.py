"""`jhooks.generate`: a decode loop with hooks, compiled once per hook structure.

The loop is Gemma's sampler's shape: a fixed-size token buffer and a step counter in
the carry of one `lax.while_loop`, the model's KV cache beside them. Each step feeds
one token (the prompt's tokens too, teacher-forced, so a prompt needs no second code
path), so `loop_index()` in a hook is the position of the token the model reads.
Hooks and the bounded cache come from `run_with_hooks` / `run_with_cache(max_steps=)`:
the arrays hooks close over (a steering vector, its coefficient) are arguments of the
compiled program, so a sweep traces once, and the whole call can be `jax.vmap`ped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import Bounded, check_callable, static
from .._staging import calls_model
from ._points import NameSelector, run_with_cache, run_with_hooks
from ._run import no_run_active
from ._select import NamesFilter


class Generation(NamedTuple):
    """What [`jhooks.generate`][] returns.

    - `tokens`: `(len(prompt) + max_new_tokens,)` `int32`, the prompt then the new
        tokens; positions from `length` on are 0.
    - `logits`: `(max_new_tokens, vocab)`, the logits each new token was chosen from
        (rows from `length - len(prompt)` on are 0).
    - `length`: the number of valid tokens (prompt, new tokens, the end-of-sequence
        token included).
    - `cache`: the points `names_filter` selected, each `(len(prompt) +
        max_new_tokens - 1, ...)`, row `t` their value when the token at position `t`
        was read, with `name + "_steps"` and `name + "_valid"`; `{}` without a filter.
    """

    tokens: jax.Array
    logits: jax.Array
    length: jax.Array
    cache: dict[str, Any]


@calls_model
def _step(step: Callable, model: Any, state: Any, token: Any, position: Any) -> Any:
    # The model's code: its operations have addresses (jhooks' own around it have none).
    return step(model, state, token, position)


def _decode(
    model: Any,
    state: Any,
    prompt: jax.Array,
    key: Any,
    temperature: Any,
    *,
    step: Callable,
    new: int,
    eos_id: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    (n_prompt,) = prompt.shape
    total = n_prompt + new
    tokens = jnp.zeros((total,), jnp.int32).at[:n_prompt].set(prompt.astype(jnp.int32))

    def first(m: Any, s: Any) -> Any:
        # Traced in a loop of one step, as in the decode loop (no run is active here,
        # so no hook is called; the model's own code finds a loop as it will there).
        def once(c: Any, _: Any) -> tuple:
            return c, _step(step, m, s, tokens[0], jnp.int32(0))[0]

        return jax.lax.scan(once, None, None, length=1)[1]

    with no_run_active():  # a trace for the shape only: not a call of the points
        shape = jax.eval_shape(first, model, state)
    logits = jnp.zeros((new, *shape.shape[1:]), shape.dtype)

    def cond(carry: tuple) -> jax.Array:
        t, _, _, _, done = carry
        return (t < total - 1) & ~done

    def body(carry: tuple) -> tuple:
        t, tokens, logits, state, done = carry
        row, state = _step(step, model, state, tokens[t], t)
        if key is None:
            chosen = jnp.argmax(row, axis=-1).astype(jnp.int32)
        else:
            scaled = row / jnp.asarray(temperature, row.dtype)
            chosen = jax.random.categorical(jax.random.fold_in(key, t), scaled).astype(jnp.int32)
        forced = t + 1 < n_prompt
        token = jnp.where(forced, tokens[jnp.minimum(t + 1, total - 1)], chosen)
        tokens = tokens.at[t + 1].set(token)
        at = jnp.maximum(t + 1 - n_prompt, 0)  # one row written in place, as the cache's
        logits = logits.at[at].set(jnp.where(forced, logits[at], row))
        if eos_id is not None:
            done = ~forced & (token == eos_id)
        return t + 1, tokens, logits, state, done

    init = (jnp.int32(0), tokens, logits, state, jnp.bool_(False))
    t, tokens, logits, _, _ = jax.lax.while_loop(cond, body, init)
    return tokens, logits, t + 1


# The functions of recent calls (the decode loop, and the run caching in it), by what
# makes them: the same function object each call, so that a run's warm call finds its
# last walk (`_fast.py`) rather than walking the model again.
_MADE: Bounded[tuple, Callable] = Bounded(64)


def _remembered(key: tuple, make: Callable[[], Callable]) -> Callable:
    try:
        made = _MADE.get(key)
    except TypeError:  # a part that cannot be hashed (a step, a list of names)
        return make()
    if made is None:
        made = _MADE[key] = make()
    _MADE.move_to_end(key)
    return made


def _decoder(step: Callable, max_new_tokens: int, eos_id: Any) -> Callable:
    def make() -> Callable:
        return functools.partial(_decode, step=step, new=static(max_new_tokens), eos_id=eos_id)

    if not (eos_id is None or type(eos_id) is int):  # an array: not a key
        return make()
    return _remembered(("decode", step, max_new_tokens, eos_id), make)


def _cached_decoder(decode: Callable, names_filter: NamesFilter, max_steps: int) -> Callable:
    """The decode loop in a run caching `names_filter` (run inside the hooks' run)."""

    def make() -> Callable:
        def cached(*a: Any) -> Any:
            return run_with_cache(decode, *a, names_filter=names_filter, max_steps=max_steps)

        return cached

    return _remembered(("cached", decode, names_filter, max_steps), make)


def generate(
    step: Callable,
    model: Any,
    state: Any,
    prompt: jax.Array,
    *,
    max_new_tokens: int,
    eos_id: int | jax.Array | None = None,
    key: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
    fwd_hooks: Sequence[tuple[NameSelector, Callable]] = (),
    names_filter: NamesFilter = None,
) -> Generation:
    """Decodes from a model with a KV cache, with hooks, in one compiled `while_loop`.

    **Arguments:**

    - `step`: `step(model, state, token, position) -> (logits, state)`: one decoding
        step: the model reads `token` (an `int32` scalar) at `position` with its KV
        cache `state`, and returns the next token's logits `(vocab,)` and the new cache.
    - `model`: the model (an Equinox or Flax NNX module, or any pytree), passed to `step`.
    - `state`: the initial KV cache (a pytree of arrays), big enough for
        `len(prompt) + max_new_tokens - 1` positions (the last step reads position
        `len(prompt) + max_new_tokens - 2`; the last new token is never read).
    - `prompt`: `(n,)` integer tokens, `n >= 1`. They are read one per step
        (teacher-forced), so hooks act on the prompt's positions as on the new ones.
    - `max_new_tokens`: a Python int, the number of tokens to generate at most.
    - `eos_id`: stop after generating this token (it is kept in `tokens`); an int
        or a traced scalar.
    - `key`: `None` decodes greedily (`argmax`); a PRNG key samples with
        `jax.random.categorical(jax.random.fold_in(key, position), logits / temperature)`,
        `position` the position of the token read.
    - `temperature`: the sampling temperature (an argument of the program: a sweep
        does not recompile).
    - `fwd_hooks`: as in [`jhooks.run_with_hooks`][]; `jhooks.loop_index()` in a
        hook gives `(position,)`, the position of the token read.
    - `names_filter`: points to cache at every step, as in [`jhooks.run_with_cache`][]
        with `max_steps = len(prompt) + max_new_tokens - 1`, after the hooks; `None`
        caches nothing (where `run_with_cache` caches every point).

    **Returns:**

    A [`jhooks.Generation`][]: `tokens`, `logits`, `length`, `cache`.

    The arrays that hooks close over are arguments of the compiled program, so
    steering with new vectors or coefficients traces once; `jax.vmap` over them and
    over prompts runs them together in one program. Works inside `jax.jit`.

    **Example:**

    ```python
    def steer(resid, name, c=2.0):
        return resid + c * direction

    out = jhooks.generate(step, model, cache, prompt, max_new_tokens=64,
                          fwd_hooks=[("blocks.*.hook_resid_post", steer)])
    ```
    """
    check_callable(step, "the step passed to jhooks.generate")
    if not (type(max_new_tokens) is int and max_new_tokens > 0):
        raise TypeError(
            f"jhooks.generate: max_new_tokens takes a positive Python int, got {max_new_tokens!r}."
        )
    if jnp.ndim(prompt) != 1 or jnp.shape(prompt)[0] < 1:
        raise ValueError(
            f"jhooks.generate: prompt must be a 1-D array of at least one token, got shape "
            f"{jnp.shape(prompt)} (vmap over a batch of prompts)."
        )
    decode = _decoder(step, max_new_tokens, eos_id)
    args = (model, state, jnp.asarray(prompt), key, temperature)
    if names_filter is None:
        tokens, logits, length = run_with_hooks(decode, *args, fwd_hooks=fwd_hooks)
        return Generation(tokens, logits, length, {})
    max_steps = int(jnp.shape(prompt)[0]) + max_new_tokens - 1
    if fwd_hooks:
        # The cache sees the values after the hooks: a run inside a run, as in
        # `run_with_hooks(lambda: run_with_cache(...))`.
        cached = _cached_decoder(decode, names_filter, max_steps)
        (tokens, logits, length), cache = run_with_hooks(cached, *args, fwd_hooks=fwd_hooks)
    else:
        (tokens, logits, length), cache = run_with_cache(
            decode, *args, names_filter=names_filter, max_steps=max_steps
        )
    return Generation(tokens, logits, length, cache)

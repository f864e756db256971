"""Hooks inside generation: `jhooks.generate` on a tiny GPT with a KV cache (Equinox,
and its Flax NNX twin), checked against decoding with no KV cache, a PyTorch twin with
forward hooks, `run_with_cache` on the final sequence teacher-forced, a Python-unrolled
decode, and a Python loop over coefficients and prompts.
"""

import functools
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jhooks
from benchmarks.decode_models import Config, make_gpt, step, torch_gpt, torch_greedy
from jhooks._runs._generate import _decode

RESID = "blocks.*.hook_resid_post"
MODEL = make_gpt(Config())
D = MODEL.cfg.d
DIRECTION = jax.random.normal(jax.random.key(3), (D,))
PROMPT = jnp.asarray([1, 5, 7, 2], jnp.int32)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def steer(resid, name, c):
    return resid + c * DIRECTION


def no_cache_decode(model, prompt, new, hooks):
    """Greedy decoding that recomputes the whole sequence at every step (no KV cache),
    with `hooks` on every position, compiled once."""
    n = prompt.shape[0]

    def decode(model, prompt):
        tokens = jnp.zeros((n + new,), jnp.int32).at[:n].set(prompt)

        def body(i, carry):
            tokens, logits = carry
            row = model(tokens)[n - 1 + i]  # causal: positions after it do not matter
            tokens = tokens.at[n + i].set(jnp.argmax(row).astype(jnp.int32))
            return tokens, logits.at[i].set(row)

        logits = jnp.zeros((new, model.cfg.vocab))
        return jax.lax.fori_loop(0, new, body, (tokens, logits))

    jit = nnx.jit if isinstance(model, nnx.Module) else jax.jit
    return jit(lambda m, p: jhooks.run_with_hooks(decode, m, p, fwd_hooks=hooks))(model, prompt)


C = jnp.float32(0.5)
HOOKS = [(RESID, functools.partial(steer, c=C))]


@functools.cache
def steered_without_kv_cache():
    """The Equinox model's steered greedy decode of 64 tokens, with no KV cache."""
    return no_cache_decode(MODEL, PROMPT, 64, HOOKS)


def test_steered_greedy_decode_equals_no_cache_and_pytorch(maybe_jit):
    run = maybe_jit(
        lambda m, cache, p: jhooks.generate(step, m, cache, p, max_new_tokens=64, fwd_hooks=HOOKS)
    )
    out = run(MODEL, MODEL.init_cache(), PROMPT)
    tokens, logits = steered_without_kv_cache()
    np.testing.assert_array_equal(out.tokens, tokens)
    close(out.logits, logits)
    assert int(out.length) == 68
    twin = torch_gpt(MODEL)
    steered = torch_greedy(twin, PROMPT, 64, torch.tensor(np.asarray(C * DIRECTION)))
    np.testing.assert_array_equal(out.tokens, steered)
    # The steering changes the tokens (so the comparisons above can fail).
    assert not np.array_equal(torch_greedy(twin, PROMPT, 64), steered)


def test_bounded_cache_with_eos_equals_the_teacher_forced_run(maybe_jit):
    decode = maybe_jit(
        lambda m, cache, p, k, eos_id: jhooks.generate(
            step, m, cache, p, max_new_tokens=60, key=k, eos_id=eos_id, names_filter=RESID
        )
    )

    def run(key, eos_id):
        return decode(MODEL, MODEL.init_cache(), PROMPT[:1], key, eos_id)

    # Sampled text, and a key whose text has a token first at position 37: the
    # end-of-sequence token (found, not hard-coded).
    for seed in range(20):
        key = jax.random.key(seed)
        free = run(key, None)
        eos = int(free.tokens[37])
        if eos not in np.asarray(free.tokens[:37]):
            break
    else:
        raise AssertionError("no key gives a new token at position 37")
    out = run(key, eos)
    assert int(out.length) == 38
    np.testing.assert_array_equal(out.tokens[:38], free.tokens[:38])
    np.testing.assert_array_equal(out.tokens[38:], 0)
    _, forced = jhooks.run_with_cache(MODEL, out.tokens[:37], names_filter=RESID)
    for layer in range(MODEL.cfg.layers):
        name = f"blocks.{layer}.hook_resid_post"
        assert out.cache[name].shape == (60, 1, D)
        close(out.cache[name][:37, 0], forced[name])
        np.testing.assert_array_equal(out.cache[name][37:], 0.0)
        np.testing.assert_array_equal(out.cache[name + "_valid"], np.arange(60) < 37)
        assert int(out.cache[name + "_steps"]) == 37 == int(out.length) - 1
    # The logits of the positions after the end-of-sequence token are zero rows too.
    assert out.logits.shape == (60, MODEL.cfg.vocab)
    np.testing.assert_array_equal(out.logits[37:], 0.0)
    assert not np.any(np.all(np.asarray(out.logits[:37]) == 0.0, axis=-1))


def test_sampling_is_categorical_on_logits_over_temperature_folded_by_position(maybe_jit):
    # The documented sampler: `jax.random.categorical(jax.random.fold_in(key, position),
    # logits / temperature)`, position the one of the token read.
    key, temperature, n = jax.random.key(11), 0.7, PROMPT.shape[0]
    run = maybe_jit(
        lambda m, c, p, k, t: jhooks.generate(
            step, m, c, p, max_new_tokens=12, key=k, temperature=t
        )
    )
    out = run(MODEL, MODEL.init_cache(), PROMPT, key, temperature)
    greedy = jhooks.generate(step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=12)
    close(out.logits[:1], greedy.logits[:1])  # the first row from the prompt alone
    expected = [
        int(jax.random.categorical(jax.random.fold_in(key, n - 1 + k), row / temperature))
        for k, row in enumerate(out.logits)
    ]
    np.testing.assert_array_equal(out.tokens[n:], expected)
    assert not np.array_equal(out.tokens, greedy.tokens)  # sampled, not greedy


def test_the_prompts_tokens_never_stop_the_loop():
    eos = int(PROMPT[1])  # in the prompt, read teacher-forced
    out = jhooks.generate(step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=5, eos_id=eos)
    plain = jhooks.generate(step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=5)
    assert eos not in np.asarray(plain.tokens[PROMPT.shape[0] :])  # no new token ends it
    assert int(out.length) == PROMPT.shape[0] + 5
    np.testing.assert_array_equal(out.tokens, plain.tokens)


def test_names_filter_none_caches_nothing_in_generate_and_everything_in_run_with_cache():
    out = jhooks.generate(step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=4)
    assert out.cache == {}
    _, cache = jhooks.run_with_cache(MODEL, PROMPT)  # names_filter=None: every point
    assert {f"blocks.{i}.hook_resid_post" for i in range(MODEL.cfg.layers)} <= set(cache)
    assert len(cache) > MODEL.cfg.layers


def test_the_cache_holds_the_values_after_the_hooks():
    out = jhooks.generate(
        step,
        MODEL,
        MODEL.init_cache(),
        PROMPT,
        max_new_tokens=6,
        fwd_hooks=HOOKS,
        names_filter=RESID,
    )
    # The teacher-forced run of the sequence read, steered, cached after its hooks.
    read = out.tokens[:-1]
    _, steered = jhooks.run_with_hooks(
        lambda m, x: jhooks.run_with_cache(m, x, names_filter=RESID), MODEL, read, fwd_hooks=HOOKS
    )
    _, plain = jhooks.run_with_cache(MODEL, read, names_filter=RESID)
    for layer in range(MODEL.cfg.layers):
        name = f"blocks.{layer}.hook_resid_post"
        close(out.cache[name][:, 0], steered[name])
        assert not np.allclose(out.cache[name][:, 0], plain[name], atol=1e-3)


def test_the_kv_cache_needs_len_prompt_plus_max_new_tokens_minus_1_positions():
    n, new = PROMPT.shape[0], 8
    full = jhooks.generate(step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=new)

    def generate_with(positions):
        cache = [(k[:positions], v[:positions]) for k, v in MODEL.init_cache()]
        return jhooks.generate(step, MODEL, cache, PROMPT, max_new_tokens=new)

    exact = generate_with(n + new - 1)  # the last step reads position n + new - 2
    np.testing.assert_array_equal(exact.tokens, full.tokens)
    close(exact.logits, full.logits)
    short = generate_with(n + new - 2)  # the last write lands on the row before (clamped)
    assert not np.allclose(short.logits[-1], full.logits[-1], atol=1e-3)


def patch_steps(resid, name, steps, n_prompt):
    # Generation step k reads the token at position n_prompt - 1 + k.
    (position,) = jhooks.loop_index()
    chosen = jnp.isin(position - (n_prompt - 1), jnp.asarray(steps))
    return jnp.where(chosen, -3.0 * resid, resid)


def test_patch_at_chosen_steps_equals_a_python_unrolled_decode(maybe_jit):
    n, new, steps = PROMPT.shape[0], 10, (1, 2)
    hooks = [("blocks.0.hook_resid_post", functools.partial(patch_steps, steps=steps, n_prompt=n))]
    run = maybe_jit(
        lambda m, c, p: jhooks.generate(step, m, c, p, max_new_tokens=new, fwd_hooks=hooks)
    )
    out = run(MODEL, MODEL.init_cache(), PROMPT)

    # The same decode in Python, one call per position, the hook given at steps 1 and 2 only.
    def one(m, cache, token, pos, patched):
        fwd = [("blocks.0.hook_resid_post", lambda r, _: -3.0 * r)] if patched else []
        return jhooks.run_with_hooks(step, m, cache, token, pos, fwd_hooks=fwd)

    tokens, cache = list(np.asarray(PROMPT)), MODEL.init_cache()
    for pos in range(n + new - 1):
        row, cache = one(
            MODEL, cache, jnp.int32(tokens[pos]), jnp.int32(pos), pos - (n - 1) in steps
        )
        if pos + 1 >= n:
            tokens.append(int(jnp.argmax(row)))
    np.testing.assert_array_equal(out.tokens, tokens)
    plain = jhooks.generate(step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=new)
    assert not np.array_equal(plain.tokens, tokens)  # the patch changes the text


def prefill(model, cache, prompt):
    """The prompt read in one call of the model, before the loop: the last logits, the cache."""
    x = model.embed[prompt] + model.pos_embed[: prompt.shape[0]]
    new = []
    for block, kv in zip(model.blocks, cache):
        x, kv = block(x, kv, 0)
        new.append(kv)
    return model._logits(x)[-1], new


def prefill_decode(model, cache, prompt, max_new_tokens):
    # docs/generation.md's recipe: a prefill outside the loop, then one step per new token.
    n = len(prompt)
    total = n + max_new_tokens
    logits, cache = prefill(model, cache, prompt)
    tokens = jnp.zeros(total, jnp.int32).at[:n].set(prompt).at[n].set(jnp.argmax(logits))

    def body(carry):
        t, tokens, cache = carry
        logits, cache = step(model, cache, tokens[t], t)
        return t + 1, tokens.at[t + 1].set(jnp.argmax(logits).astype(jnp.int32)), cache

    return jax.lax.while_loop(lambda c: c[0] < total - 1, body, (n, tokens, cache))[1]


def patch_steps_after_a_prefill(resid, name):
    index = jhooks.loop_index()
    if not index:  # the prefill, outside the loop: `()`
        return resid
    (i,) = index  # iteration i reads position n + i: generation step i + 1
    return jnp.where((i + 1 == 1) | (i + 1 == 2), -3.0 * resid, resid)


def test_the_recipe_with_a_prefill_outside_the_loop(maybe_jit):
    n, new, point = PROMPT.shape[0], 10, "blocks.0.hook_resid_post"
    decode = functools.partial(prefill_decode, max_new_tokens=new)
    hooks = [(point, patch_steps_after_a_prefill)]
    tokens = maybe_jit(lambda m, c, p: jhooks.run_with_hooks(decode, m, c, p, fwd_hooks=hooks))(
        MODEL, MODEL.init_cache(), PROMPT
    )
    generated = jhooks.generate(
        step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=new,
        fwd_hooks=[(point, functools.partial(patch_steps, steps=(1, 2), n_prompt=n))],
    )  # fmt: skip
    np.testing.assert_array_equal(tokens, generated.tokens)
    # Outside the loop `loop_index()` is `()`: the generate hook's `(position,) = ...` fails.
    hook = functools.partial(patch_steps, steps=(1, 2), n_prompt=n)
    with pytest.raises(ValueError, match="not enough values to unpack"):
        jhooks.run_with_hooks(decode, MODEL, MODEL.init_cache(), PROMPT, fwd_hooks=[(point, hook)])
    # The prefill's call of a point and the loop's are two points: `name` and `name:1`.
    _, cache = jhooks.run_with_cache(
        decode, MODEL, MODEL.init_cache(), PROMPT, names_filter=point, max_steps=new - 1
    )
    assert cache[point].shape == (n, D)
    assert cache[point + ":1"].shape == (new - 1, 1, D)
    assert int(cache[point + ":1_steps"]) == new - 1


def test_vmap_over_coefficients_and_prompts_equals_a_python_loop():
    coefficients = jnp.asarray([0.0, 0.5, -1.0], jnp.float32)
    prompts = jnp.asarray([[1, 5, 7, 2], [3, 3, 9, 4]], jnp.int32)

    def decode(c, prompt):
        hooks = [(RESID, functools.partial(steer, c=c))]
        return jhooks.generate(
            step, MODEL, MODEL.init_cache(), prompt, max_new_tokens=12, fwd_hooks=hooks
        )

    both = jax.jit(jax.vmap(jax.vmap(decode, (None, 0)), (0, None)))(coefficients, prompts)
    assert both.tokens.shape == (3, 2, 16)
    for i, c in enumerate(coefficients):
        for j, prompt in enumerate(prompts):
            one = decode(c, prompt)
            np.testing.assert_array_equal(both.tokens[i, j], one.tokens)
            close(both.logits[i, j], one.logits)


def test_a_sweep_of_steering_values_traces_once(settled_hook_state):
    traces = []

    def counted(model, cache, token, pos):
        traces.append(1)
        return step(model, cache, token, pos)

    outs = []
    for c in (0.0, 0.5, 1.0):
        hooks = [(RESID, functools.partial(steer, c=jnp.float32(c)))]
        outs.append(
            jhooks.generate(
                counted, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=6, fwd_hooks=hooks
            )
        )
    # Traced once for the logits' shape and once in the loop's body, in the one program.
    assert len(traces) == 2
    assert not np.array_equal(outs[0].tokens, outs[2].tokens)


class Steering:
    """A callable instance whose coefficient (a Python float) and direction (a NumPy
    array, changed in place) change between calls."""

    def __init__(self, c):
        self.c = c
        self.direction = np.ones(D, np.float32)

    def __call__(self, resid, name):
        return resid + self.c * self.direction


def test_a_callable_instance_changed_between_calls_steers_as_written(settled_hook_state, frozen_gc):
    """Attributes and in-place NumPy changes are read on each call (the oracle: the same
    steering written by hand, decoded without a KV cache); nothing leaks; threads running
    the same decode get their own numbers; the hook runs on every call."""
    hook = Steering(1.0)

    def decode(h):
        return jhooks.generate(
            step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=6, fwd_hooks=[(RESID, h)]
        ).tokens

    def oracle(c, direction):
        fixed = direction.copy()
        tokens, _ = no_cache_decode(MODEL, PROMPT, 6, [(RESID, lambda r, n: r + c * fixed)])
        return tokens

    with jax.checking_leaks():
        for c in (1.0, -4.0, 3.0):
            hook.c = c
            hook.direction[: D // 2] = c  # in place
            np.testing.assert_array_equal(decode(hook), oracle(c, hook.direction))
    traces = []

    class Counted(Steering):
        def __call__(self, resid, name):
            traces.append(name)
            return super().__call__(resid, name)

    expected = {c: oracle(c, np.ones(D, np.float32)) for c in (0.5, -3.0)}
    for i in range(20):  # fresh instances, alternating values
        c = (0.5, -3.0)[i % 2]
        np.testing.assert_array_equal(decode(Counted(c)), expected[c])
    # The instance is not pure: it runs on values, as PyTorch runs it, once per point
    # per model step (`step` reads one token a step: the prompt's, then each new one
    # but the last).
    assert len(traces) == 20 * (len(PROMPT) + 6 - 1) * MODEL.cfg.layers
    wrong = []

    def worker(c):
        for _ in range(5):
            if not np.array_equal(decode(Counted(c)), expected[c]):
                wrong.append(c)

    threads = [threading.Thread(target=worker, args=(c,)) for c in (0.5, -3.0, 0.5, -3.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


OP = re.compile(r"=\s*\S+\s+([a-z][\w\-]*)\(")


def compiled_ops(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [m.group(1) for line in text.splitlines() if (m := OP.search(line))]


def test_generate_with_no_hook_or_an_identity_hook_compiles_to_the_plain_decode_loop():
    decode = functools.partial(_decode, step=step, new=8, eos_id=None)
    args = (MODEL, MODEL.init_cache(), PROMPT)
    plain = compiled_ops(lambda m, c, p: decode(m, c, p, None, 1.0), *args)
    for hooks in ([], [(RESID, lambda v, name: v)]):
        ops = compiled_ops(
            lambda m, c, p, hooks=hooks: jhooks.generate(
                step, m, c, p, max_new_tokens=8, fwd_hooks=hooks
            )[:3],
            *args,
        )
        assert ops == plain
    assert "while" in plain and "dot" in plain  # the comparison is over a real program


def test_generate_errors():
    with pytest.raises(TypeError, match=r"max_new_tokens takes a positive Python int, got 0"):
        jhooks.generate(step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"prompt must be a 1-D array of at least one token"):
        jhooks.generate(step, MODEL, MODEL.init_cache(), PROMPT[None], max_new_tokens=2)


# -- the Flax NNX twin -----------------------------------------------------------------


class NNXAttention(nnx.Module):
    def __init__(self, cfg, rngs):
        self.qkv = nnx.Linear(cfg.d, 3 * cfg.d, rngs=rngs)
        self.out = nnx.Linear(cfg.d, cfg.d, rngs=rngs)
        self.heads = cfg.heads

    def __call__(self, x, kv, pos):
        t, d = x.shape
        q, k, v = (a.reshape(t, self.heads, -1) for a in jnp.split(self.qkv(x), 3, -1))
        if kv is None:
            keys, values, q_pos = k, v, jnp.arange(t)
        else:
            keys = jax.lax.dynamic_update_slice_in_dim(kv[0], k, pos, 0)
            values = jax.lax.dynamic_update_slice_in_dim(kv[1], v, pos, 0)
            q_pos, kv = pos + jnp.arange(t), (keys, values)
        scores = jnp.einsum("thd,shd->hts", q, keys) * np.float32(1 / np.sqrt(d // self.heads))
        k_pos = jnp.arange(keys.shape[0])
        scores = jnp.where(k_pos[None, None, :] <= q_pos[None, :, None], scores, np.float32(-1e9))
        z = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, axis=-1), values)
        return self.out(z.reshape(t, d)), kv


class NNXBlock(nnx.Module):
    def __init__(self, cfg, rngs):
        self.ln1 = nnx.LayerNorm(cfg.d, epsilon=1e-5, rngs=rngs)
        self.attn = NNXAttention(cfg, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d, epsilon=1e-5, rngs=rngs)
        self.fc1 = nnx.Linear(cfg.d, 4 * cfg.d, rngs=rngs)
        self.fc2 = nnx.Linear(4 * cfg.d, cfg.d, rngs=rngs)

    def __call__(self, x, kv=None, pos=0):
        a, kv = self.attn(self.ln1(x), kv, pos)
        x = x + a
        x = x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)), approximate=True))
        return jhooks.hook_point(x, "hook_resid_post"), kv


class NNXGPT(nnx.Module):
    def __init__(self, eqx_model):
        cfg = eqx_model.cfg
        rngs = nnx.Rngs(0)
        self.cfg = cfg
        self.embed = nnx.Param(eqx_model.embed)
        self.pos_embed = nnx.Param(eqx_model.pos_embed)
        self.unembed = nnx.Param(eqx_model.unembed)
        self.ln_f = nnx.LayerNorm(cfg.d, epsilon=1e-5, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(cfg, rngs) for _ in range(cfg.layers)])
        linear = lambda ours, theirs: (  # noqa: E731
            ours.kernel.set_value(theirs.weight.T),
            ours.bias.set_value(theirs.bias),
        )
        norm = lambda ours, theirs: (  # noqa: E731
            ours.scale.set_value(theirs.weight),
            ours.bias.set_value(theirs.bias),
        )
        norm(self.ln_f, eqx_model.ln_f)
        for ours, theirs in zip(self.blocks, eqx_model.blocks):
            linear(ours.attn.qkv, theirs.attn.qkv)
            linear(ours.attn.out, theirs.attn.out)
            linear(ours.fc1, theirs.fc1)
            linear(ours.fc2, theirs.fc2)
            norm(ours.ln1, theirs.ln1)
            norm(ours.ln2, theirs.ln2)

    def __call__(self, tokens):
        x = self.embed[...][tokens] + self.pos_embed[...][: tokens.shape[0]]
        for block in self.blocks:
            x, _ = block(x)
        return self.ln_f(x) @ self.unembed[...]


def nnx_step(model, cache, token, pos):
    x = (model.embed[...][token] + model.pos_embed[...][pos])[None]
    new = []
    for block, kv in zip(model.blocks, cache):
        x, kv = block(x, kv, pos)
        new.append(kv)
    return (model.ln_f(x) @ model.unembed[...])[0], new


def test_nnx_steered_decode_equals_no_cache_and_equinox(maybe_jit):
    model = jhooks.hookable(NNXGPT(MODEL))
    call = nnx.jit if maybe_jit is jax.jit else (lambda f: f)
    out = call(
        lambda m, cache, p: jhooks.generate(
            nnx_step, m, cache, p, max_new_tokens=64, fwd_hooks=HOOKS
        )
    )(model, MODEL.init_cache(), PROMPT)
    tokens, logits = no_cache_decode(model, PROMPT, 64, HOOKS)
    np.testing.assert_array_equal(out.tokens, tokens)
    close(out.logits, logits)
    # The Equinox model with the same weights, with no KV cache.
    tokens, logits = steered_without_kv_cache()
    np.testing.assert_array_equal(out.tokens, tokens)
    close(out.logits, logits)


def test_benchmark_harness_runs(tmp_path):
    from benchmarks import decode as bench

    out = tmp_path / "decode.json"
    saved = bench.main(["--quick", "--out", str(out)])
    assert set(saved["per_token"]["us_per_token"]) == {
        "plain",
        "steer",
        "cache",
        "direct",
        "direct_cache",
    }
    assert saved["sweep"]["tiny"]["equal_tokens"] and saved["sweep"]["tiny"]["vmap_speedup"] > 0
    assert set(saved["targets"]) == {"steer", "cache", "direct", "vmap_speedup_tiny"}
    assert out.exists()


def test_a_warm_call_with_hooks_and_a_cache_does_not_walk_the_model_again(monkeypatch):
    # Hooks and a cache: the decode loop runs in a run caching it, inside the hooks'
    # run. That inner function is the same object on every call, so that a warm call
    # finds its last walk of the model (`_fast.py`): it was made anew on each call, and
    # every call walked the model again (1.27x the plain decode rather than 1.15x,
    # 4 layers, d_model 128, 64 tokens).
    from jhooks._runs import _programs

    walks = []
    walk_roots = _programs.walk_roots

    def counted(*args, **kwargs):
        walks.append(1)
        return walk_roots(*args, **kwargs)

    monkeypatch.setattr(_programs, "walk_roots", counted)
    outs, kv_cache = [], MODEL.init_cache()
    for _ in range(3):
        out = jhooks.generate(
            step,
            MODEL,
            kv_cache,
            PROMPT,
            max_new_tokens=8,
            fwd_hooks=HOOKS,
            names_filter="blocks.0.hook_resid_post",
        )
        outs.append((out, len(walks)))
    (first, after_first), (second, after_second), (third, after_third) = outs
    # The first call traces; the second walks once more and remembers its walk (a
    # call that traced does not); from the third on, none.
    assert after_first >= 1 and after_third == after_second, [n for _, n in outs]
    np.testing.assert_array_equal(third.tokens, first.tokens)
    close(third.cache["blocks.0.hook_resid_post"], first.cache["blocks.0.hook_resid_post"])
    # The cache holds the steered values (so that a stale cache would differ).
    _, plain = jhooks.run_with_cache(MODEL, first.tokens[:11], names_filter=RESID)
    steered_first = plain["blocks.0.hook_resid_post"][0] + C * DIRECTION
    close(third.cache["blocks.0.hook_resid_post"][0, 0], steered_first)


def test_a_hook_is_called_once_per_point_where_generate_is_traced():
    # Under the user's jit a hook's Python runs once per trace of its point (JAX's
    # rule). The logits' shape is traced apart, with no run active there: the hook is
    # called for the decode loop's point only (it was called there too: twice per
    # layer, issue 43).
    calls = []

    def count(resid, name):
        calls.append(str(name))
        return resid + C * DIRECTION

    run = jax.jit(
        lambda m, cache, p: jhooks.generate(
            step, m, cache, p, max_new_tokens=8, fwd_hooks=[(RESID, count)]
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # told once per compilation: this test's point
        out = run(MODEL, MODEL.init_cache(), PROMPT)
    layers = [f"blocks.{i}.hook_resid_post" for i in range(MODEL.cfg.layers)]
    assert calls == layers
    expected = jhooks.generate(
        step, MODEL, MODEL.init_cache(), PROMPT, max_new_tokens=8, fwd_hooks=HOOKS
    )
    np.testing.assert_array_equal(out.tokens, expected.tokens)

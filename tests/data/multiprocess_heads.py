"""The tensor-parallel half of tests/test_multiprocess.py: a one-layer attention model whose
heads are split over the devices, and the computations both sides check.

`multiprocess_worker.py` places the weights' head axis on a `heads` mesh of the 4 devices of
both processes; the test runs the same functions on one device. Each function returns NumPy
trees or jax arrays; the worker gathers them.
"""

import functools
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jhooks

HEADS, D, E, VOCAB, POSITIONS = 4, 8, 2, 11, 8  # one head per device
IDS = np.array([3, 1, 4, 1, 5, 9], np.int32)
PROMPT, NEW = np.array([1, 5, 7, 2], np.int32), 4  # positions read: 4 + 4 - 1 <= POSITIONS
NAMES = ["attn.hook_out", "attn/softmax"]  # a point name and an operation address
HEAD_SCALE = np.array([1.0, 0.5, 2.0, 0.0], np.float32)  # a patch of the pattern, by head
DIRECTION = np.linspace(-1.0, 1.0, D).astype(np.float32)  # a steering vector
LR = 0.5
STEPS = 2
CLAMP = 0.002  # the value hook's bound on the pattern's gradient


class Attention(eqx.Module):
    """Causal attention with the heads on the weights' first axis (split over devices)."""

    wq: jax.Array  # (HEADS, D, E)
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array  # (HEADS, E, D)

    def __call__(self, x, kv=None, position=0):
        """`x` (T, D); with `kv` (keys, values of (HEADS, POSITIONS, E)), a decoding step
        that writes them at `position`. Returns the output (T, D) and the new `kv`."""
        q, k, v = (jnp.einsum("td,hde->hte", x, w) for w in (self.wq, self.wk, self.wv))
        if kv is None:
            q_pos = jnp.arange(x.shape[0])
        else:
            k = jax.lax.dynamic_update_slice_in_dim(kv[0], k, position, 1)
            v = jax.lax.dynamic_update_slice_in_dim(kv[1], v, position, 1)
            q_pos, kv = position + jnp.arange(x.shape[0]), (k, v)
        scores = jnp.einsum("hqe,hke->hqk", q, k) / math.sqrt(E)
        causal = jnp.arange(k.shape[1])[None, None, :] <= q_pos[None, :, None]
        pattern = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        z = jnp.einsum("hqk,hke->hqe", pattern, v)
        out = jnp.einsum("hqe,hed->qd", z, self.wo)  # the sum over heads
        return jhooks.hook_point(out, "hook_out"), kv


class TinyLM(eqx.Module):
    embed: jax.Array  # (VOCAB, D)
    pos_embed: jax.Array  # (POSITIONS, D)
    attn: Attention
    unembed: jax.Array  # (D, VOCAB)

    def __call__(self, ids):
        x = self.embed[ids] + self.pos_embed[: ids.shape[0]]
        a, _ = self.attn(x)
        return jnp.tanh(x + a) @ self.unembed


def init():
    """The hookable model with NumPy leaves, the same in every process."""
    rng = np.random.default_rng(7)

    def normal(*shape):
        return (rng.standard_normal(shape) / math.sqrt(shape[-2])).astype(np.float32)

    attn = Attention(
        normal(HEADS, D, E), normal(HEADS, D, E), normal(HEADS, D, E), normal(HEADS, E, D)
    )
    return jhooks.hookable(TinyLM(normal(VOCAB, D), normal(POSITIONS, D), attn, normal(D, VOCAB)))


def init_kv():
    return tuple(np.zeros((HEADS, POSITIONS, E), np.float32) for _ in range(2))


def head_axis_leaves(model):
    """A tree like `model`: True for the leaves whose first axis is the heads."""
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: [m.attn.wq, m.attn.wk, m.attn.wv, m.attn.wo], spec, [True] * 4)


def loss(model, ids):
    """Next-token cross-entropy, summed."""
    logits = model(ids)
    return -jnp.sum(jax.nn.log_softmax(logits[:-1])[jnp.arange(ids.shape[0] - 1), ids[1:]])


def patch_pattern(pattern, name):
    return pattern * HEAD_SCALE[:, None, None]


def halve(value, name):
    return 0.5 * value


def clamp_grad(grad, name):
    return jnp.clip(grad, -0.01, 0.01)


def cache_run(model, ids):
    """The loss, and the cache of a point and an address with their gradients."""
    return jhooks.run_with_cache(loss, model, ids, names_filter=NAMES, incl_bwd=True)


def hooks_run(model, ids):
    """The loss and its parameter gradients with forward hooks on a point and an address
    and a backward hook on the point."""
    fwd = [("attn.hook_out", halve), ("attn/softmax", patch_pattern)]
    bwd = [("attn.hook_out", clamp_grad)]
    return eqx.filter_value_and_grad(
        lambda m: jhooks.run_with_hooks(loss, m, ids, fwd_hooks=fwd, bwd_hooks=bwd)
    )(model)


cached, hooked = jax.jit(cache_run), jax.jit(hooks_run)


def loss_and_grads(names):
    """A program: the loss, its parameter gradients and the cache of `names` (for the
    collectives with and without a cache)."""

    def run(model, ids):
        (value, cache), grads = eqx.filter_value_and_grad(
            lambda m: jhooks.run_with_cache(loss, m, ids, names_filter=names), has_aux=True
        )(model)
        return value, grads, cache

    return run


def clamped_pattern(pattern, name):
    """A forward hook that puts a value hook on the pattern: its gradient clamped."""
    return jhooks.register_hook(pattern, lambda g: jnp.clip(g, -CLAMP, CLAMP))


@eqx.filter_jit
def train_step(model, ids, value_hook):
    def hooked_loss(m):
        fwd = [("attn/softmax", clamped_pattern)] if value_hook else []
        return jhooks.run_with_hooks(loss, m, ids, fwd_hooks=fwd)

    value, grads = eqx.filter_value_and_grad(hooked_loss)(model)
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads)), value


def train(model, ids, module_hook=True, value_hook=True):
    """`STEPS` jitted SGD steps with (`value_hook`) a value hook clamping the pattern's
    gradient and (`module_hook`) a forward hook on `attn` clipping its output; the final
    model and the losses. The module hook is removed afterwards."""
    handle = None
    if module_hook:
        handle = model.attn.register_forward_hook(
            lambda m, args, out: (jnp.clip(out[0], -0.3, 0.3), out[1])
        )
    try:
        losses = []
        for _ in range(STEPS):
            # One step in flight at a time (see `multiprocess_worker.train`).
            model, value = jax.block_until_ready(train_step(model, ids, value_hook))
            losses.append(value)
    finally:
        if handle is not None:
            handle.remove()
    return model, jnp.stack(losses)


def decode_step(model, kv, token, position):
    x = (model.embed[token] + model.pos_embed[position])[None]
    a, kv = model.attn(x, kv, position)
    return (jnp.tanh(x + a) @ model.unembed)[0], kv


def steer(value, name, coefficient):
    return value + coefficient * DIRECTION


@jax.jit
def generated(model, kv, prompt, coefficient):
    """Greedy decoding of `NEW` tokens with `DIRECTION` added to the attention's output."""
    hook = functools.partial(steer, coefficient=coefficient)
    out = jhooks.generate(
        decode_step, model, kv, prompt, max_new_tokens=NEW, fwd_hooks=[("attn.hook_out", hook)]
    )
    return out.tokens, out.logits, out.length


def file_name(name):
    return name.replace("/", "~")


def results(model, kv, log=lambda what: None):
    """Every checked value, by file name: the same on one device and split by head."""
    out = {}
    for prefix, run_cache, run_hooks in (("", cached, hooked), ("eager_", cache_run, hooks_run)):
        value, cache = run_cache(model, IDS)
        out[f"{prefix}cached_loss"] = value
        out |= {f"{prefix}cache_{file_name(name)}": v for name, v in cache.items()}
        value, grads = run_hooks(model, IDS)
        out[f"{prefix}hooked_loss"] = value
        named = jhooks.named_parameters(grads)
        out |= {f"{prefix}hooked_grad_{name}": g for name, g in named}
        log(f"heads: {prefix or 'jitted '}cache and hooks")
    trained, losses = train(model, IDS)
    out["trained_losses"] = losses
    out |= {f"trained_{name}": p for name, p in jhooks.named_parameters(trained)}
    log("heads: trained")
    out["tokens"], out["logits"], out["length"] = generated(model, kv, PROMPT, np.float32(3.0))
    return out


def run_sharded(folder, log):
    """In each of the processes: the model with its heads split over every device of
    both, `results` gathered to FOLDER/tp_*.npy, and the collectives of the compiled
    programs with and without a cache, with the caches' shardings, to FOLDER/tp.json."""
    import json
    import os

    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("heads",))

    def place(a, by_head):
        sharding = NamedSharding(mesh, P("heads") if by_head else P())
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    def gathered(a):
        if a.is_fully_replicated:
            return np.asarray(a.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    model = init()
    model = jax.tree.map(
        lambda a, by_head: place(a, by_head) if eqx.is_array(a) else a,
        model,
        head_axis_leaves(model),
    )
    kv = tuple(place(a, True) for a in init_kv())
    assert not model.attn.wq.is_fully_addressable  # the heads really are split over both
    for name, value in results(model, kv, log).items():
        np.save(os.path.join(folder, f"tp_{name}.npy"), gathered(value))
    log("heads: generated, gathered")
    _, cache = cached(model, IDS)
    report = {
        "specs": {name: str(v.sharding.spec) for name, v in cache.items()},
        "fully_addressable": {name: v.is_fully_addressable for name, v in cache.items()},
        "collectives": {
            label: collectives(loss_and_grads(names), model, IDS)
            for label, names in (("none", []), ("cached", NAMES))
        },
    }
    with open(os.path.join(folder, "tp.json"), "w") as f:
        json.dump(report, f)
    log("heads: compiled with and without the cache")


COLLECTIVE = re.compile(
    r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)


def collectives(fn, *args):
    """The collectives of the optimized program, sorted (an async `-start` counts as one)."""
    return sorted(COLLECTIVE.findall(jax.jit(fn).lower(*args).compile().as_text()))

"""TransformerLens' hook tests, case by case, on jhooks.

`tests/integration/test_hooks.py` (v2.16.0; `tests/unit/test_hooks.py` before it moved)
runs a pretrained `solu-1l`; these run a small HookedTransformer-like model built in
Equinox, with TransformerLens' point names, and a PyTorch twin with the same weights
where a value is compared. `tests/unit/test_hook_points.py` checks `HookPoint`'s lists
of hooks; its translatable case is the order of prepended hooks. Tests are named
`test_<file>_<case>`; the cases not translated are listed in docs/pytorch.md.

TransformerLens keeps hooks on the model (`add_hook`, `model.hooks(...)`); jhooks has
per-call hooks (`run_with_hooks`) and module hooks that return a handle, usable as a
context manager. A "permanent" hook is a module hook kept registered.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

D_VOCAB, D_MODEL = 7, 4


class Embed(jhooks.Module):
    W_E: jax.Array

    def __call__(self, tokens):
        return self.W_E[tokens]


class Block(jhooks.Module):
    W: jax.Array

    def __call__(self, resid):
        return resid + jnp.tanh(resid @ self.W)


class Unembed(jhooks.Module):
    W_U: jax.Array
    b_U: jax.Array

    def __call__(self, resid):
        return resid @ self.W_U + self.b_U


class TinyTransformer(jhooks.Module):
    embed: Embed
    block: Block
    unembed: Unembed

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = Embed(jax.random.normal(k1, (D_VOCAB, D_MODEL)))
        self.block = Block(jax.random.normal(k2, (D_MODEL, D_MODEL)) / 2)
        self.unembed = Unembed(
            jax.random.normal(k3, (D_MODEL, D_VOCAB)), jax.random.normal(k4, (D_VOCAB,))
        )

    def __call__(self, tokens):
        # As in TransformerLens, `hook_embed` is a point of the model itself; the block's
        # point is named in full here (a point inside `self.block`'s call would be
        # scoped under its path, `block.`).
        resid = jhooks.hook_point(self.embed(tokens), "hook_embed")
        resid = jhooks.hook_point(self.block(resid), "blocks.0.hook_resid_post")
        return self.unembed(resid)


class TorchTinyTransformer(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.W_E = torch.nn.Parameter(torch.tensor(np.asarray(m.embed.W_E)))
        self.W = torch.nn.Parameter(torch.tensor(np.asarray(m.block.W)))
        self.W_U = torch.nn.Parameter(torch.tensor(np.asarray(m.unembed.W_U)))
        self.b_U = torch.nn.Parameter(torch.tensor(np.asarray(m.unembed.b_U)))

    def forward(self, tokens, embed_grad_hook=None, resid_hooks=()):
        x = self.W_E[tokens]
        if embed_grad_hook is not None:
            x.register_hook(embed_grad_hook)
        x = x + torch.tanh(x @ self.W)
        for hook in resid_hooks:
            x = hook(x)
        return x @ self.W_U + self.b_U


model = TinyTransformer(jax.random.PRNGKey(0))
tokens = jnp.array([1, 4, 2, 6])  # "Hello World!" is 4 tokens for solu-1l too
embed = lambda name: name == "hook_embed"  # noqa: E731


class Counter:
    def __init__(self):
        self.count = 0

    def inc(self, *args, **kwargs):
        self.count += 1


def test_hooks_test_hook_attaches_normally(maybe_jit):
    c = Counter()
    maybe_jit(lambda t: jhooks.run_with_hooks(model, t, fwd_hooks=[(embed, c.inc)]))(tokens)
    assert c.count == 1
    maybe_jit(lambda t: jhooks.run_with_hooks(model, t))(tokens)  # nothing stays attached
    assert c.count == 1


def test_hooks_test_perma_hook_attaches_normally(maybe_jit):
    c = Counter()
    with model.embed.register_forward_hook(c.inc):  # the permanent hook: a module hook
        maybe_jit(lambda t: jhooks.run_with_hooks(model, t, fwd_hooks=[]))(tokens)
        assert c.count == 1


def test_hooks_test_hook_context_manager(maybe_jit):
    c = Counter()
    with model.embed.register_forward_hook(c.inc):
        maybe_jit(lambda t: model(t))(tokens)
    maybe_jit(lambda t: model(t) * 1.0)(tokens)
    assert c.count == 1


def test_hooks_test_nested_hook_context_manager(maybe_jit):
    c = Counter()
    with model.embed.register_forward_hook(c.inc):
        maybe_jit(lambda t: model(t))(tokens)
        assert c.count == 1
        with model.embed.register_forward_hook(c.inc):
            maybe_jit(lambda t: model(t) + 1.0)(tokens)
            assert c.count == 3  # 2 from the outer hook, 1 from the inner
    maybe_jit(lambda t: model(t) + 2.0)(tokens)
    assert c.count == 3


def test_the_nested_hooks_count_with_a_run_inside_a_run(maybe_jit):
    """The same count with runs, called again and again: TransformerLens' `model.hooks`
    context is a run here, the inner context a run inside the outer run's function.
    Each call: the outer run's hook at the embedding it reaches alone, then both hooks
    at the inner run's: 1 + 2. Under jit, one trace (JAX's rule)."""
    c = Counter()

    def both(t):
        return model(t) + jhooks.run_with_hooks(model, t, fwd_hooks=[(embed, c.inc)])

    call = maybe_jit(lambda t: jhooks.run_with_hooks(both, t, fwd_hooks=[(embed, c.inc)]))
    for i in range(1, 4):
        call(tokens)
        assert c.count == (3 if maybe_jit is jax.jit else 3 * i), (i, c.count)
    np.testing.assert_allclose(call(tokens), 2 * model(tokens), rtol=1e-6)


def test_hooks_test_context_manager_run_with_cache(maybe_jit):
    c = Counter()
    with model.embed.register_forward_hook(c.inc):
        _, cache = maybe_jit(lambda t: jhooks.run_with_cache(model, t))(tokens)
    assert c.count == 1
    assert cache["hook_embed"].shape == (4, D_MODEL)


def test_hooks_test_backward_hook_runs_successfully(maybe_jit):
    # A backward hook returning `(grad,)`, as TransformerLens' hooks may, replaces the
    # gradient with grad: the same gradients as without it, and as PyTorch's.
    c = Counter()

    def skip_grad(output_grad, hook):
        c.inc()
        return (output_grad * 2.0,)

    def loss(m, t):
        return jnp.sum(jhooks.run_with_hooks(m, t, bwd_hooks=[(embed, skip_grad)]))

    grads = maybe_jit(jax.grad(loss))(model, tokens)
    assert c.count == 1
    tm = TorchTinyTransformer(model)
    tm(torch.tensor(np.asarray(tokens)), embed_grad_hook=lambda g: g * 2.0).sum().backward()
    assert tm.W_E.grad is not None
    np.testing.assert_allclose(grads.embed.W_E, tm.W_E.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_backward_hook_runs_in_the_backward_pass_as_transformer_lens_counts():
    # TransformerLens' backward hook test counts 0 after the forward and 1 after
    # `backward()`: an eager run calls a backward hook with side effects in the backward
    # pass, once per backward pass, with the concrete gradient.
    c = Counter()
    grads = []

    def count_grad(output_grad, hook):
        c.inc()
        grads.append(output_grad)

    out, pull = eqx.filter_vjp(
        lambda m: jnp.sum(jhooks.run_with_hooks(m, tokens, bwd_hooks=[(embed, count_grad)])),
        model,
    )
    assert c.count == 0
    pull(jnp.ones_like(out))
    assert c.count == 1
    pull(jnp.ones_like(out) * 2.0)
    assert c.count == 2
    tm = TorchTinyTransformer(model)
    seen = []
    tm(torch.tensor(np.asarray(tokens)), embed_grad_hook=lambda g: seen.append(g)).sum().backward()
    assert not isinstance(grads[0], jax.core.Tracer)
    np.testing.assert_allclose(grads[0], seen[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1], 2.0 * seen[0].numpy(), rtol=1e-5, atol=1e-6)


def test_hooks_test_hook_context_manager_with_permanent_hook(maybe_jit):
    c = Counter()
    with model.embed.register_forward_hook(c.inc):
        with model.embed.register_forward_hook(c.inc):
            maybe_jit(lambda t: model(t))(tokens)
        assert c.count == 2  # 1 from the permanent hook, 1 from the context manager


def test_hooks_test_nested_context_manager_with_failure():
    def fail_hook(m, args, out):
        raise ValueError("fail")

    c = Counter()
    with model.embed.register_forward_hook(c.inc):
        with pytest.raises(ValueError, match="fail"):
            with model.embed.register_forward_hook(fail_hook):
                model(tokens)
        assert c.count == 1
        model(tokens)  # the failing hook is gone
        assert c.count == 2
    model(tokens)
    assert c.count == 2


@pytest.mark.parametrize("zero_attach_pos", [0, 1])
@pytest.mark.parametrize("prepend", [True, False])
def test_hooks_test_prepending_hooks(zero_attach_pos, prepend, maybe_jit):
    # Two forward hooks on the block's output: one zeroes it, one replaces it with
    # noise. The logits are the unembedding bias exactly when the zero hook runs last.
    def set_to_zero(m, args, out):
        return jnp.zeros_like(out)

    def set_to_randn(m, args, out):
        return jax.random.normal(jax.random.PRNGKey(1), out.shape) * 0.1

    handles = [
        model.block.register_forward_hook(
            set_to_zero if i == zero_attach_pos else set_to_randn, prepend=prepend
        )
        for i in range(2)
    ]
    try:
        logits = maybe_jit(lambda t: model(t))(jnp.arange(5))
    finally:
        for h in handles:
            h.remove()
    expected = (zero_attach_pos == 1) != prepend
    assert bool(jnp.allclose(logits, model.unembed.b_U[None, :])) == expected

    # PyTorch module hooks, as TransformerLens' HookPoint uses them, agree.
    block = torch.nn.Identity()
    zero = lambda m, a, out: torch.zeros_like(out)  # noqa: E731
    noise = lambda m, a, out: torch.randn_like(out) * 0.1  # noqa: E731
    for i in range(2):
        block.register_forward_hook(zero if i == zero_attach_pos else noise, prepend=prepend)
    assert bool((block(torch.ones(5, D_MODEL)) == 0).all()) == expected


def test_hook_points_test_add_hook_prepend(maybe_jit):
    order = []
    m = model.embed
    with m.register_forward_hook(lambda *a: order.append(1)):
        with m.register_forward_hook(lambda *a: order.append(2), prepend=True):
            maybe_jit(lambda t: m(t))(tokens)
    assert order == [2, 1]  # TransformerLens: fwd_hooks[0] is the prepended hook (id 2)


def test_backward_hook_returning_a_tuple_under_vmap_and_jit():
    # Not a peer case: the `(grad,)` form of TransformerLens' backward hooks under
    # jax.vmap and jax.jit gives what returning the array gives.
    def loss(m, t, form):
        def hook(g, name):
            return (g * 3.0,) if form == "tuple" else g * 3.0

        return jnp.sum(jhooks.run_with_hooks(m, t, bwd_hooks=[(embed, hook)]))

    ts = jnp.stack([tokens, tokens[::-1]])

    def total(m, form):
        return jnp.sum(jax.vmap(lambda t: loss(m, t, form))(ts))

    g_tuple = jax.jit(jax.grad(total), static_argnums=1)(model, "tuple")
    g_array = jax.grad(total)(model, "array")
    np.testing.assert_allclose(g_tuple.embed.W_E, g_array.embed.W_E, rtol=1e-5, atol=1e-6)
    plain = jax.grad(lambda m: jnp.sum(jax.vmap(m)(ts)))(model)
    np.testing.assert_allclose(g_tuple.embed.W_E, 3.0 * plain.embed.W_E, rtol=1e-5, atol=1e-6)

"""An identity hook compiles to the same XLA operations as no hook at all."""

import re

import jax
import jax.numpy as jnp

import jhooks

OP = re.compile(r"=\s*\S+\s+([a-z][\w\-]*)\(")


def compiled_ops(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [m.group(1) for line in text.splitlines() if (m := OP.search(line))]


def mlp_loss(hook):
    def loss(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
            if hook is not None:
                x = jhooks.register_hook(x, hook)
        return jnp.sum(x**2)

    return loss


params = [jnp.full((8, 8), 0.1), jnp.full((8, 8), -0.2), jnp.full((8, 8), 0.3)]
x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)


def test_identity_hook_compiles_to_the_same_operations():
    plain = compiled_ops(jax.grad(mlp_loss(None)), params, x)
    for identity in (lambda g: g, lambda g: None):
        hooked = compiled_ops(jax.grad(mlp_loss(identity)), params, x)
        assert hooked == plain
    assert "dot" in plain  # the comparison is over a real program


def test_a_modifying_hook_does_change_the_program():
    plain = compiled_ops(jax.grad(mlp_loss(None)), params, x)
    clipped = compiled_ops(jax.grad(mlp_loss(lambda g: jnp.clip(g, -1.0, 1.0))), params, x)
    assert clipped != plain


def test_hooks_without_differentiation_compile_to_nothing():
    assert compiled_ops(mlp_loss(lambda g: g * 2.0), params, x) == compiled_ops(
        mlp_loss(None), params, x
    )


def test_identity_node_hooks_compile_to_the_same_operations():
    node = jhooks.Node(lambda a, w: jnp.tanh(a @ w))

    def loss(params, x, hooked):
        for w in params:
            x = node(x, w) if hooked else jnp.tanh(x @ w)
        return jnp.sum(x**2)

    node.register_prehook(lambda go: None)
    node.register_hook(lambda gi, go: gi)
    hooked = compiled_ops(jax.grad(lambda p, x: loss(p, x, True)), params, x)
    plain = compiled_ops(jax.grad(lambda p, x: loss(p, x, False)), params, x)
    assert hooked == plain

"""The jhooks demo: a jitted optax training step of a small Equinox CNN with module hooks.

The model is plain Equinox; `jhooks.hookable` lets its modules hold PyTorch-style
hooks. They clamp the gradient flowing back through the activation to be
non-negative, zero the gradient of the last layer's bias, and log the norm of the
gradient of the first layer's output: one norm per step, as PyTorch's
`grad_output[0].norm()` of the whole batch.

The model is called under `jax.vmap`, so a backward hook sees one example's gradient
(and a `jhooks.host` hook would run once per example: 32 calls a step). The hook
therefore `emit`s each example's squared norm; `jhooks.filter_value_and_grad` returns
them with the batch axis leading, and their sum is the batch's squared norm.

Beside each figure the demo prints what the hooks changed: the same figure from the same
step without hooks (the plain model with the same weights, differentiated by Equinox),
how many gradient entries the clamp changed, and the bias gradient the hook zeroed.
"""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jhooks
from small_cnn import SmallCNN  # conv -> act (ReLU) -> fc


def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def log_grad_norm(module, grad_output):
    # Under vmap this sees one example: emit its squared norm, summed per step below.
    jhooks.emit("conv.grad_output_sq", jnp.sum(grad_output[0] ** 2))


def clamp_non_negative(module, grad_input, grad_output):
    # Emits how many entries it changes (one count per example), then clamps them.
    jhooks.emit("act.clamped", jnp.sum(grad_input[0] < 0))
    return (jnp.maximum(grad_input[0], 0.0),)


def conv_grad_norm(model, x, y):
    """The gradient norm at the conv's output without hooks (`model` is plain Equinox)."""

    def loss_of_conv_output(z):
        logits = jax.vmap(lambda z: model.fc(model.act(z).reshape(-1)))(z)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jnp.linalg.norm(jax.grad(loss_of_conv_output)(jax.vmap(model.conv)(x)))


class Step(NamedTuple):
    """One step's figures: with the hooks, and what they changed."""

    loss: float
    grad_norm: float  # the conv output's gradient norm, with the clamp upstream
    plain_grad_norm: float  # the same from the same weights, without hooks
    clamped: int  # gradient entries at the activation's input that the clamp changed
    entries: int  # of that many
    plain_bias_grad_norm: float  # the fc.bias gradient the parameter hook zeroed


def main(steps: int = 30, lr: float = 0.05) -> list[Step]:
    """Trains for `steps` steps; prints and returns each step's figures."""
    key = jax.random.PRNGKey(0)
    plain = SmallCNN(key, classes=10)
    model = jhooks.hookable(plain)
    # PyTorch: model.act.register_full_backward_hook(...), model.fc.bias.register_hook(...)
    model.act.register_full_backward_hook(clamp_non_negative)
    model.register_parameter_hook("fc.bias", jnp.zeros_like)
    model.conv.register_full_backward_pre_hook(log_grad_norm)
    # The plain model with the hooked one's weights: hookable keeps the pytree leaves.
    without_hooks = jax.tree.structure(plain)

    # The hooks change the gradients, so a step no longer follows the loss's gradient:
    # at lr=0.1 the loss falls, then rises again after step 30 (the frozen bias and the
    # clamped gradient are not a descent direction there). At 0.05 it falls throughout.
    optim = optax.sgd(lr)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 1, 8, 8))
    y = (x.mean(axis=(1, 2, 3)) > 0).astype(jnp.int32)

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads, logged = jhooks.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        grad_norm = jnp.sqrt(jnp.sum(logged["conv.grad_output_sq"]))  # (32,) -> one norm
        # The same step without hooks: Equinox's gradient of the plain model.
        plain = jax.tree.unflatten(without_hooks, jax.tree.leaves(model))
        plain_grads = eqx.filter_grad(loss_fn)(plain, x, y)
        changed = Step(
            loss,
            grad_norm,
            conv_grad_norm(plain, x, y),
            jnp.sum(logged["act.clamped"]),
            jnp.size(jax.vmap(plain.conv)(x)),
            jnp.linalg.norm(plain_grads.fc.bias),
        )
        return eqx.apply_updates(model, updates), opt_state, changed, grads.fc.bias

    bias0 = model.fc.bias
    history = []
    for i in range(steps):
        # The model returned by the step is a copy that shares the hooks.
        model, opt_state, figures, bias_grad = step(model, opt_state)
        s = Step(*(jnp.asarray(v).item() for v in figures))  # Python numbers
        history.append(s)
        print(
            f"step {i:3d}  loss {s.loss:.4f}  conv output grad norm {s.grad_norm:.5f} "
            f"(no hooks: {s.plain_grad_norm:.5f})  clamp changed {s.clamped}/{s.entries} "
            f"entries  fc.bias grad zeroed (no hooks: norm {s.plain_bias_grad_norm:.5f})"
        )
    assert float(jnp.abs(bias_grad).max()) == 0.0
    assert bool(jnp.array_equal(model.fc.bias, bias0))
    print("fc.bias gradient was zeroed by its hook: bias unchanged after", steps, "steps")
    return history


if __name__ == "__main__":
    main()

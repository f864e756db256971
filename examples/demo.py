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
"""

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


def main(steps: int = 30, lr: float = 0.05) -> list[tuple[float, float]]:
    """Trains for `steps` steps; prints and returns `(loss, conv grad norm)` per step."""
    key = jax.random.PRNGKey(0)
    model = jhooks.hookable(SmallCNN(key, classes=10))
    # PyTorch: model.act.register_full_backward_hook(...), model.fc.bias.register_hook(...)
    model.act.register_full_backward_hook(lambda m, gi, go: (jnp.maximum(gi[0], 0.0),))
    model.register_parameter_hook("fc.bias", jnp.zeros_like)
    model.conv.register_full_backward_pre_hook(log_grad_norm)

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
        return eqx.apply_updates(model, updates), opt_state, loss, grad_norm, grads.fc.bias

    bias0 = model.fc.bias
    history = []
    for i in range(steps):
        # The model returned by the step is a copy that shares the hooks.
        model, opt_state, loss, grad_norm, bias_grad = step(model, opt_state)
        history.append((float(loss), float(grad_norm)))
        print(f"step {i:3d}  loss {float(loss):.4f}  conv output grad norm {float(grad_norm):.5f}")
    assert float(jnp.abs(bias_grad).max()) == 0.0
    assert bool(jnp.array_equal(model.fc.bias, bias0))
    print("fc.bias gradient was zeroed by its hook: bias unchanged after", steps, "steps")
    return history


if __name__ == "__main__":
    main()

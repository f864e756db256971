"""The jhooks demo: a jitted optax training step of a small Equinox CNN with module hooks.

The model is plain Equinox; `jhooks.hookable` lets its modules hold PyTorch-style
hooks. They clamp the gradient flowing back through the activation to be
non-negative, zero the gradient of the last layer's bias, and log the norm of the
gradient of the first layer's output on the host every step.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jhooks
from small_cnn import SmallCNN  # conv -> act (ReLU) -> fc

grad_norms: list[float] = []


def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(steps: int = 50) -> None:
    key = jax.random.PRNGKey(0)
    model = jhooks.hookable(SmallCNN(key, classes=10))
    # PyTorch: model.act.register_full_backward_hook(...), model.fc.bias.register_hook(...)
    model.act.register_full_backward_hook(lambda m, gi, go: (jnp.maximum(gi[0], 0.0),))
    model.register_parameter_hook("fc.bias", jnp.zeros_like)
    model.conv.register_full_backward_pre_hook(
        jhooks.host(lambda m, go: grad_norms.append(float(np.linalg.norm(go[0]))))
    )

    optim = optax.sgd(0.1)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 1, 8, 8))
    y = (x.mean(axis=(1, 2, 3)) > 0).astype(jnp.int32)

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss, grads.fc.bias

    bias0 = model.fc.bias
    for i in range(steps):
        # The model returned by the step is a copy that shares the hooks.
        model, opt_state, loss, bias_grad = step(model, opt_state)
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}  host-logged grad norms {len(grad_norms)}")
    assert float(jnp.abs(bias_grad).max()) == 0.0
    assert np.array_equal(np.asarray(model.fc.bias), np.asarray(bias0))
    assert len(grad_norms) == steps * x.shape[0]  # one per example (vmap) and step
    print("fc.bias gradient was zeroed by its hook: bias unchanged after", steps, "steps")


if __name__ == "__main__":
    main()

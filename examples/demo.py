"""The jhooks demo: a jitted optax training step of a small Equinox CNN with hooks.

The hooks clamp the gradient of an activation to be non-negative, zero the gradient
of the last layer's bias, and log the gradient norm of the first layer's output on
the host every step.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jhooks


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1)
        self.fc = eqx.nn.Linear(4 * 6 * 6, 10, key=k2)

    def __call__(self, x):
        h = self.conv(x)
        h = jhooks.register_hook(h, jhooks.host(lambda g: grad_norms.append(np.linalg.norm(g))))
        h = jhooks.register_hook(jax.nn.relu(h), lambda g: jnp.maximum(g, 0.0))
        return self.fc(h.reshape(-1))


grad_norms: list[float] = []


def loss_fn(model, x, y):
    # Zero the bias gradient of the last layer: a hook on the parameter itself.
    model = eqx.tree_at(
        lambda m: m.fc.bias, model, jhooks.register_hook(model.fc.bias, jnp.zeros_like)
    )
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(steps: int = 50) -> None:
    key = jax.random.PRNGKey(0)
    model = CNN(key)
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
        model, opt_state, loss, bias_grad = step(model, opt_state)
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}  host-logged grad norms {len(grad_norms)}")
    assert float(jnp.abs(bias_grad).max()) == 0.0
    assert np.array_equal(np.asarray(model.fc.bias), np.asarray(bias0))
    print("fc.bias gradient was zeroed by its hook: bias unchanged after", steps, "steps")


if __name__ == "__main__":
    main()

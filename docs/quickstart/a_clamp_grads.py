# Clamp the gradient of every Linear layer's output in a jitted optax loop; log each
# layer's gradient norm every step.
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jhooks

model = jhooks.hookable(eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0)))
x = jax.random.normal(jax.random.key(1), (64, 4))
y = jnp.stack([x[:, 0] * x[:, 1], jnp.sin(x[:, 2])], axis=1)


def clamp(module, grad_output):
    # Under jax.vmap a hook sees one example: emit its norm (the batch's is their norm).
    jhooks.emit(jhooks.module_path(module), jnp.linalg.norm(grad_output[0]))
    return (jnp.clip(grad_output[0], -0.01, 0.01),)


jhooks.register_module_hooks(model, eqx.nn.Linear, full_backward_pre=clamp)


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


optim = optax.adam(1e-2)
opt_state = optim.init(eqx.filter(model, eqx.is_array))


@eqx.filter_jit
def step(model, opt_state):
    loss, grads, norms = jhooks.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state, loss, jax.tree.map(jnp.linalg.norm, norms)


for i in range(20):
    model, opt_state, loss, norms = step(model, opt_state)
    print(f"step {i:2d}  loss {loss:.4f}  grad norms {jax.tree.map(float, norms)}")

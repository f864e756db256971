# Train a Flax NNX model with optax in a jitted step: clamp the gradient of every Linear
# layer's output, and log each layer's gradient norm every step.
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jhooks


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(4, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


model = jhooks.hookable(MLP(nnx.Rngs(0)))  # in place: `model` is the NNX model
rng = np.random.default_rng(0)  # the twin's weights and data (NNX's kernel is (in, out))
for layer in (model.fc1, model.fc2):
    layer.kernel[...] = rng.uniform(-0.5, 0.5, layer.kernel.shape).astype(np.float32)
    layer.bias[...] = jnp.zeros(layer.bias.shape)
x = rng.normal(size=(64, 4)).astype(np.float32)
y = np.stack([x[:, 0] * x[:, 1], np.sin(x[:, 2])], axis=1)


def clamp(module, grad_output):
    # NNX models take the batch, as PyTorch's do: the hook sees the batch's gradient.
    jhooks.emit(jhooks.module_path(module), jnp.linalg.norm(grad_output[0]))
    return (jnp.clip(grad_output[0], -0.01, 0.01),)


jhooks.register_module_hooks(model, nnx.Linear, full_backward_pre=clamp)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@nnx.jit
def step(model, optimizer):
    loss, grads, norms = jhooks.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss, norms


for i in range(20):
    loss, norms = step(model, optimizer)
    print(f"step {i:2d}  loss {loss:.6f}  grad norms {jax.tree.map(float, norms)}")

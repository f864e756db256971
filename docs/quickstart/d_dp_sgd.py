# DP-SGD: clip every example's gradient to norm C, sum, add Gaussian noise, on a small CNN.
import equinox as eqx
import jax
import optax

import jhooks


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __call__(self, x):  # one (1, 8, 8) image
        return self.fc(jax.nn.relu(self.conv(x)).reshape(-1))


def loss(model, x, y):  # ONE example's loss: clipped_grad maps it over the batch
    return -jax.nn.log_softmax(model(x))[y]


C, SIGMA, B = 1.0, 0.8, 64
x = jax.random.normal(jax.random.key(1), (512, 1, 8, 8))
y = (x.mean(axis=(1, 2, 3)) > 0).astype(int)
k1, k2 = jax.random.split(jax.random.key(0))
model = CNN(eqx.nn.Conv2d(1, 8, 3, key=k1), eqx.nn.Linear(8 * 6 * 6, 2, key=k2))
# SGD on (the sum of the clipped gradients + noise of std SIGMA * C) / B.
optim = optax.chain(optax.add_noise((SIGMA * C) ** 2, 0.0, key=0), optax.sgd(0.5 / B))
opt_state = optim.init(model)
clipped = eqx.filter_jit(jhooks.clipped_grad(loss, C))  # the sum of the clipped gradients

for epoch in range(3):
    for i in range(0, len(x), B):
        grads, norms = clipped(model, x[i : i + B], y[i : i + B])
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
    print(f"epoch {epoch}  accuracy {(jax.vmap(model)(x).argmax(1) == y).mean():.3f}")

# Capture every layer's activations.
import equinox as eqx
import jax

import jhooks

model = jhooks.hookable(eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0)))
x = jax.random.normal(jax.random.key(1), (64, 4))

# Every hookable module's output is a named point; run_with_cache returns them all.
out, cache = jhooks.run_with_cache(jax.vmap(model), x)
for name, activation in cache.items():
    print(name, activation.shape)  # layers.0 (64, 32), layers.1 (64, 32), layers.2 (64, 2)

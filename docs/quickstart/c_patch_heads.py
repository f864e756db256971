# Patch each attention head from a clean run into a corrupted one; plot the effect.
import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt

import jhooks

D, HEADS, LAYERS, SEQ = 16, 4, 2, 6


class Attention(eqx.Module):
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear

    def __call__(self, x):  # (SEQ, D)
        q, k, v = jnp.split(jax.vmap(self.qkv)(x).reshape(SEQ, 3 * HEADS, -1), 3, axis=1)
        pattern = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(D // HEADS))
        z = jhooks.hook_point(jnp.einsum("hqk,khd->qhd", pattern, v), "hook_z")  # per head
        return x + jax.vmap(self.out)(z.reshape(SEQ, D))


class Model(eqx.Module):
    blocks: list[Attention]
    unembed: eqx.nn.Linear

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.unembed(x[-1])[0]  # one logit: the metric


def attention(key):
    k1, k2 = jax.random.split(key)
    return Attention(eqx.nn.Linear(D, 3 * D, key=k1), eqx.nn.Linear(D, D, key=k2))


k = jax.random.split(jax.random.key(0), 3)
model = jhooks.hookable(Model([attention(k[0]), attention(k[1])], eqx.nn.Linear(D, 1, key=k[2])))
clean = jax.random.normal(jax.random.key(1), (SEQ, D))
corrupted = clean.at[0].set(-clean[0])

# The hook point inside each block's Attention is named under its path: blocks.0.hook_z.
clean_out, cache = jhooks.run_with_cache(model, clean, names_filter="blocks.*.hook_z")


def patched(layer, head):
    def patch(z, name):  # PyTorch: a forward hook returning the patched output
        return z.at[:, head].set(cache[name][:, head])

    return jhooks.run_with_hooks(model, corrupted, fwd_hooks=[(f"blocks.{layer}.hook_z", patch)])


effect = jnp.array(
    [[patched(i, h) - model(corrupted) for h in range(HEADS)] for i in range(LAYERS)]
)
plt.imshow(effect, cmap="RdBu")
plt.xlabel("head"), plt.ylabel("layer"), plt.colorbar(label="logit change")
plt.savefig("head_patching.png")
print(effect)

# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Value hooks: PyTorch's `Tensor.register_hook` and `retain_grad` in JAX
#
# Every comparison below puts a PyTorch cell and its jhooks twin next to each other and ends with
# `np.testing.assert_allclose`, so a broken parity fails the notebook.
#
# | PyTorch | jhooks |
# |---|---|
# | `y.register_hook(fn)` | `y = jhooks.register_hook(y, fn)` |
# | `y.retain_grad()`, then `y.grad` | `y = jhooks.retain_grad(y, "y")`; `jhooks.grad` returns it |
# | `print` inside a hook | `jhooks.host(fn)` runs `fn` with NumPy values every step |
#
# JAX arrays are immutable, so `jhooks.register_hook` *returns* the hooked value: register the hook
# where the value is made and use the returned value from then on.

# %%
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

# %% [markdown]
# ## A small scalar graph
#
# `c = a * b`, then `e = c * d`. On `c` we put three hooks: one adds 100 to the gradient, one
# doubles it, one prints it (and keeps it, to compare). `retain_grad` keeps the gradients of `c`
# and `e`. In PyTorch a retained gradient is the one after every hook on the tensor, whenever
# `retain_grad` was called; jhooks does the same.
#
# ### PyTorch

# %%
a = torch.tensor(2.0, requires_grad=True)
b = torch.tensor(3.0, requires_grad=True)
d = torch.tensor(4.0, requires_grad=True)

torch_seen = []


def torch_print(grad):
    print("PyTorch: gradient of c after +100 and *2:", grad.item())
    torch_seen.append(grad.item())


c = a * b
c.retain_grad()
c.register_hook(lambda grad: grad + 100)  # add to the gradient
c.register_hook(lambda grad: grad * 2)  # scale it
c.register_hook(torch_print)  # print it
e = c * d
e.retain_grad()
e.backward()

print("a.grad", a.grad.item(), "b.grad", b.grad.item(), "d.grad", d.grad.item())
print("c.grad", c.grad.item(), "e.grad", e.grad.item())

# %% [markdown]
# ### jhooks
#
# The same graph as a function. `jhooks.register_hook` takes several hooks at once and runs them in
# order; printing needs concrete values, so the printing hook is wrapped in `jhooks.host`.
# `jhooks.grad` is `jax.grad` that also returns the retained gradients.

# %%
jax_seen = []


def jax_print(grad):
    print("jhooks: gradient of c after +100 and *2:", float(grad))
    jax_seen.append(float(grad))


def f(a, b, d):
    c = a * b
    c = jhooks.retain_grad(c, "c")
    c = jhooks.register_hook(
        c,
        lambda grad: grad + 100,  # add to the gradient
        lambda grad: grad * 2,  # scale it
        jhooks.host(jax_print),  # print it
    )
    e = c * d
    e = jhooks.retain_grad(e, "e")
    return e


(grad_a, grad_b, grad_d), retained = jhooks.grad(f, argnums=(0, 1, 2))(
    jnp.float32(2.0), jnp.float32(3.0), jnp.float32(4.0)
)
jax.effects_barrier()  # wait for the host hook
print("grads", grad_a, grad_b, grad_d, "retained", retained)

np.testing.assert_allclose([grad_a, grad_b, grad_d], [a.grad.item(), b.grad.item(), d.grad.item()])
np.testing.assert_allclose(retained["c"], c.grad.item())
np.testing.assert_allclose(retained["e"], e.grad.item())
np.testing.assert_allclose(jax_seen, torch_seen)
# What both computed: de/dc = d = 4, then (4 + 100) * 2 = 208 flows on to a and b.
np.testing.assert_allclose([grad_a, grad_b, grad_d], [208 * 3.0, 208 * 2.0, 2.0 * 3.0])

# %% [markdown]
# ### Under `jax.jit`: hooks compile into the step
#
# A jhooks hook runs while JAX *traces* the program: what it computes with `jax.numpy` becomes part
# of the compiled step, and Python side effects in it happen once per trace, not once per step. A
# host hook runs every time the compiled step runs. Three calls of a jitted step show the
# difference.

# %%
trace_time_calls, host_calls = [], []


def g(a, b, d):
    c = jhooks.register_hook(
        a * b,
        lambda grad: grad * 2,
        lambda grad: trace_time_calls.append("called"),  # plain Python: runs when traced
        jhooks.host(lambda grad: host_calls.append(float(grad))),  # runs every step
    )
    return c * d


step = jax.jit(jax.grad(g, argnums=(0, 1, 2)))
for _ in range(3):
    grads = step(jnp.float32(2.0), jnp.float32(3.0), jnp.float32(4.0))
jax.effects_barrier()
print("trace-time calls:", len(trace_time_calls), "host calls:", host_calls)

assert len(trace_time_calls) == 1
np.testing.assert_allclose(host_calls, [8.0, 8.0, 8.0])
np.testing.assert_allclose(grads, [8.0 * 3.0, 8.0 * 2.0, 6.0])

# %% [markdown]
# ## `x * x` summed, with noise added to the gradient
#
# A hook that adds noise to the gradient of `y = x * x`. Both frameworks get the same noise tensor,
# so the gradients must agree: `x.grad = 2 x (1 + noise)`.
#
# ### PyTorch: noise on the gradient

# %%
rng = np.random.default_rng(0)
x_np = rng.normal(size=5).astype(np.float32)
noise = (0.1 * rng.normal(size=5)).astype(np.float32)

x = torch.tensor(x_np, requires_grad=True)
y = x * x
y.register_hook(lambda grad: grad + torch.from_numpy(noise))
y.sum().backward()
print("PyTorch x.grad:", x.grad.numpy())


# %% [markdown]
# ### jhooks: noise on the gradient


# %%
def loss(x):
    y = x * x
    y = jhooks.register_hook(y, lambda grad: grad + noise)
    return jnp.sum(y)


grad_x = jax.jit(jax.grad(loss))(jnp.asarray(x_np))
print("jhooks x grad: ", np.asarray(grad_x))

np.testing.assert_allclose(grad_x, x.grad.numpy(), rtol=1e-6)
np.testing.assert_allclose(grad_x, 2 * x_np * (1 + noise), rtol=1e-6)


# %% [markdown]
# Inside a jitted training step you usually want fresh noise every step. Draw it in the
# hook from a key passed to the step, so the noise is part of the compiled program. Here PyTorch
# gets the noise JAX drew for the same key, to check the result.


# %%
def noisy_loss(x, key):
    y = x * x
    y = jhooks.register_hook(y, lambda grad: grad + 0.1 * jax.random.normal(key, grad.shape))
    return jnp.sum(y)


key = jax.random.key(42)
grad_x = jax.jit(jax.grad(noisy_loss))(jnp.asarray(x_np), key)

x = torch.tensor(x_np, requires_grad=True)
y = x * x
key_noise = torch.tensor(np.asarray(0.1 * jax.random.normal(key, (5,))))
y.register_hook(lambda grad: grad + key_noise)
y.sum().backward()

np.testing.assert_allclose(grad_x, x.grad.numpy(), rtol=1e-6)

# %% [markdown]
# ## The one difference to remember: register where the value is made
#
# In PyTorch, `y.register_hook` hooks the tensor, so every use of `y` is covered, even one made
# before the hook was registered. A JAX value has no graph to attach to afterwards: uses of `y`
# made before `jhooks.register_hook(y, fn)` are not hooked. Here a hook that zeroes the gradient
# is registered after `y` was already used once.

# %%
x = torch.tensor(x_np, requires_grad=True)
y = x * x
first_use = y.sum()
y.register_hook(torch.zeros_like)  # covers both uses of y
(first_use + y.sum()).backward()


def late_hook(x):
    y = x * x
    first_use = jnp.sum(y)  # made before the hook: not hooked
    y = jhooks.register_hook(y, jnp.zeros_like)
    return first_use + jnp.sum(y)


grad_x = jax.grad(late_hook)(jnp.asarray(x_np))

np.testing.assert_allclose(x.grad.numpy(), np.zeros(5))  # PyTorch: both uses zeroed
np.testing.assert_allclose(grad_x, 2 * x_np)  # jhooks: only the use after the hook

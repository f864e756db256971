# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Node hooks and multi-grad hooks
#
# | PyTorch | jhooks |
# |---|---|
# | `c.grad_fn` | `node = jhooks.Node(fn)`; `node(*args)` |
# | `c.grad_fn.register_prehook(hook)` | `node.register_prehook(hook)` |
# | `c.grad_fn.register_hook(hook)` | `node.register_hook(hook)` |
# | `register_multi_grad_hook(ts, fn)` | `ts = jhooks.register_multi_grad_hook(ts, fn)` |
#
# (`register_multi_grad_hook` is in `torch.autograd.graph`.) Hook signatures are PyTorch's:
# `prehook(grad_outputs)` and `hook(grad_inputs, grad_outputs)`.
#
# A PyTorch `grad_fn` is the autograd node PyTorch made for one operation; a `jhooks.Node` wraps a
# function of your choice. Each comparison ends with `np.testing.assert_allclose`.

# %%
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

a_np = np.array([1.0, 2.0, 3.0], np.float32)
b_np = np.array([4.0, 5.0, 6.0], np.float32)
w_np = np.array([1.0, -1.0, 0.5], np.float32)  # loss = sum(w * a * b)

# %% [markdown]
# ## Node hooks
#
# A pre-hook receives `grad_outputs` (the gradients of the node's outputs) and may replace them; a
# hook receives `(grad_inputs, grad_outputs)` after the node's backward and may replace
# `grad_inputs`. Below, observers record what each hook sees, a pre-hook doubles `grad_outputs`,
# and a hook drops the gradient of `b`.
#
# ### PyTorch

# %%
a = torch.tensor(a_np, requires_grad=True)
b = torch.tensor(b_np, requires_grad=True)
torch_seen = {}

c = a * b
c.grad_fn.register_prehook(lambda go: torch_seen.update(pre=[g.clone() for g in go]))
c.grad_fn.register_prehook(lambda go: (go[0] * 2,))
c.grad_fn.register_hook(
    lambda gi, go: torch_seen.update(grad_inputs=[g.clone() for g in gi], grad_outputs=list(go))
)
c.grad_fn.register_hook(lambda gi, go: (gi[0], None))  # no gradient for b
(c * torch.from_numpy(w_np)).sum().backward()

print(c.grad_fn, "seen:", torch_seen)
print("a.grad", a.grad, "b.grad", b.grad)


# %% [markdown]
# ### jhooks
#
# The observers need concrete values, so they are host hooks. Hooks added to a node stay until their
# handle is removed, as in PyTorch.


# %%
@jhooks.Node
def mul(a, b):
    return a * b


jax_seen = {}
handles = [
    mul.register_prehook(jhooks.host(lambda go: jax_seen.update(pre=list(go)))),
    mul.register_prehook(lambda go: (go[0] * 2,)),
    mul.register_hook(
        jhooks.host(lambda gi, go: jax_seen.update(grad_inputs=list(gi), grad_outputs=list(go)))
    ),
    mul.register_hook(lambda gi, go: (gi[0], None)),  # no gradient for b
]


def loss(a, b):
    return jnp.sum(mul(a, b) * w_np)


grad_a, grad_b = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(a_np), jnp.asarray(b_np))
jax.effects_barrier()
print(mul, "seen:", jax_seen)
print("grad a", grad_a, "grad b", grad_b)

np.testing.assert_allclose(jax_seen["pre"][0], torch_seen["pre"][0])
np.testing.assert_allclose(jax_seen["grad_outputs"][0], torch_seen["grad_outputs"][0])
for got, want in zip(jax_seen["grad_inputs"], torch_seen["grad_inputs"]):
    np.testing.assert_allclose(got, want)
np.testing.assert_allclose(grad_a, a.grad)
# PyTorch leaves b.grad as None; JAX returns an array for every argument: zeros.
assert b.grad is None
np.testing.assert_allclose(grad_b, np.zeros(3))
np.testing.assert_allclose(grad_a, 2 * w_np * b_np)

# %% [markdown]
# ### Handles, and what `jax.jit` does when hooks change
#
# Node hooks live outside the traced function, so jhooks makes them part of the jit cache key: a
# jitted step retraces when a hook is added or removed, and gets its compiled program back when the
# set of hooks is one it has seen. `with handle:` removes a hook on exit.

# %%
for h in handles:
    h.remove()

traces = []


def counted_loss(a, b):
    traces.append("traced")
    return jnp.sum(mul(a, b) * w_np)


step = jax.jit(jax.grad(counted_loss))
args = (jnp.asarray(a_np), jnp.asarray(b_np))

plain = step(*args)  # traced
with mul.register_prehook(lambda go: (go[0] * 10,)):
    scaled = step(*args)  # a hook was added: traced again
again = step(*args)  # the hook is gone: the first program, no new trace

print("traces:", len(traces))
assert len(traces) == 2
np.testing.assert_allclose(plain, w_np * b_np)
np.testing.assert_allclose(scaled, 10 * w_np * b_np)
np.testing.assert_allclose(again, plain)

# PyTorch, for the record: the same three gradients.
a = torch.tensor(a_np, requires_grad=True)
c = a * torch.from_numpy(b_np)
c.grad_fn.register_prehook(lambda go: (go[0] * 10,))
(c * torch.from_numpy(w_np)).sum().backward()
np.testing.assert_allclose(scaled, a.grad)

# %% [markdown]
# ## Multi-grad hooks, `mode="all"`
#
# One hook over several values, called once per backward pass with a tuple holding each value's
# gradient, `None` for a value no gradient reached. Here `h2` is computed but not used by the loss.
#
# ### PyTorch: `mode="all"`

# %%
x_np = np.array([1.0, 2.0], np.float32)

x = torch.tensor(x_np, requires_grad=True)
h1, h2 = x * 2, x**2
torch_all = []
torch.autograd.graph.register_multi_grad_hook((h1, h2), lambda grads: torch_all.append(grads))
(3 * h1).sum().backward()
print(torch_all)

# %% [markdown]
# ### jhooks: `mode="all"`
#
# The returned values carry the hook: compute the loss from them.

# %%
jax_all = []


def loss(x):
    h1, h2 = x * 2, x**2
    h1, h2 = jhooks.register_multi_grad_hook((h1, h2), jhooks.host(jax_all.append))
    return jnp.sum(3 * h1)


grad_x = jax.jit(jax.grad(loss))(jnp.asarray(x_np))
jax.effects_barrier()
print(jax_all)

assert len(jax_all) == len(torch_all) == 1
(jax_h1, jax_h2), (torch_h1, torch_h2) = jax_all[0], torch_all[0]
np.testing.assert_allclose(jax_h1, torch_h1)
assert jax_h2 is None and torch_h2 is None
np.testing.assert_allclose(grad_x, x.grad)


# %% [markdown]
# ## Multi-grad hooks, `mode="any"`
#
# With `mode="any"` the hook is called once, with one gradient. PyTorch passes the gradient of the
# tensor its backward pass reaches first; for two values computed independently it runs the most
# recently created node first, so `h2`'s. jhooks builds the whole backward pass before running it
# and passes the gradient of the first value *in the order given* that received one. Given as
# `(h2, h1)`, both pick `h2`; given as `(h1, h2)`, PyTorch still picks `h2` and jhooks picks `h1`.
#
# ### PyTorch: `mode="any"`


# %%
def torch_any(order):
    x = torch.tensor(x_np, requires_grad=True)
    h1, h2 = x * 2, x**2
    seen = []
    values = (h2, h1) if order == "h2 first" else (h1, h2)
    torch.autograd.graph.register_multi_grad_hook(values, seen.append, mode="any")
    (3 * h1 + h2).sum().backward()
    return seen


print(torch_any("h2 first"), torch_any("h1 first"))


# %% [markdown]
# ### jhooks: `mode="any"`


# %%
def jax_any(order):
    seen = []

    def loss(x):
        h1, h2 = x * 2, x**2
        if order == "h2 first":
            h2, h1 = jhooks.register_multi_grad_hook((h2, h1), jhooks.host(seen.append), mode="any")
        else:
            h1, h2 = jhooks.register_multi_grad_hook((h1, h2), jhooks.host(seen.append), mode="any")
        return jnp.sum(3 * h1 + h2)

    jax.jit(jax.grad(loss))(jnp.asarray(x_np))
    jax.effects_barrier()
    return seen


print(jax_any("h2 first"), jax_any("h1 first"))

grad_h1, grad_h2 = np.full(2, 3.0), np.ones(2)
# Given as (h2, h1): the same gradient in both.
np.testing.assert_allclose(jax_any("h2 first")[0], torch_any("h2 first")[0])
np.testing.assert_allclose(jax_any("h2 first")[0], grad_h2)
# Given as (h1, h2): jhooks follows the order given, PyTorch its execution order.
np.testing.assert_allclose(jax_any("h1 first")[0], grad_h1)
np.testing.assert_allclose(torch_any("h1 first")[0], grad_h2)

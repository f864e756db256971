# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Gradient surgery in a training loop
#
# A Conv2d-ReLU-Linear classifier trained with plain SGD in PyTorch (`torch.optim.SGD`) and in JAX
# (`optax.sgd` in a jitted step), from the same weights and on the same data, with two pieces of
# gradient surgery done by hooks:
#
# - a full backward hook on the ReLU clamps the gradient flowing back out of it to be
#   non-negative (`grad_input[0].clamp(min=0)`);
# - a parameter hook zeroes the gradient of the linear layer's bias, which therefore never moves.
#
# Host hooks record every parameter's gradient norm at every step, as PyTorch hooks that append
# to a list would. The loss curves, the gradient norms and the final weights are compared with
# `np.testing.assert_allclose`.

# %%
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import torch

import jhooks
from small_cnn import SmallCNN  # conv -> act (ReLU) -> fc, shared by the examples
from small_cnn_torch import TorchSmallCNN  # its PyTorch twin, with the same weights

torch.set_num_threads(1)  # a tiny model: more threads only add overhead


# Data: 64 random 8x8 images, 4 classes given by a random linear "teacher".
rng = np.random.default_rng(0)
images_np = rng.normal(size=(64, 1, 8, 8)).astype(np.float32)
labels_np = np.argmax(images_np.reshape(64, -1) @ rng.normal(size=(64, 4)), axis=1).astype(np.int32)

STEPS, LEARNING_RATE = 300, 0.05
net = jhooks.hookable(SmallCNN(jax.random.key(0)))  # 8x8 images, 4 classes
torch_net = TorchSmallCNN(net)
names = [name for name, _ in jhooks.named_parameters(net)]
assert names == [name for name, _ in torch_net.named_parameters()]
print(names)

# %% [markdown]
# ## PyTorch
#
# The hooks: a full backward hook on `act`, a gradient hook on each parameter that records its
# norm, and one more on `fc.bias` that zeroes its gradient (registered after the recorders, so they
# see the gradient before surgery).

# %%
torch_norms = {name: [] for name in names}
for name, p in torch_net.named_parameters():
    p.register_hook(lambda g, name=name: torch_norms[name].append(g.norm().item()))
torch_net.act.register_full_backward_hook(lambda m, gi, go: (gi[0].clamp(min=0),))
torch_net.fc.bias.register_hook(torch.zeros_like)

optimizer = torch.optim.SGD(torch_net.parameters(), lr=LEARNING_RATE)
images, labels = torch.from_numpy(images_np), torch.from_numpy(labels_np).long()
torch_bias0 = torch_net.fc.bias.detach().clone()
torch_losses = []
start = time.perf_counter()
for _ in range(STEPS):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(torch_net(images), labels)
    loss.backward()
    optimizer.step()
    torch_losses.append(loss.item())
seconds = time.perf_counter() - start
print(
    f"PyTorch: {STEPS} steps in {seconds:.2f} s ({1e3 * seconds / STEPS:.1f} ms a step, eager), ",
    end="",
)
print(f"loss {torch_losses[0]:.4f} -> {torch_losses[-1]:.4f}")

# %% [markdown]
# ## jhooks
#
# The same hooks on the Equinox model. The clamp and the zeroing are computations, traced into the
# jitted step; the norm recorders need concrete values, so they are `jhooks.host` hooks, called
# with NumPy arrays every time the compiled step runs. Parameter hooks see the total gradient over
# the batch (the parameters are shared by the examples of `jax.vmap`), as in PyTorch.
#
# Hooks live in the model's static structure, so every copy that `eqx.apply_updates` makes of the
# model keeps them, and the step is traced once.

# %%
jax_norms = {name: [] for name in names}
recorders = [
    net.register_parameter_hook(
        name, jhooks.host(lambda g, name=name: jax_norms[name].append(float(np.linalg.norm(g))))
    )
    for name in names
]
clamp = net.act.register_full_backward_hook(lambda m, gi, go: (jnp.maximum(gi[0], 0.0),))
net.register_parameter_hook("fc.bias", jnp.zeros_like)

optim = optax.sgd(LEARNING_RATE)
traces = []


def loss_fn(model, images, labels):
    logits = jax.vmap(model)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@eqx.filter_jit
def train_step(model, opt_state, images, labels):
    traces.append("traced")
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, images, labels)
    updates, opt_state = optim.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state, loss


def train(model):
    """Trains for STEPS steps; returns the model, the losses, and the seconds the first step
    took (it traces and compiles the step) and the seconds the others took."""
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    losses, start = [], time.perf_counter()
    for i in range(STEPS):
        model, opt_state, loss = train_step(model, opt_state, images_np, labels_np)
        losses.append(loss)
        if i == 0:
            jax.block_until_ready(loss)
            jax.effects_barrier()
            first, start = time.perf_counter() - start, time.perf_counter()
    losses = np.asarray(losses)  # waits for the last step
    jax.effects_barrier()  # and for the host hooks
    return model, losses, first, time.perf_counter() - start


model, jax_losses, first, rest = train(net)
print(
    f"jhooks: first step {first:.2f} s (tracing and compiling), the other {STEPS - 1} steps "
    f"{rest:.2f} s ({1e3 * rest / (STEPS - 1):.1f} ms a step), "
    f"loss {jax_losses[0]:.4f} -> {jax_losses[-1]:.4f}, traced {len(traces)} time(s)"
)
assert len(traces) == 1

# %% [markdown]
# ## The two runs agree
#
# Both runs compute in float32, but not with the same operations in the same order (XLA's
# convolution and reductions against PyTorch's), so each step differs by rounding, about `1e-7`
# relative, and those differences are carried from step to step through the weights. Over 300 steps
# they stay below `1e-6` (the cell prints the largest); the comparison allows `rtol=1e-4`, a
# hundred times more, and still far less than what a wrong gradient gives: leaving out the clamp
# changes the loss by `1e-3` relative at the first update and by 4% after ten (checked below). The
# final weights agree to about `1e-7`, compared with `rtol=1e-5, atol=1e-6`.
#
# The bias of `fc` never moved in either framework: its gradient was zeroed at every step.

# %%
print(
    "largest relative difference of the losses:",
    np.max(np.abs(jax_losses - torch_losses) / np.abs(torch_losses)),
)
np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-4)
for name in names:
    assert len(jax_norms[name]) == len(torch_norms[name]) == STEPS
    np.testing.assert_allclose(jax_norms[name], torch_norms[name], rtol=1e-4, atol=1e-7)

# fc.bias is exactly where it started, in both.
np.testing.assert_array_equal(model.fc.bias, net.fc.bias)
np.testing.assert_array_equal(torch_net.fc.bias.detach(), torch_bias0)
# The other parameters trained, and agree.
for (_, p), (_, torch_p) in zip(jhooks.named_parameters(model), torch_net.named_parameters()):
    np.testing.assert_allclose(np.reshape(p, torch_p.shape), torch_p.detach(), rtol=1e-5, atol=1e-6)
assert not np.array_equal(model.fc.weight, net.fc.weight)


# %% [markdown]
# ## What the clamp did
#
# The loss went *up*. With only non-negative gradients flowing back out of the ReLU, every SGD
# update of the convolution can only lower its outputs where they are active (the bias gradient is
# a sum of non-negative terms), so the ReLUs die one after another and the network ends up
# predicting nearly the same thing for every image: a loss near `ln 4`, the loss of a uniform
# guess. Both frameworks agree on that too. For reference, the same jitted step without the clamp:
# removing the hook through its handle makes the step retrace once, and the model then learns
# the task (the host recorders are removed as well, to keep their lists as they were).


# %%
def active_fraction(conv, images):
    return float(np.mean(np.asarray(conv(images)) > 0))


def torch_conv(x):
    return torch_net.conv(torch.from_numpy(x)).detach()


jax_conv = jax.vmap(lambda x: model.conv(x))
print(
    f"active ReLUs: {active_fraction(jax.vmap(net.conv), images_np):.1%} at the start, "
    f"{active_fraction(jax_conv, images_np):.1%} at the end (PyTorch: "
    f"{active_fraction(torch_conv, images_np):.1%})"
)
np.testing.assert_allclose(
    active_fraction(jax_conv, images_np), active_fraction(torch_conv, images_np), atol=1e-3
)
np.testing.assert_allclose(jax_losses[-1], np.log(4), rtol=0.01)

clamp.remove()
for handle in recorders:
    handle.remove()
_, unclamped_losses, _, _ = train(net)
print(f"without the clamp: loss {unclamped_losses[0]:.4f} -> {unclamped_losses[-1]:.4f}")
print(f"the step was traced {len(traces)} times")
assert len(traces) == 2 and unclamped_losses[-1] < 0.1
np.testing.assert_allclose(unclamped_losses[0], jax_losses[0])  # the same start, then:
early = np.abs(unclamped_losses[:10] - jax_losses[:10]) / jax_losses[:10]
print("relative effect of the clamp on the loss, first steps:", np.round(early, 4))
assert early[1] > 10 * 1e-4 and early[9] > 0.02  # far beyond the rtol of the comparison

# %% [markdown]
# ## Loss curves and gradient norms
#
# The left plot draws both loss curves on one figure (they overlap), and the run without the clamp
# in gray; the right one the gradient norm
# of each parameter at each step, as the host hooks recorded them, for jhooks (lines) and PyTorch
# (dots, every tenth step). `fc.bias` does have a gradient: the recorders see it before the
# hook registered after them zeroes it.

# %%
fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(11, 4))
ax_loss.plot(torch_losses, label="PyTorch", linewidth=4, alpha=0.4)
ax_loss.plot(jax_losses, label="jhooks", linestyle="--")
ax_loss.plot(unclamped_losses, label="jhooks, without the clamp", color="gray", linewidth=1)
ax_loss.set(xlabel="step", ylabel="cross-entropy loss", title="Training loss")
ax_loss.legend()

every = np.arange(0, STEPS, 10)
for name in names:
    (line,) = ax_norm.plot(jax_norms[name], label=f"{name} (jhooks)")
    ax_norm.plot(every, np.asarray(torch_norms[name])[every], ".", color=line.get_color())
ax_norm.set(
    xlabel="step", ylabel="gradient norm", yscale="log", title="Gradient norms (dots: PyTorch)"
)
ax_norm.legend(fontsize="small")
fig.tight_layout()

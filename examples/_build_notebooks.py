"""Writes the example notebooks from the cell sources below, without outputs.

The notebooks are generated so that their code can be reviewed as plain Python; run
`python examples/_build_notebooks.py` after editing a cell here. The test suite
(`tests/test_notebooks.py`) executes every notebook and checks that the committed
files match this script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).parent


def md(source: str) -> tuple[str, str]:
    return ("markdown", source)


def code(source: str) -> tuple[str, str]:
    return ("code", source)


NOTEBOOKS: dict[str, list[tuple[str, str]]] = {}

NOTEBOOKS["01_value_hooks.ipynb"] = [
    md(
        """# Value hooks: PyTorch's `Tensor.register_hook` and `retain_grad` in JAX

Every comparison below puts a PyTorch cell and its jhooks twin next to each other and ends with
`np.testing.assert_allclose`, so a broken parity fails the notebook.

| PyTorch | jhooks |
|---|---|
| `y.register_hook(fn)` | `y = jhooks.register_hook(y, fn)` |
| `y.retain_grad()`, then `y.grad` | `y = jhooks.retain_grad(y, "y")`; `jhooks.grad` returns it |
| `print` inside a hook | `jhooks.host(fn)` runs `fn` with NumPy values every step |

JAX arrays are immutable, so `jhooks.register_hook` *returns* the hooked value: register the hook
where the value is made and use the returned value from then on."""
    ),
    code(
        """import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks"""
    ),
    md(
        """## A small scalar graph

`c = a * b`, then `e = c * d`. On `c` we put three hooks: one adds 100 to the gradient, one
doubles it, one prints it (and keeps it, to compare). `retain_grad` keeps the gradients of `c`
and `e`. In PyTorch a retained gradient is the one after every hook on the tensor, whenever
`retain_grad` was called; jhooks does the same.

### PyTorch"""
    ),
    code(
        """a = torch.tensor(2.0, requires_grad=True)
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
print("c.grad", c.grad.item(), "e.grad", e.grad.item())"""
    ),
    md(
        """### jhooks

The same graph as a function. `jhooks.register_hook` takes several hooks at once and runs them in
order; printing needs concrete values, so the printing hook is wrapped in `jhooks.host`.
`jhooks.grad` is `jax.grad` that also returns the retained gradients."""
    ),
    code(
        """jax_seen = []


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

np.testing.assert_allclose(
    [grad_a, grad_b, grad_d], [a.grad.item(), b.grad.item(), d.grad.item()]
)
np.testing.assert_allclose(retained["c"], c.grad.item())
np.testing.assert_allclose(retained["e"], e.grad.item())
np.testing.assert_allclose(jax_seen, torch_seen)
# What both computed: de/dc = d = 4, then (4 + 100) * 2 = 208 flows on to a and b.
np.testing.assert_allclose([grad_a, grad_b, grad_d], [208 * 3.0, 208 * 2.0, 2.0 * 3.0])"""
    ),
    md(
        """### Under `jax.jit`: hooks compile into the step

A jhooks hook runs while JAX *traces* the program: what it computes with `jax.numpy` becomes part
of the compiled step, and Python side effects in it happen once per trace, not once per step. A
host hook runs every time the compiled step runs. Three calls of a jitted step show the
difference."""
    ),
    code(
        """trace_time_calls, host_calls = [], []


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
np.testing.assert_allclose(grads, [8.0 * 3.0, 8.0 * 2.0, 6.0])"""
    ),
    md(
        """## `x * x` summed, with noise added to the gradient

A hook that adds noise to the gradient of `y = x * x`. Both frameworks get the same noise tensor,
so the gradients must agree: `x.grad = 2 x (1 + noise)`.

### PyTorch"""
    ),
    code(
        """rng = np.random.default_rng(0)
x_np = rng.normal(size=5).astype(np.float32)
noise = (0.1 * rng.normal(size=5)).astype(np.float32)

x = torch.tensor(x_np, requires_grad=True)
y = x * x
y.register_hook(lambda grad: grad + torch.from_numpy(noise))
y.sum().backward()
print("PyTorch x.grad:", x.grad.numpy())"""
    ),
    md("""### jhooks"""),
    code(
        """def loss(x):
    y = x * x
    y = jhooks.register_hook(y, lambda grad: grad + noise)
    return jnp.sum(y)


grad_x = jax.jit(jax.grad(loss))(jnp.asarray(x_np))
print("jhooks x grad: ", np.asarray(grad_x))

np.testing.assert_allclose(grad_x, x.grad.numpy(), rtol=1e-6)
np.testing.assert_allclose(grad_x, 2 * x_np * (1 + noise), rtol=1e-6)"""
    ),
    md(
        """Inside a jitted training step you usually want fresh noise every step. Draw it in the
hook from a key passed to the step, so the noise is part of the compiled program. Here PyTorch
gets the noise JAX drew for the same key, to check the result."""
    ),
    code(
        """def noisy_loss(x, key):
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

np.testing.assert_allclose(grad_x, x.grad.numpy(), rtol=1e-6)"""
    ),
    md(
        """## The one difference to remember: register where the value is made

In PyTorch, `y.register_hook` hooks the tensor, so every use of `y` is covered, even one made
before the hook was registered. A JAX value has no graph to attach to afterwards: uses of `y`
made before `jhooks.register_hook(y, fn)` are not hooked. Here a hook that zeroes the gradient
is registered after `y` was already used once."""
    ),
    code(
        """x = torch.tensor(x_np, requires_grad=True)
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
np.testing.assert_allclose(grad_x, 2 * x_np)  # jhooks: only the use after the hook"""
    ),
]


NOTEBOOKS["02_module_forward_hooks.ipynb"] = [
    md(
        """# Module forward hooks: `register_forward_pre_hook` and `register_forward_hook`

| PyTorch | jhooks |
|---|---|
| `layer.register_forward_pre_hook(hook)` | `layer.register_forward_pre_hook(hook)` |
| `layer.register_forward_hook(hook)` | `layer.register_forward_hook(hook)` |
| `with_kwargs=True` | `with_kwargs=True` |
| a hook saving outputs to a list | `jhooks.run_with_cache(model, x)`, or a `jhooks.host` hook |

Call `jhooks.hookable(model)` once (or subclass `jhooks.Module`) and every Equinox module in the
model, stock `eqx.nn` layers included, gets PyTorch's `register_*` methods. Hook signatures and
return rules are PyTorch's. Each comparison below puts a PyTorch cell next to its jhooks twin,
copies the weights so both start equal, and ends with `np.testing.assert_allclose`."""
    ),
    code(
        """import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

rng = np.random.default_rng(0)
x_np = rng.normal(size=(5, 4)).astype(np.float32)  # a batch of 5 examples, 4 features

lin = jhooks.hookable(eqx.nn.Linear(4, 3, key=jax.random.key(0)))
torch_lin = torch.nn.Linear(4, 3)
with torch.no_grad():  # the same weights in both
    torch_lin.weight.copy_(torch.tensor(np.asarray(lin.weight)))
    torch_lin.bias.copy_(torch.tensor(np.asarray(lin.bias)))

x = torch.from_numpy(x_np)
np.testing.assert_allclose(jax.vmap(lin)(x_np), torch_lin(x).detach(), rtol=1e-6)"""
    ),
    md(
        """## Reading inputs and outputs

An Equinox layer is written for one example and batched with `jax.vmap`, so a hook sees one
example at a time: PyTorch's shapes without the batch dimension. Hooks run while JAX traces the
call, on tracers; to look at concrete values, wrap the hook in `jhooks.host`, which calls it with
NumPy arrays each time the (jitted) computation runs: once per example under `jax.vmap`.

### PyTorch"""
    ),
    code(
        """torch_inputs, torch_outputs = [], []
h_pre = torch_lin.register_forward_pre_hook(lambda m, args: torch_inputs.append(args[0].clone()))
h_out = torch_lin.register_forward_hook(lambda m, args, out: torch_outputs.append(out.detach()))
torch_lin(x)
h_pre.remove()
h_out.remove()
print("PyTorch: input", tuple(torch_inputs[0].shape), "output", tuple(torch_outputs[0].shape))"""
    ),
    md("""### jhooks"""),
    code(
        """jax_inputs, jax_outputs = [], []
handles = [
    lin.register_forward_pre_hook(jhooks.host(lambda m, args: jax_inputs.append(args[0]))),
    lin.register_forward_hook(jhooks.host(lambda m, args, out: jax_outputs.append(out))),
]
jax.jit(jax.vmap(lin))(x_np)
jax.effects_barrier()  # wait for the host hooks
for h in handles:
    h.remove()
print(
    "jhooks: calls", len(jax_inputs), "input", jax_inputs[0].shape, "output", jax_outputs[0].shape
)

assert len(jax_inputs) == len(jax_outputs) == 5  # once per example
np.testing.assert_allclose(np.stack(jax_inputs), torch_inputs[0])
np.testing.assert_allclose(np.stack(jax_outputs), torch_outputs[0], rtol=1e-6)"""
    ),
    md(
        """## Replacing inputs and outputs

A pre-hook that returns something replaces the positional arguments (a non-tuple is wrapped as
`(value,)`), a forward hook that returns something replaces the output. These hooks compute with
`jax.numpy`, so they are traced into the jitted program: no host hook is needed.

### PyTorch"""
    ),
    code(
        """handles = [
    torch_lin.register_forward_pre_hook(lambda m, args: args[0] * 2),  # double the input
    torch_lin.register_forward_hook(lambda m, args, out: torch.tanh(out)),  # squash the output
]
torch_replaced = torch_lin(x).detach()
for h in handles:
    h.remove()
print(torch_replaced)"""
    ),
    md("""### jhooks"""),
    code(
        """handles = [
    lin.register_forward_pre_hook(lambda m, args: args[0] * 2),  # double the input
    lin.register_forward_hook(lambda m, args, out: jnp.tanh(out)),  # squash the output
]
replaced = jax.jit(jax.vmap(lin))(x_np)
for h in handles:
    h.remove()
plain = jax.jit(jax.vmap(lin))(x_np)  # the hooks are gone: the plain layer again
print(replaced)

np.testing.assert_allclose(replaced, torch_replaced, rtol=1e-6)
np.testing.assert_allclose(replaced, jnp.tanh(jax.vmap(lin)(2 * x_np)), rtol=1e-6)
np.testing.assert_allclose(plain, torch_lin(x).detach(), rtol=1e-6)"""
    ),
    md(
        """## Keyword arguments: `with_kwargs=True`

With `with_kwargs=True` a pre-hook is called as `hook(module, args, kwargs)` and may return a new
pair `(args, kwargs)`; a forward hook is called as `hook(module, args, kwargs, output)`. Here a
layer takes a keyword argument `scale`; the pre-hook overrides it, and the forward hook reads the
value the call actually used.

### PyTorch"""
    ),
    code(
        """class TorchScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


torch_scaled = TorchScaled()
torch_scaled.lin.load_state_dict(torch_lin.state_dict())
torch_seen_scale = []


def torch_set_scale(module, args, kwargs):
    return args, {**kwargs, "scale": 3.0}


def torch_read_scale(module, args, kwargs, out):
    torch_seen_scale.append(kwargs["scale"])
    return out - kwargs["scale"]


torch_scaled.register_forward_pre_hook(torch_set_scale, with_kwargs=True)
torch_scaled.register_forward_hook(torch_read_scale, with_kwargs=True)
torch_kw = torch_scaled(x, scale=2.0).detach()
print(torch_seen_scale, torch_kw)"""
    ),
    md("""### jhooks"""),
    code(
        """class Scaled(jhooks.Module):  # hookable from construction
    lin: eqx.nn.Linear

    def __call__(self, x, *, scale=1.0):
        return self.lin(x) * scale


scaled = Scaled(lin)
jax_seen_scale = []


def set_scale(module, args, kwargs):
    return args, {**kwargs, "scale": 3.0}


def read_scale(module, args, kwargs, out):
    jax_seen_scale.append(kwargs["scale"])  # a Python float: fine to keep at trace time
    return out - kwargs["scale"]


scaled.register_forward_pre_hook(set_scale, with_kwargs=True)
scaled.register_forward_hook(read_scale, with_kwargs=True)
jax_kw = jax.jit(jax.vmap(lambda x: scaled(x, scale=2.0)))(x_np)
print(jax_seen_scale, jax_kw)

assert jax_seen_scale == torch_seen_scale == [3.0]  # jhooks: one call, at trace time
np.testing.assert_allclose(jax_kw, torch_kw, rtol=1e-6)"""
    ),
    md(
        """## Extracting intermediate feature maps

The usual PyTorch recipe: a forward hook on each layer of interest saves its output in a dict or
list, then the model runs. A small CNN with two convolutions:"""
    ),
    code(
        """class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1)
        self.conv2 = eqx.nn.Conv2d(4, 8, kernel_size=3, key=k2)
        self.fc = eqx.nn.Linear(8 * 4 * 4, 10, key=k3)

    def __call__(self, x):  # one image, (1, 8, 8)
        h = jax.nn.relu(self.conv1(x))
        h = jax.nn.relu(self.conv2(h))
        return self.fc(h.reshape(-1))


class TorchCNN(torch.nn.Module):
    def __init__(self, cnn):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3)
        self.conv2 = torch.nn.Conv2d(4, 8, 3)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)
        with torch.no_grad():  # copy the weights; an Equinox Conv2d bias is (out, 1, 1)
            for name in ("conv1", "conv2", "fc"):
                mine, theirs = getattr(self, name), getattr(cnn, name)
                mine.weight.copy_(torch.tensor(np.asarray(theirs.weight)))
                mine.bias.copy_(torch.tensor(np.asarray(theirs.bias).reshape(-1)))

    def forward(self, x):  # a batch, (B, 1, 8, 8)
        h = torch.relu(self.conv1(x))
        h = torch.relu(self.conv2(h))
        return self.fc(h.flatten(1))


cnn = jhooks.hookable(CNN(jax.random.key(1)))
torch_cnn = TorchCNN(cnn)
images_np = rng.normal(size=(6, 1, 8, 8)).astype(np.float32)
images = torch.from_numpy(images_np)"""
    ),
    md("""### PyTorch: save to a dict"""),
    code(
        """torch_features = {}


def save(name):
    def hook(module, args, output):
        torch_features[name] = output.detach()

    return hook


handles = [
    getattr(torch_cnn, name).register_forward_hook(save(name)) for name in ("conv1", "conv2")
]
torch_logits = torch_cnn(images).detach()
for h in handles:
    h.remove()
print({name: tuple(f.shape) for name, f in torch_features.items()})"""
    ),
    md(
        """### jhooks, the wrong way: a Python variable inside `jax.jit`

The same hook in JAX runs while `jax.jit` traces the function, so what it saves is a *tracer*, a
placeholder of the trace, not an array. Once the trace is over the tracer is useless: using it
raises `UnexpectedTracerError`, converting it to NumPy raises `TracerArrayConversionError`. (On a
second call the jitted function does not even trace, and the dict is not touched at all.)"""
    ),
    code(
        """leaked = {}
handle = cnn.conv1.register_forward_hook(lambda m, args, out: leaked.update(conv1=out))
jax.jit(jax.vmap(cnn))(images_np)
handle.remove()
print(type(leaked["conv1"]).__name__)

try:
    leaked["conv1"] + 1.0
    raise AssertionError("expected an error")
except jax.errors.UnexpectedTracerError as error:
    print("UnexpectedTracerError:", str(error).splitlines()[0][:100], "...")"""
    ),
    md(
        """### jhooks, the right way: `jhooks.run_with_cache`

In JAX a value leaves a jitted function by being *returned*. `jhooks.run_with_cache(fn, *args)`
calls `fn` and returns `(out, cache)`, where `cache` maps names to the activations at named points;
the output of every hookable module is such a point, named by its path (`"conv1"`, `"conv2"`).
`names_filter` picks which ones to keep, so under `jax.jit` only those stay in memory.

Here the run is inside the `vmap` over the batch, so the cache gets the batch dimension back,
exactly PyTorch's shapes. A run outside it gives the same: points reached under a `jax.vmap`,
`lax.scan`, `lax.cond` or nested `jax.jit` within `fn` come back stacked along the batch (or loop)
axis."""
    ),
    code(
        """@jax.jit
def features(images):
    return jax.vmap(lambda x: jhooks.run_with_cache(cnn, x, names_filter=["conv1", "conv2"]))(
        images
    )


logits, cache = features(images_np)
print({name: f.shape for name, f in cache.items()})

np.testing.assert_allclose(logits, torch_logits, rtol=1e-5, atol=1e-6)
for name in ("conv1", "conv2"):
    np.testing.assert_allclose(cache[name], torch_features[name], rtol=1e-5, atol=1e-6)"""
    ),
    md(
        """Named points are not limited to module outputs: `jhooks.hook_point(x, "name")` marks any
intermediate value in your own code (it is the identity outside a run), and
`jhooks.run_with_hooks(fn, x, fwd_hooks=[(name, hook)])` edits them. See the API reference.

### jhooks, the PyTorch way: a host hook that saves to a list

When the feature maps are for logging rather than for further computation, a `jhooks.host` hook
does what the PyTorch hook does: it receives NumPy arrays on the host each time the compiled
function runs (one example at a time under `jax.vmap`), and may append them to any Python
list."""
    ),
    code(
        """host_features = {"conv1": [], "conv2": []}
handles = [
    getattr(cnn, name).register_forward_hook(
        jhooks.host(lambda m, args, out, name=name: host_features[name].append(out))
    )
    for name in ("conv1", "conv2")
]
jax.jit(jax.vmap(cnn))(images_np)
jax.effects_barrier()
for h in handles:
    h.remove()

for name in ("conv1", "conv2"):
    assert len(host_features[name]) == 6  # one call per image
    np.testing.assert_allclose(
        np.stack(host_features[name]), torch_features[name], rtol=1e-5, atol=1e-6
    )"""
    ),
]


NOTEBOOKS["03_module_backward_hooks.ipynb"] = [
    md(
        """# Module backward hooks: `register_full_backward_hook`

| PyTorch | jhooks |
|---|---|
| `layer.register_full_backward_hook(hook)` | `layer.register_full_backward_hook(hook)` |
| `layer.register_full_backward_pre_hook(hook)` | `layer.register_full_backward_pre_hook(hook)` |
| `layer.register_backward_hook(hook)` (deprecated) | the same name: warns, acts as the full hook |

`hook(module, grad_input, grad_output)` runs in the backward pass: `grad_output` holds the
gradients of the module's outputs, `grad_input` those of its positional inputs (`None` for an
input no gradient is computed for), and a returned tuple replaces `grad_input`. Each comparison
below puts a PyTorch cell next to its jhooks twin, from the same weights, and ends with
`np.testing.assert_allclose`."""
    ),
    code(
        """import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks


class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 3, kernel_size=3, key=k1)
        self.fc = eqx.nn.Linear(3 * 4 * 4, 5, key=k2)

    def __call__(self, x):  # one image, (1, 6, 6)
        return self.fc(jax.nn.relu(self.conv(x)).reshape(-1))


class TorchNet(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.fc = torch.nn.Linear(3 * 4 * 4, 5)
        with torch.no_grad():  # copy the weights; an Equinox Conv2d bias is (out, 1, 1)
            for name in ("conv", "fc"):
                mine, theirs = getattr(self, name), getattr(net, name)
                mine.weight.copy_(torch.tensor(np.asarray(theirs.weight)))
                mine.bias.copy_(torch.tensor(np.asarray(theirs.bias).reshape(-1)))

    def forward(self, x):  # a batch, (B, 1, 6, 6)
        return self.fc(torch.relu(self.conv(x)).flatten(1))


rng = np.random.default_rng(0)
images_np = rng.normal(size=(4, 1, 6, 6)).astype(np.float32)
targets_np = rng.normal(size=(4, 5)).astype(np.float32)


def loss_fn(net, images, targets):
    return jnp.mean((jax.vmap(net)(images) - targets) ** 2)


def torch_grads(torch_net):
    torch_net.zero_grad()
    out = torch_net(torch.from_numpy(images_np))
    torch.mean((out - torch.from_numpy(targets_np)) ** 2).backward()
    return {name: p.grad.numpy().copy() for name, p in torch_net.named_parameters()}


def assert_same_grads(grads, expected):
    for name, g in jhooks.named_parameters(grads):  # the same names as PyTorch's
        np.testing.assert_allclose(
            np.reshape(g, expected[name].shape), expected[name], rtol=1e-5, atol=1e-6
        )"""
    ),
    md(
        """## Shapes of `grad_input` and `grad_output`

A hook on each layer prints what it receives.

### PyTorch"""
    ),
    code(
        """torch_net = TorchNet(net := jhooks.hookable(Net(jax.random.key(0))))
torch_shapes, torch_grad_output = {}, {}


def torch_show(name):
    def hook(module, grad_input, grad_output):
        shapes = (
            [None if g is None else tuple(g.shape) for g in grad_input],
            [tuple(g.shape) for g in grad_output],
        )
        print(f"{name}: grad_input {shapes[0]}, grad_output {shapes[1]}")
        torch_shapes[name] = shapes
        torch_grad_output[name] = grad_output[0].numpy().copy()

    return hook


handles = [
    getattr(torch_net, name).register_full_backward_hook(torch_show(name))
    for name in ("conv", "fc")
]
expected = torch_grads(torch_net)
for h in handles:
    h.remove()"""
    ),
    md(
        """### jhooks

Shapes are known when JAX traces the backward pass, so a plain Python hook can print them: it
runs once, when the jitted gradient is traced. Values need a `jhooks.host` hook, which runs each
time the compiled gradient runs."""
    ),
    code(
        """jax_shapes, jax_grad_output = {}, {"conv": [], "fc": []}


def show(name):
    def hook(module, grad_input, grad_output):
        shapes = (
            [None if g is None else g.shape for g in grad_input],
            [g.shape for g in grad_output],
        )
        print(f"{name}: grad_input {shapes[0]}, grad_output {shapes[1]}")
        jax_shapes[name] = shapes

    return hook


def keep(name):
    return jhooks.host(
        lambda module, grad_input, grad_output: jax_grad_output[name].append(grad_output[0])
    )


handles = [getattr(net, name).register_full_backward_hook(show(name)) for name in ("conv", "fc")]
handles += [getattr(net, name).register_full_backward_hook(keep(name)) for name in ("conv", "fc")]
grads = jax.jit(jax.grad(loss_fn))(net, images_np, targets_np)
jax.effects_barrier()
for h in handles:
    h.remove()

assert_same_grads(grads, expected)
for name in ("conv", "fc"):
    (torch_in, torch_out), (jax_in, jax_out) = torch_shapes[name], jax_shapes[name]
    assert jax_in == [None if s is None else s[1:] for s in torch_in]  # no batch dimension
    assert jax_out == [s[1:] for s in torch_out]
    assert len(jax_grad_output[name]) == 4  # one call per example
    np.testing.assert_allclose(
        np.stack(jax_grad_output[name]), torch_grad_output[name], rtol=1e-5, atol=1e-7
    )"""
    ),
    md(
        """Two things to read in these shapes:

- **The batch dimension is missing in jhooks.** An Equinox model is written for one example and
  batched with `jax.vmap`, so hooks, like the model, see one example: `(48,)` where PyTorch has
  `(4, 48)`. A host hook is called once per example (4 times here), and stacking what it
  receives gives PyTorch's array. The same holds for forward hooks. (Parameter hooks are the
  exception: the parameters are shared by the examples, so a parameter hook sees the total
  gradient, as in PyTorch.)
- **`grad_input` of `conv` is `(None,)` in both.** The images are data, not differentiated, so
  no gradient is computed for the first layer's input, and PyTorch and jhooks both pass `None`
  (PyTorch also warns, above, that the hook fires from the module's outputs then).

## A hook that adds noise to a gradient

A full backward hook on `fc` adds a fixed noise array to the gradient of its input; that gradient
flows on to `conv`, whose parameter gradients change, while `fc`'s own do not. Both frameworks get
the same noise; it has the shape of one example's `grad_input`, so PyTorch broadcasts it over the
batch and jhooks adds it to every example.

### PyTorch"""
    ),
    code(
        """noise = (0.01 * rng.normal(size=48)).astype(np.float32)

h = torch_net.fc.register_full_backward_hook(lambda m, gi, go: (gi[0] + torch.from_numpy(noise),))
torch_noisy = torch_grads(torch_net)
h.remove()
print({name: float(np.abs(torch_noisy[name] - expected[name]).max()) for name in expected})"""
    ),
    md("""### jhooks"""),
    code(
        """h = net.fc.register_full_backward_hook(lambda m, gi, go: (gi[0] + noise,))
noisy = jax.jit(jax.grad(loss_fn))(net, images_np, targets_np)
h.remove()

assert_same_grads(noisy, torch_noisy)
# The noise reached conv, and only conv.
assert np.abs(noisy.conv.weight - grads.conv.weight).max() > 1e-4
np.testing.assert_allclose(noisy.fc.weight, grads.fc.weight)"""
    ),
    md(
        """## The deprecated `register_backward_hook`

PyTorch's older `register_backward_hook` does not hook the module: it hooks the *last autograd
node* of the module's forward, and passes that node's gradients as `grad_input`. For
`nn.Linear` on a 2-D batch the last node is the fused `addmm(bias, x, weight.T)`, so
`grad_input` holds three gradients, with respect to the bias, to the input and to the
*transposed* weight, where the full hook gives just the input's."""
    ),
    code(
        """rng = np.random.default_rng(1)
x_np = rng.normal(size=(5, 4)).astype(np.float32)
lin = jhooks.hookable(eqx.nn.Linear(4, 3, key=jax.random.key(2)))


def torch_linear_hook(register):
    torch_lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        torch_lin.weight.copy_(torch.tensor(np.asarray(lin.weight)))
        torch_lin.bias.copy_(torch.tensor(np.asarray(lin.bias)))
    x = torch.tensor(x_np, requires_grad=True)
    seen = []
    getattr(torch_lin, register)(lambda m, gi, go: seen.append((gi, go)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (torch_lin(x) ** 2).sum().backward()
    grad_input, grad_output = seen[0]
    print(f"{register}: grad_input shapes {[tuple(g.shape) for g in grad_input]}")
    for w in caught:
        print("   PyTorch warns:", str(w.message)[:120], "...")
    return torch_lin, x, grad_input


torch_lin, x, old_grad_input = torch_linear_hook("register_backward_hook")
_, _, full_grad_input = torch_linear_hook("register_full_backward_hook")

# The deprecated hook's three gradients: the bias's, the input's, and the weight's, transposed.
np.testing.assert_allclose(old_grad_input[0], torch_lin.bias.grad)
np.testing.assert_allclose(old_grad_input[1], x.grad)
np.testing.assert_allclose(old_grad_input[2], torch_lin.weight.grad.T)
# The full hook: the gradient with respect to the module's input only.
np.testing.assert_allclose(full_grad_input[0], x.grad)"""
    ),
    md(
        """What the deprecated hook receives depends on how the forward happens to be implemented.
With a 3-D input, `nn.Linear` runs a reshape and a matrix product, the last node is a reshape,
and `grad_input` becomes a single gradient of a shape that belongs to neither the input nor the
output. (PyTorch warns in both cases that this hook "will be missing some grad_input".)"""
    ),
    code(
        """torch_lin_3d = torch.nn.Linear(4, 3)
seen_3d = []
torch_lin_3d.register_backward_hook(lambda m, gi, go: seen_3d.append([tuple(g.shape) for g in gi]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch_lin_3d(torch.randn(2, 5, 4, requires_grad=True)).sum().backward()
print("grad_input shapes for a (2, 5, 4) input:", seen_3d[0])
assert seen_3d[0] == [(10, 3)]"""
    ),
    md(
        """### jhooks

jhooks has no autograd nodes inside a module to pick from, and the deprecated behaviour is not
worth copying: `register_backward_hook` warns (a `FutureWarning`, PyTorch's deprecation
category) and registers the hook as a full backward hook. Code ported from PyTorch keeps
running, and gets the documented `grad_input`: one gradient per positional input, per example
under `jax.vmap`."""
    ),
    code(
        """jax_grad_input = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    h = lin.register_backward_hook(jhooks.host(lambda m, gi, go: jax_grad_input.append(gi)))
print("jhooks warns:", caught[0].category.__name__, str(caught[0].message))
assert issubclass(caught[0].category, FutureWarning)


def square_loss(x):
    return jnp.sum(jax.vmap(lin)(x) ** 2)


grad_x = jax.jit(jax.grad(square_loss))(x_np)
jax.effects_barrier()
h.remove()
print(
    "grad_input per example:", [g.shape for g in jax_grad_input[0]], "calls:", len(jax_grad_input)
)

assert all(len(gi) == 1 for gi in jax_grad_input)  # the input's gradient only, as the full hook
np.testing.assert_allclose(
    np.stack([gi[0] for gi in jax_grad_input]), full_grad_input[0], rtol=1e-6
)
np.testing.assert_allclose(grad_x, x.grad, rtol=1e-6)"""
    ),
]


NOTEBOOKS["04_gradient_surgery_training.ipynb"] = [
    md(
        """# Gradient surgery in a training loop

A Conv2d-ReLU-Linear classifier trained with plain SGD in PyTorch (`torch.optim.SGD`) and in JAX
(`optax.sgd` in a jitted step), from the same weights and on the same data, with two pieces of
gradient surgery done by hooks:

- a full backward hook on the ReLU clamps the gradient flowing back out of it to be
  non-negative (`grad_input[0].clamp(min=0)`);
- a parameter hook zeroes the gradient of the linear layer's bias, which therefore never moves.

Host hooks record every parameter's gradient norm at every step, as PyTorch hooks that append
to a list would. The loss curves, the gradient norms and the final weights are compared with
`np.testing.assert_allclose`."""
    ),
    code(
        """import time

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import torch

import jhooks

torch.set_num_threads(1)  # a tiny model: more threads only add overhead


class ReLU(eqx.Module):  # an activation as a module, as torch.nn.ReLU, so that it can be hooked
    def __call__(self, x):
        return jax.nn.relu(x)


class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    act: ReLU
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1)
        self.act = ReLU()
        self.fc = eqx.nn.Linear(4 * 6 * 6, 4, key=k2)

    def __call__(self, x):  # one image, (1, 8, 8)
        return self.fc(self.act(self.conv(x)).reshape(-1))


class TorchNet(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.act = torch.nn.ReLU()
        self.fc = torch.nn.Linear(4 * 6 * 6, 4)
        with torch.no_grad():  # copy the weights; an Equinox Conv2d bias is (out, 1, 1)
            for name in ("conv", "fc"):
                mine, theirs = getattr(self, name), getattr(net, name)
                mine.weight.copy_(torch.tensor(np.asarray(theirs.weight)))
                mine.bias.copy_(torch.tensor(np.asarray(theirs.bias).reshape(-1)))

    def forward(self, x):  # a batch, (B, 1, 8, 8)
        return self.fc(self.act(self.conv(x)).flatten(1))


# Data: 64 random 8x8 images, 4 classes given by a random linear "teacher".
rng = np.random.default_rng(0)
images_np = rng.normal(size=(64, 1, 8, 8)).astype(np.float32)
labels_np = np.argmax(images_np.reshape(64, -1) @ rng.normal(size=(64, 4)), axis=1).astype(np.int32)

STEPS, LEARNING_RATE = 300, 0.05
net = jhooks.hookable(Net(jax.random.key(0)))
torch_net = TorchNet(net)
names = [name for name, _ in jhooks.named_parameters(net)]
assert names == [name for name, _ in torch_net.named_parameters()]
print(names)"""
    ),
    md(
        """## PyTorch

The hooks: a full backward hook on `act`, a gradient hook on each parameter that records its
norm, and one more on `fc.bias` that zeroes its gradient (registered after the recorders, so they
see the gradient before surgery)."""
    ),
    code(
        """torch_norms = {name: [] for name in names}
for name, p in torch_net.named_parameters():
    p.register_hook(lambda g, name=name: torch_norms[name].append(g.norm().item()))
torch_net.act.register_full_backward_hook(lambda m, gi, go: (gi[0].clamp(min=0),))
torch_net.fc.bias.register_hook(torch.zeros_like)

optimizer = torch.optim.SGD(torch_net.parameters(), lr=LEARNING_RATE)
images, labels = torch.from_numpy(images_np), torch.from_numpy(labels_np).long()
torch_bias0 = torch_net.fc.bias.detach().clone()
torch_losses = []
start = time.perf_counter()
for step in range(STEPS):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(torch_net(images), labels)
    loss.backward()
    optimizer.step()
    torch_losses.append(loss.item())
seconds = time.perf_counter() - start
print(f"PyTorch: {STEPS} steps in {seconds:.2f} s, ", end="")
print(f"loss {torch_losses[0]:.4f} -> {torch_losses[-1]:.4f}")"""
    ),
    md(
        """## jhooks

The same hooks on the Equinox model. The clamp and the zeroing are computations, traced into the
jitted step; the norm recorders need concrete values, so they are `jhooks.host` hooks, called
with NumPy arrays every time the compiled step runs. Parameter hooks see the total gradient over
the batch (the parameters are shared by the examples of `jax.vmap`), as in PyTorch.

Hooks live in the model's static structure, so every copy that `eqx.apply_updates` makes of the
model keeps them, and the step is traced once."""
    ),
    code(
        """jax_norms = {name: [] for name in names}
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
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    losses = []
    for step in range(STEPS):
        model, opt_state, loss = train_step(model, opt_state, images_np, labels_np)
        losses.append(loss)
    losses = np.asarray(losses)  # waits for the last step
    jax.effects_barrier()  # and for the host hooks
    return model, losses


start = time.perf_counter()
model, jax_losses = train(net)
print(
    f"jhooks: {STEPS} steps in {time.perf_counter() - start:.2f} s (compilation included), "
    f"loss {jax_losses[0]:.4f} -> {jax_losses[-1]:.4f}, traced {len(traces)} time(s)"
)
assert len(traces) == 1"""
    ),
    md(
        """## The two runs agree

Both runs compute in float32, but not with the same operations in the same order (XLA's
convolution and reductions against PyTorch's), so each step differs by rounding, about `1e-7`
relative, and those differences are carried from step to step through the weights. Over 300 steps
they stay below `1e-6` (the cell prints the largest); the comparison allows `rtol=1e-4`, a
hundred times more, and still far less than what a wrong gradient gives: leaving out the clamp
changes the loss by `1e-3` relative at the first update and by 4% after ten (checked below). The
final weights agree to about `1e-7`, compared with `rtol=1e-5, atol=1e-6`.

The bias of `fc` never moved in either framework: its gradient was zeroed at every step."""
    ),
    code(
        """print(
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
for (name, p), (_, torch_p) in zip(jhooks.named_parameters(model), torch_net.named_parameters()):
    np.testing.assert_allclose(np.reshape(p, torch_p.shape), torch_p.detach(), rtol=1e-5, atol=1e-6)
assert not np.array_equal(model.fc.weight, net.fc.weight)"""
    ),
    md(
        """## What the clamp did

The loss went *up*. With only non-negative gradients flowing back out of the ReLU, every SGD
update of the convolution can only lower its outputs where they are active (the bias gradient is
a sum of non-negative terms), so the ReLUs die one after another and the network ends up
predicting nearly the same thing for every image: a loss near `ln 4`, the loss of a uniform
guess. Both frameworks agree on that too. For reference, the same jitted step without the clamp:
removing the hook through its handle makes the step retrace once, and the model then learns
the task (the host recorders are removed as well, to keep their lists as they were)."""
    ),
    code(
        """def active_fraction(conv, images):
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
_, unclamped_losses = train(net)
print(f"without the clamp: loss {unclamped_losses[0]:.4f} -> {unclamped_losses[-1]:.4f}")
print(f"the step was traced {len(traces)} times")
assert len(traces) == 2 and unclamped_losses[-1] < 0.1
np.testing.assert_allclose(unclamped_losses[0], jax_losses[0])  # the same start, then:
early = np.abs(unclamped_losses[:10] - jax_losses[:10]) / jax_losses[:10]
print("relative effect of the clamp on the loss, first steps:", np.round(early, 4))
assert early[1] > 10 * 1e-4 and early[9] > 0.02  # far beyond the rtol of the comparison"""
    ),
    md(
        """## Loss curves and gradient norms

The left plot draws both loss curves on one figure (they overlap), and the run without the clamp
in gray; the right one the gradient norm
of each parameter at each step, as the host hooks recorded them, for jhooks (lines) and PyTorch
(dots, every tenth step). `fc.bias` does have a gradient: the recorders see it before the
hook registered after them zeroes it."""
    ),
    code(
        """fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(11, 4))
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
fig.tight_layout()"""
    ),
]


NOTEBOOKS["05_node_and_multi_grad_hooks.ipynb"] = [
    md(
        """# Node hooks and multi-grad hooks

| PyTorch | jhooks |
|---|---|
| `c.grad_fn` | `node = jhooks.Node(fn)`; `node(*args)` |
| `c.grad_fn.register_prehook(hook)` | `node.register_prehook(hook)` |
| `c.grad_fn.register_hook(hook)` | `node.register_hook(hook)` |
| `register_multi_grad_hook(ts, fn)` | `ts = jhooks.register_multi_grad_hook(ts, fn)` |

(`register_multi_grad_hook` is in `torch.autograd.graph`.) Hook signatures are PyTorch's:
`prehook(grad_outputs)` and `hook(grad_inputs, grad_outputs)`.

A PyTorch `grad_fn` is the autograd node PyTorch made for one operation; a `jhooks.Node` wraps a
function of your choice. Each comparison ends with `np.testing.assert_allclose`."""
    ),
    code(
        """import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

a_np = np.array([1.0, 2.0, 3.0], np.float32)
b_np = np.array([4.0, 5.0, 6.0], np.float32)
w_np = np.array([1.0, -1.0, 0.5], np.float32)  # loss = sum(w * a * b)"""
    ),
    md(
        """## Node hooks

A pre-hook receives `grad_outputs` (the gradients of the node's outputs) and may replace them; a
hook receives `(grad_inputs, grad_outputs)` after the node's backward and may replace
`grad_inputs`. Below, observers record what each hook sees, a pre-hook doubles `grad_outputs`,
and a hook drops the gradient of `b`.

### PyTorch"""
    ),
    code(
        """a = torch.tensor(a_np, requires_grad=True)
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
print("a.grad", a.grad, "b.grad", b.grad)"""
    ),
    md(
        """### jhooks

The observers need concrete values, so they are host hooks. Hooks added to a node stay until their
handle is removed, as in PyTorch."""
    ),
    code(
        """@jhooks.Node
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
np.testing.assert_allclose(grad_a, 2 * w_np * b_np)"""
    ),
    md(
        """### Handles, and what `jax.jit` does when hooks change

Node hooks live outside the traced function, so jhooks makes them part of the jit cache key: a
jitted step retraces when a hook is added or removed, and gets its compiled program back when the
set of hooks is one it has seen. `with handle:` removes a hook on exit."""
    ),
    code(
        """for h in handles:
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
np.testing.assert_allclose(scaled, a.grad)"""
    ),
    md(
        """## Multi-grad hooks, `mode="all"`

One hook over several values, called once per backward pass with a tuple holding each value's
gradient, `None` for a value no gradient reached. Here `h2` is computed but not used by the loss.

### PyTorch"""
    ),
    code(
        """x_np = np.array([1.0, 2.0], np.float32)

x = torch.tensor(x_np, requires_grad=True)
h1, h2 = x * 2, x**2
torch_all = []
torch.autograd.graph.register_multi_grad_hook((h1, h2), lambda grads: torch_all.append(grads))
(3 * h1).sum().backward()
print(torch_all)"""
    ),
    md(
        """### jhooks

The returned values carry the hook: compute the loss from them."""
    ),
    code(
        """jax_all = []


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
np.testing.assert_allclose(grad_x, x.grad)"""
    ),
    md(
        """## Multi-grad hooks, `mode="any"`

With `mode="any"` the hook is called once, with one gradient. PyTorch passes the gradient of the
tensor its backward pass reaches first; for two values computed independently it runs the most
recently created node first, so `h2`'s. jhooks builds the whole backward pass before running it
and passes the gradient of the first value *in the order given* that received one. Given as
`(h2, h1)`, both pick `h2`; given as `(h1, h2)`, PyTorch still picks `h2` and jhooks picks `h1`.

### PyTorch"""
    ),
    code(
        """def torch_any(order):
    x = torch.tensor(x_np, requires_grad=True)
    h1, h2 = x * 2, x**2
    seen = []
    values = (h2, h1) if order == "h2 first" else (h1, h2)
    torch.autograd.graph.register_multi_grad_hook(values, seen.append, mode="any")
    (3 * h1 + h2).sum().backward()
    return seen


print(torch_any("h2 first"), torch_any("h1 first"))"""
    ),
    md("""### jhooks"""),
    code(
        """def jax_any(order):
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
np.testing.assert_allclose(torch_any("h1 first")[0], grad_h2)"""
    ),
]

NOTEBOOKS["06_interpretability.ipynb"] = [
    md(
        """# Interpretability: hook points, activation caches, patching and attribution

Researchers who read and edit activations use TransformerLens-style *hook points* in PyTorch:
identity modules at every interesting activation, with forward hooks to read or patch them and
backward hooks for their gradients. jhooks gives the same workflow in JAX, as values, so it runs
under `jax.jit` and `jax.vmap`:

| TransformerLens / PyTorch | jhooks |
|---|---|
| `self.hook_z = HookPoint()`, `z = self.hook_z(z)` | `z = jhooks.hook_point(z, "…hook_z")` |
| `model.run_with_hooks(x, fwd_hooks=hooks)` | `jhooks.run_with_hooks(model, x, fwd_hooks=hooks)` |
| `logits, cache = model.run_with_cache(x)` | `logits, cache = jhooks.run_with_cache(model, x)` |
| `output.retain_grad()` on each cached activation | `jhooks.run_with_cache(fn, x, incl_bwd=True)` |

We build a small transformer in Equinox (attention from `eqx.nn.MultiheadAttention`'s
projections, an MLP, layer norms) and its PyTorch twin with the same weights, then

1. cache every activation,
2. patch one attention head's output from a corrupted run into a clean run (activation patching),
3. compute gradient × activation attributions (and attribution patching).

The PyTorch side uses nothing but `register_forward_hook`, `Tensor.retain_grad` and
`Tensor.register_hook`, and every result is checked with `np.testing.assert_allclose`, both
under `jax.jit` and without it."""
    ),
    code(
        """import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import jhooks

VOCAB, D, HEADS, D_MLP, LAYERS = 12, 16, 4, 32, 2
D_HEAD = D // HEADS


def check(jax_value, torch_value, rtol=1e-5, atol=1e-6):
    if isinstance(torch_value, torch.Tensor):
        torch_value = torch_value.detach().numpy()
    np.testing.assert_allclose(np.asarray(jax_value), torch_value, rtol=rtol, atol=atol)"""
    ),
    md(
        """## The Equinox model

A hook point is the identity until a `run_with_hooks` or `run_with_cache` call is active, so
marking points costs nothing in ordinary use. Each module is given its path as a name, so the
point names match PyTorch's `named_modules()` below. Attention uses the four projections of an
`eqx.nn.MultiheadAttention` but computes the heads itself, so that each head's output `z` is a
point."""
    ),
    code(
        """class Attention(eqx.Module):
    mha: eqx.nn.MultiheadAttention
    name: str = eqx.field(static=True)

    def __init__(self, name, key):
        self.name = name
        self.mha = eqx.nn.MultiheadAttention(
            HEADS,
            D,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=key,
        )

    def __call__(self, x):
        seq = x.shape[0]

        def heads(proj, kind):
            h = jax.vmap(proj)(x).reshape(seq, HEADS, D_HEAD)
            return jhooks.hook_point(h, f"{self.name}.hook_{kind}")

        q = heads(self.mha.query_proj, "q")
        k = heads(self.mha.key_proj, "k")
        v = heads(self.mha.value_proj, "v")
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(D_HEAD)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores, -jnp.inf)
        pattern = jhooks.hook_point(jax.nn.softmax(scores, axis=-1), f"{self.name}.hook_pattern")
        z = jhooks.hook_point(jnp.einsum("hqk,khd->qhd", pattern, v), f"{self.name}.hook_z")
        return jax.vmap(self.mha.output_proj)(z.reshape(seq, D))


class MLP(eqx.Module):
    fc_in: eqx.nn.Linear
    fc_out: eqx.nn.Linear
    name: str = eqx.field(static=True)

    def __init__(self, name, key):
        k1, k2 = jax.random.split(key)
        self.name = name
        self.fc_in = eqx.nn.Linear(D, D_MLP, key=k1)
        self.fc_out = eqx.nn.Linear(D_MLP, D, key=k2)

    def __call__(self, x):
        post = jax.nn.gelu(jax.vmap(self.fc_in)(x), approximate=False)
        post = jhooks.hook_point(post, f"{self.name}.hook_post")
        return jax.vmap(self.fc_out)(post)


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: Attention
    ln2: eqx.nn.LayerNorm
    mlp: MLP
    name: str = eqx.field(static=True)

    def __init__(self, name, key):
        k1, k2 = jax.random.split(key)
        self.name = name
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = Attention(f"{name}.attn", k1)
        self.mlp = MLP(f"{name}.mlp", k2)

    def __call__(self, x):
        attn_out = self.attn(jax.vmap(self.ln1)(x))
        x = x + jhooks.hook_point(attn_out, f"{self.name}.hook_attn_out")
        mlp_out = self.mlp(jax.vmap(self.ln2)(x))
        x = x + jhooks.hook_point(mlp_out, f"{self.name}.hook_mlp_out")
        return jhooks.hook_point(x, f"{self.name}.hook_resid_post")


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list[Block]
    ln_final: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, key, max_len=8):
        keys = jax.random.split(key, LAYERS + 3)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
        self.pos = 0.1 * jax.random.normal(keys[1], (max_len, D))
        self.blocks = [Block(f"blocks.{i}", keys[3 + i]) for i in range(LAYERS)]
        self.ln_final = eqx.nn.LayerNorm(D)
        self.unembed = eqx.nn.Linear(D, VOCAB, use_bias=False, key=keys[2])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
        x = jhooks.hook_point(x, "hook_embed")
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembed)(jax.vmap(self.ln_final)(x))


model = Transformer(jax.random.PRNGKey(0))

# The attention computed head by head is eqx.nn.MultiheadAttention's own.
x = jax.random.normal(jax.random.PRNGKey(1), (5, D))
attn = model.blocks[0].attn
causal = jnp.tril(jnp.ones((5, 5), bool))
np.testing.assert_allclose(attn(x), attn.mha(x, x, x, mask=causal), rtol=1e-5, atol=1e-6)"""
    ),
    md(
        """## Its PyTorch twin

TransformerLens's `HookPoint` is an identity module that hooks attach to; `torch.nn.Identity`
does the same job. The weights are copied from the Equinox model."""
    ),
    code(
        """class TorchAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))
        for kind in ("q", "k", "v", "pattern", "z"):
            setattr(self, f"hook_{kind}", torch.nn.Identity())

    def forward(self, x):
        seq = x.shape[0]
        q = self.hook_q(self.q(x).view(seq, HEADS, D_HEAD))
        k = self.hook_k(self.k(x).view(seq, HEADS, D_HEAD))
        v = self.hook_v(self.v(x).view(seq, HEADS, D_HEAD))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D_HEAD)
        causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        pattern = self.hook_pattern(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        z = self.hook_z(torch.einsum("hqk,khd->qhd", pattern, v))
        return self.o(z.reshape(seq, D))


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in, self.fc_out = torch.nn.Linear(D, D_MLP), torch.nn.Linear(D_MLP, D)
        self.hook_post = torch.nn.Identity()

    def forward(self, x):
        return self.fc_out(self.hook_post(torch.nn.functional.gelu(self.fc_in(x))))


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.attn, self.mlp = TorchAttention(), TorchMLP()
        self.hook_attn_out, self.hook_mlp_out = torch.nn.Identity(), torch.nn.Identity()
        self.hook_resid_post = torch.nn.Identity()

    def forward(self, x):
        x = x + self.hook_attn_out(self.attn(self.ln1(x)))
        x = x + self.hook_mlp_out(self.mlp(self.ln2(x)))
        return self.hook_resid_post(x)


class TorchTransformer(torch.nn.Module):
    def __init__(self, max_len=8):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Parameter(torch.zeros(max_len, D))
        self.hook_embed = torch.nn.Identity()
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(LAYERS))
        self.ln_final = torch.nn.LayerNorm(D)
        self.unembed = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.hook_embed(self.embed(tokens) + self.pos[: tokens.shape[0]])
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_final(x))


def copy_weights(model):
    tmodel = TorchTransformer()
    pairs = [(tmodel.embed.weight, model.embed.weight), (tmodel.pos, model.pos)]
    pairs += [(tmodel.ln_final.weight, model.ln_final.weight)]
    pairs += [(tmodel.ln_final.bias, model.ln_final.bias)]
    pairs += [(tmodel.unembed.weight, model.unembed.weight)]
    for tb, b in zip(tmodel.blocks, model.blocks):
        linears = [
            (tb.attn.q, b.attn.mha.query_proj),
            (tb.attn.k, b.attn.mha.key_proj),
            (tb.attn.v, b.attn.mha.value_proj),
            (tb.attn.o, b.attn.mha.output_proj),
            (tb.mlp.fc_in, b.mlp.fc_in),
            (tb.mlp.fc_out, b.mlp.fc_out),
            (tb.ln1, b.ln1),
            (tb.ln2, b.ln2),
        ]
        for t, e in linears:
            pairs += [(t.weight, e.weight), (t.bias, e.bias)]
    with torch.no_grad():
        for t, e in pairs:
            assert t.shape == e.shape
            t.copy_(torch.from_numpy(np.array(e)))
    return tmodel


tmodel = copy_weights(model)
hook_modules = {n: m for n, m in tmodel.named_modules() if n.split(".")[-1].startswith("hook_")}

clean = jnp.array([1, 5, 2, 9, 4, 7])
corrupted = jnp.array([1, 8, 2, 9, 4, 7])  # the second token changed
clean_t, corrupted_t = (torch.from_numpy(np.asarray(t)) for t in (clean, corrupted))

check(model(clean), tmodel(clean_t))
print(len(hook_modules), "hook points:", list(hook_modules)[:8], "...")"""
    ),
    md(
        """## 1. Cache every activation

`run_with_cache` returns the activations as values. Under `jax.jit` only the points selected by
`names_filter` are outputs of the compiled program, so only they are kept in memory (see
`benchmarks/cache_memory.py`). In PyTorch, the same cache is a forward hook on every hook
module that stores its output."""
    ),
    code(
        """logits, cache = jhooks.run_with_cache(model, clean)

torch_cache = {}
handles = [
    module.register_forward_hook(lambda m, args, out, name=name: torch_cache.__setitem__(name, out))
    for name, module in hook_modules.items()
]
with torch.no_grad():
    torch_logits = tmodel(clean_t)
for h in handles:
    h.remove()

assert set(cache) == set(torch_cache) == set(hook_modules)
check(logits, torch_logits)
for name in cache:
    check(cache[name], torch_cache[name])

# The same under jax.jit, with a filter: only the attention patterns come back.
jit_logits, patterns = jax.jit(
    lambda tokens: jhooks.run_with_cache(model, tokens, names_filter=lambda n: "pattern" in n)
)(clean)
assert sorted(patterns) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
check(jit_logits, torch_logits)
for name, pattern in patterns.items():
    check(pattern, torch_cache[name])
print({name: value.shape for name, value in cache.items() if name.startswith("blocks.0")})"""
    ),
    md(
        """A name that is not a point raises an error listing the close matches, once the function
has been traced (so inside `jax.jit` too):"""
    ),
    code(
        """try:
    jhooks.run_with_cache(model, clean, names_filter=["blocks.0.attn.hook_zz"])
except ValueError as error:
    print(error)
    assert "Did you mean 'blocks.0.attn.hook_z'" in str(error)"""
    ),
    md(
        """Batches are a `jax.vmap` away: the hooks run per example, and the cache comes back
stacked."""
    ),
    code(
        """batch = jnp.stack([clean, corrupted])
batch_logits, batch_cache = jax.vmap(
    lambda tokens: jhooks.run_with_cache(model, tokens, names_filter="blocks.1.hook_resid_post")
)(batch)
with torch.no_grad():
    for i, tokens in enumerate((clean_t, corrupted_t)):
        check(batch_logits[i], tmodel(tokens))
check(batch_cache["blocks.1.hook_resid_post"][0], torch_cache["blocks.1.hook_resid_post"])"""
    ),
    md(
        """## 2. Activation patching: one head from a corrupted run

The metric is the logit difference between two answer tokens at the last position. We cache
every head's output `z` on the corrupted prompt, then rerun the clean prompt with one head of one
layer replaced by its corrupted value, and see how much of the metric moves. The whole scan is
one jitted function; the head index is a traced value, so `jax.vmap` runs all heads of a layer in
one go. One head is also patched without `jax.jit`, for comparison."""
    ),
    code(
        """ANSWER, WRONG = 3, 6


def metric(logits):
    return logits[-1, ANSWER] - logits[-1, WRONG]


def z_name(layer):
    return f"blocks.{layer}.attn.hook_z"


def is_z(name):
    return name.endswith("hook_z")


def patch_effect(model, clean, corrupted_z, layer, head):
    # How much the metric moves when head `head` of `layer` takes its corrupted value.

    def patch(z, name):
        return z.at[:, head].set(corrupted_z[:, head])

    logits = jhooks.run_with_hooks(model, clean, fwd_hooks=[(z_name(layer), patch)])
    return metric(logits) - metric(model(clean))


@jax.jit
def patching_effects(model, clean, corrupted):
    _, corrupted_cache = jhooks.run_with_cache(model, corrupted, names_filter=is_z)
    heads = jnp.arange(HEADS)
    return jnp.stack(
        [
            jax.vmap(lambda h: patch_effect(model, clean, corrupted_cache[z_name(l)], l, h))(heads)
            for l in range(LAYERS)
        ]
    )


effects = patching_effects(model, clean, corrupted)

# Without jax.jit, one head at a time.
_, corrupted_cache = jhooks.run_with_cache(model, corrupted, names_filter=is_z)
eager_effect = patch_effect(model, clean, corrupted_cache[z_name(1)], 1, 2)
check(eager_effect, effects[1, 2], atol=1e-6)

# PyTorch: a forward hook on the hook_z module that overwrites one head.
torch_corrupted = {}
handles = [
    hook_modules[z_name(layer)].register_forward_hook(
        lambda m, args, out, layer=layer: torch_corrupted.__setitem__(layer, out)
    )
    for layer in range(LAYERS)
]
with torch.no_grad():
    tmodel(corrupted_t)
for h in handles:
    h.remove()
with torch.no_grad():
    torch_clean_metric = metric(tmodel(clean_t))


def torch_patch(layer, head):
    def hook(module, args, output):
        output = output.clone()
        output[:, head] = torch_corrupted[layer][:, head]
        return output

    with hook_modules[z_name(layer)].register_forward_hook(hook), torch.no_grad():
        return (metric(tmodel(clean_t)) - torch_clean_metric).item()


torch_effects = torch.tensor([[torch_patch(l, h) for h in range(HEADS)] for l in range(LAYERS)])
check(effects, torch_effects, atol=1e-5)
print("clean metric:", float(metric(model(clean))))
print("change in the metric when one head is patched (layer x head):")
print(np.round(np.asarray(effects), 4))"""
    ),
    md(
        """## 3. Gradient × activation attributions

With `incl_bwd=True` (for a scalar-valued function), `run_with_cache` also returns the gradient
of the output with respect to each selected activation, under `name + "_grad"`: PyTorch's
`retain_grad` on every cached activation. The gradients come from `jhooks.retain_grad` probes,
so they too are values.

Gradient × activation, summed over a head's positions and features, scores each head;
*attribution patching* multiplies the gradient by `z_corrupted - z_clean` instead, a first-order
estimate of the patching effects above from one forward and one backward pass."""
    ),
    code(
        """@jax.jit
def attributions(model, clean, corrupted):
    value, cache = jhooks.run_with_cache(
        lambda tokens: metric(model(tokens)), clean, names_filter=is_z, incl_bwd=True
    )
    _, corrupted_cache = jhooks.run_with_cache(model, corrupted, names_filter=is_z)
    grad_x_act, estimate = [], []
    for layer in range(LAYERS):
        z, grad = cache[z_name(layer)], cache[z_name(layer) + "_grad"]
        grad_x_act.append(jnp.sum(z * grad, axis=(0, 2)))
        estimate.append(jnp.sum((corrupted_cache[z_name(layer)] - z) * grad, axis=(0, 2)))
    return value, cache, jnp.stack(grad_x_act), jnp.stack(estimate)


value, grad_cache, grad_x_act, estimate = attributions(model, clean, corrupted)
assert sorted(grad_cache) == sorted(
    [z_name(l) for l in range(LAYERS)] + [z_name(l) + "_grad" for l in range(LAYERS)]
)
# Without jax.jit: the same value, activation and gradient.
eager_value, eager_cache = jhooks.run_with_cache(
    lambda tokens: metric(model(tokens)), clean, names_filter=z_name(1), incl_bwd=True
)
check(eager_value, value)
for name in (z_name(1), z_name(1) + "_grad"):
    check(eager_cache[name], grad_cache[name])

# PyTorch: retain_grad on each hook_z output, then backward.
outputs = {}


def keep(layer):
    def hook(module, args, output):
        output.retain_grad()
        outputs[layer] = output

    return hook


handles = [hook_modules[z_name(l)].register_forward_hook(keep(l)) for l in range(LAYERS)]
torch_value = metric(tmodel(clean_t))
torch_value.backward()
for h in handles:
    h.remove()
torch_grad_x_act = torch.stack([(outputs[l] * outputs[l].grad).sum((0, 2)) for l in range(LAYERS)])
torch_estimate = torch.stack(
    [((torch_corrupted[l] - outputs[l]) * outputs[l].grad).sum((0, 2)) for l in range(LAYERS)]
)

check(value, torch_value)
for l in range(LAYERS):
    check(grad_cache[z_name(l) + "_grad"], outputs[l].grad)
check(grad_x_act, torch_grad_x_act, atol=1e-5)
check(estimate, torch_estimate, atol=1e-5)
print("gradient x activation (layer x head):")
print(np.round(np.asarray(grad_x_act), 4))
print("attribution patching estimate vs actual patching effect:")
print(np.round(np.stack([np.asarray(estimate), np.asarray(effects)], axis=-1), 4))"""
    ),
    md(
        """## Backward hooks on a point

`bwd_hooks` edit the gradient flowing through a point, as `Tensor.register_hook` does. Here we
block the gradient through head 0 of layer 1 and take the gradient of the metric with respect to
the embeddings."""
    ),
    code(
        """def block_head0(grad, name):
    return grad.at[:, 0].set(0.0)


def embed_grad(model, tokens):
    def f(embed_weight):
        m = eqx.tree_at(lambda m: m.embed.weight, model, embed_weight)
        logits = jhooks.run_with_hooks(m, tokens, bwd_hooks=[(z_name(1), block_head0)])
        return metric(logits)

    return jax.grad(f)(model.embed.weight)


g = jax.jit(embed_grad)(model, clean)


def torch_block_head0(module, args, output):
    output.register_hook(lambda grad: torch.cat([torch.zeros_like(grad[:, :1]), grad[:, 1:]], 1))


tmodel.zero_grad()
with hook_modules[z_name(1)].register_forward_hook(torch_block_head0):
    metric(tmodel(clean_t)).backward()
check(g, tmodel.embed.weight.grad)
print("embedding gradient norm with head 1.0 blocked:", float(jnp.linalg.norm(g)))"""
    ),
]


def build(name: str) -> nbformat.NotebookNode:
    """The notebook `name`, built from its cells, with no outputs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(NOTEBOOKS[name]):
        cell = (nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell)(
            source
        )
        cell.id = f"cell-{i}"  # stable ids, so that regenerating changes nothing
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def main() -> None:
    for name in NOTEBOOKS:
        nbformat.write(build(name), HERE / name)
        print(f"wrote {HERE / name}", file=sys.stderr)


if __name__ == "__main__":
    main()

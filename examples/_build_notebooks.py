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

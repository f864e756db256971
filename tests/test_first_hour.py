"""The first hour of an Equinox user (issue 18): each task that failed on the first try.

`filter_grad` on an `eqx.nn.MLP` (against Equinox and PyTorch), scoped and unique hook
point names, `loop_index` in jitted blocks, backward hooks and `fori_loop`.
"""

import importlib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

EXAMPLES = Path(__file__).parents[1] / "examples"


def filter_jit_or_not(maybe_jit):
    return eqx.filter_jit if maybe_jit is jax.jit else maybe_jit


# 1. jhooks.filter_grad / filter_value_and_grad: Equinox's convention


def mlp_and_data():
    model = eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 3))
    y = jax.random.normal(jax.random.key(2), (4, 2))
    return model, x, y


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def test_filter_value_and_grad_is_equinoxs_plus_retained(maybe_jit):
    model, x, y = mlp_and_data()

    def loss(model, x, y):
        h = jhooks.retain_grad(jax.vmap(model.layers[0])(x), "h0")
        out = jax.vmap(lambda h: model.layers[2](jax.nn.relu(model.layers[1](jax.nn.relu(h)))))(h)
        return jnp.mean((out - y) ** 2)

    jit = filter_jit_or_not(maybe_jit)
    value, grads, retained = jit(jhooks.filter_value_and_grad(loss))(model, x, y)
    want_value, want_grads = eqx.filter_value_and_grad(loss)(model, x, y)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    # The retained gradient is the gradient of the loss at the first layer's output.
    want_h = jax.grad(
        lambda h: jnp.mean(
            (jax.vmap(model.layers[2])(jax.nn.relu(jax.vmap(model.layers[1])(jax.nn.relu(h)))) - y)
            ** 2
        )
    )(jax.vmap(model.layers[0])(x))
    np.testing.assert_allclose(retained["h0"], want_h, rtol=1e-5, atol=1e-7)

    grads2, retained2 = jit(jhooks.filter_grad(loss))(model, x, y)
    for g, w in zip(jax.tree.leaves(grads2), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(retained2["h0"], want_h, rtol=1e-5, atol=1e-7)


def test_filter_grad_has_aux_and_decorator_forms():
    model, x, y = mlp_and_data()

    @jhooks.filter_grad(has_aux=True)
    def loss(model, x, y):
        value = mse(model, x, y)
        return value, {"twice": 2 * value}

    (grads, aux), retained = loss(model, x, y)
    want = eqx.filter_grad(lambda m: mse(m, x, y))(model)
    np.testing.assert_allclose(grads.layers[0].weight, want.layers[0].weight, rtol=1e-5)
    np.testing.assert_allclose(aux["twice"], 2 * mse(model, x, y), rtol=1e-6)
    assert retained == {}
    # The activation function comes back as None, a static field as it is, as in Equinox.
    assert grads.activation is None and want.activation is None
    assert jax.tree.structure(grads) == jax.tree.structure(want)

    value_and_grad = jhooks.filter_value_and_grad(mse)
    value, _, _ = value_and_grad(model, x, y)
    np.testing.assert_allclose(value, mse(model, x, y), rtol=1e-6)


def test_grad_of_an_equinox_model_points_to_filter_grad():
    model, x, y = mlp_and_data()
    for transform, caller in [
        (jhooks.grad, "jhooks.grad"),
        (jhooks.value_and_grad, "jhooks.value_and_grad"),
    ]:
        with pytest.raises(TypeError, match=caller + r" of 'mse'") as info:
            transform(mse)(model, x, y)
        message = str(info.value)
        assert "at .activation" in message and "jhooks.filter_grad" in message


def test_clamp_every_linear_output_grad_and_log_norms_like_torch(maybe_jit):
    """Task (a): clamp the gradient of every Linear's output, log each layer's norm."""
    model, x, y = mlp_and_data()
    model = jhooks.hookable(model)

    def clamp(module, grad_output):
        jhooks.emit(jhooks.module_path(module), jnp.linalg.norm(grad_output[0]))
        return (jnp.clip(grad_output[0], -0.02, 0.02),)

    handle = jhooks.register_module_hooks(model, eqx.nn.Linear, full_backward_pre=clamp)
    jit = filter_jit_or_not(maybe_jit)
    loss, grads, norms = jit(jhooks.filter_value_and_grad(mse))(model, x, y)
    handle.remove()

    net = torch.nn.Sequential(
        torch.nn.Linear(3, 5),
        torch.nn.ReLU(),
        torch.nn.Linear(5, 5),
        torch.nn.ReLU(),
        torch.nn.Linear(5, 2),
    )
    torch_norms = {}
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            net[2 * i].weight.copy_(torch.tensor(np.asarray(layer.weight)))
            net[2 * i].bias.copy_(torch.tensor(np.asarray(layer.bias)))

    def torch_clamp(name):
        def hook(module, grad_output):
            torch_norms[name] = grad_output[0].norm(dim=-1)  # one per example (vmap)
            return (grad_output[0].clamp(-0.02, 0.02),)

        return hook

    for i in range(3):
        net[2 * i].register_full_backward_pre_hook(torch_clamp(f"layers.{i}"))
    x_torch = torch.tensor(np.asarray(x), requires_grad=True)
    torch_loss = ((net(x_torch) - torch.tensor(np.asarray(y))) ** 2).mean()
    torch_loss.backward()
    np.testing.assert_allclose(loss, torch_loss.item(), rtol=1e-5)
    for i, layer in enumerate(grads.layers):
        np.testing.assert_allclose(
            layer.weight, net[2 * i].weight.grad.numpy(), rtol=1e-4, atol=1e-7
        )
        # Under vmap a backward hook sees one example: the norms come back per example.
        np.testing.assert_allclose(
            norms[f"layers.{i}"], torch_norms[f"layers.{i}"].numpy(), rtol=1e-5
        )


# 2. Hook point names: one value per name, errors that list the names reached


def two_points(x):
    a = jhooks.hook_point(jnp.sin(x), "hook_z")
    return jhooks.hook_point(a * 2.0, "hook_z")  # the same name, reached twice


def test_a_name_reached_twice_is_never_dropped_silently(maybe_jit):
    # The second reach of `hook_z` is the point `hook_z:1`: both values are kept.
    x = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    for names_filter in (None, "hook_z", lambda n: "hook_z" in n, ["hook_*"]):
        _, cache = maybe_jit(
            lambda x, f=names_filter: jhooks.run_with_cache(two_points, x, names_filter=f)
        )(x)
        assert sorted(cache) == ["hook_z", "hook_z:1"]
        np.testing.assert_allclose(cache["hook_z"], np.sin(np.asarray(x)), rtol=1e-6)
        np.testing.assert_allclose(cache["hook_z:1"], 2 * np.sin(np.asarray(x)), rtol=1e-6)


def test_unknown_name_lists_the_names_reached(maybe_jit):
    def hook(value, name):
        return value

    with pytest.raises(ValueError) as info:
        maybe_jit(
            lambda x: jhooks.run_with_hooks(
                lambda x: jhooks.hook_point(jnp.sin(x), "hook_z") + jhooks.hook_point(x, "resid"),
                x,
                fwd_hooks=[("blocks.0.attn.hook_z", hook)],
            )
        )(jnp.ones(3))
    message = str(info.value)
    assert "no hook point named 'blocks.0.attn.hook_z'" in message
    assert "Did you mean 'hook_z'?" in message  # the same last part
    assert "The points reached: 'hook_z', 'resid'." in message


def test_glob_patterns_select_points(maybe_jit):
    def f(x):
        for i in range(3):
            x = jhooks.hook_point(jnp.sin(x), f"blocks.{i}.hook_z")
        return jhooks.hook_point(x, "out")

    x = jnp.arange(3.0)
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(f, x, names_filter="blocks.*.hook_z"))(x)
    assert list(cache) == ["blocks.0.hook_z", "blocks.1.hook_z", "blocks.2.hook_z"]
    np.testing.assert_allclose(
        cache["blocks.2.hook_z"], np.sin(np.sin(np.sin(np.arange(3.0)))), rtol=1e-6
    )
    out = maybe_jit(
        lambda x: jhooks.run_with_hooks(
            f, x, fwd_hooks=[("blocks.[02].hook_z", lambda v, n: v * 0.0)]
        )
    )(x)
    np.testing.assert_allclose(out, np.zeros(3))
    with pytest.raises(ValueError, match=r"no hook point named 'layers.\*'"):
        jhooks.run_with_cache(f, x, names_filter=["out", "layers.*"])


# 4. loop_index


WS = jnp.stack([jnp.eye(3) * (i + 1.0) for i in range(3)])
X3 = jnp.array([0.1, 0.2, 0.3])


def shift_layer_1(value, name):
    index = jhooks.loop_index()
    if not index:  # the block applied outside the scan
        return None
    return jnp.where(index[0] == 1, value + 1.0, value)


def unrolled_shifted(first, shifts):
    ws, x = np.asarray(WS), np.asarray(X3)
    if first:
        x = np.tanh(ws[0] @ x)
    for i in range(3):
        x = np.tanh(ws[i] @ x) + shifts[i]
    return x if first else np.tanh(ws[0] @ x)


@pytest.mark.parametrize("first", [True, False], ids=["block-then-scan", "scan-then-block"])
def test_loop_index_in_a_jitted_block_called_outside_and_inside_a_scan(maybe_jit, first):
    block = jax.jit(lambda x, w: jhooks.hook_point(jnp.tanh(w @ x), "layer"))

    def model(x):
        if first:
            x = block(x, WS[0])
        x = jax.lax.scan(lambda x, w: (block(x, w), None), x, WS)[0]
        return x if first else block(x, WS[0])

    def run(x):
        return jhooks.run_with_hooks(model, x, fwd_hooks=[("layer", shift_layer_1)])

    want = unrolled_shifted(first, (0.0, 1.0, 0.0))
    np.testing.assert_allclose(maybe_jit(run)(X3), want, rtol=1e-6)
    # What a stale trace gives: every layer shifted, or none.
    for shift in ((1.0, 1.0, 1.0), (0.0, 0.0, 0.0)):
        assert not np.allclose(want, unrolled_shifted(first, shift), rtol=1e-3)


def test_loop_index_in_a_backward_hook_raises_the_promised_error(maybe_jit):
    def bwd(grad, name):
        jhooks.loop_index()
        return grad

    def outside_loops(x):
        return jnp.sum(jhooks.hook_point(jnp.sin(x), "h"))

    def in_a_scan(x):
        return jnp.sum(
            jax.lax.scan(
                lambda c, w: (jhooks.hook_point(jnp.sin(w * c), "h"), None), x, jnp.arange(3.0)
            )[0]
        )

    for f in (outside_loops, in_a_scan):
        with pytest.raises(
            ValueError,
            match=r"jhooks.loop_index\(\) was called in backward hook "
            r".*bwd: it is available only in the forward pass",
        ):
            maybe_jit(jax.grad(lambda x, f=f: jhooks.run_with_hooks(f, x, bwd_hooks=[("h", bwd)])))(
                X3
            )


@pytest.mark.filterwarnings("ignore:.*runs once per compilation:UserWarning")
def test_loop_index_in_a_backward_hook_on_values_raises_the_promised_error(maybe_jit):
    """A backward hook with a side effect runs on values in an eager run (a host call in
    the backward pass, whose error reaches the caller inside JAX's runtime error): it
    gave `()` there, in a scan too, where its pure twin raised."""
    seen = []

    def bwd(grad, name):
        seen.append(jhooks.loop_index())

    def in_a_scan(x):
        return jnp.sum(
            jax.lax.scan(
                lambda c, w: (jhooks.hook_point(jnp.sin(w * c), "h"), None), x, jnp.arange(3.0)
            )[0]
        )

    grad = maybe_jit(
        jax.grad(lambda x: jhooks.run_with_hooks(in_a_scan, x, bwd_hooks=[("h", bwd)]))
    )
    with pytest.raises(
        Exception,
        match=r"jhooks.loop_index\(\) was called in backward hook "
        r".*bwd: it is available only in the forward pass",
    ) as excinfo:
        grad(X3)
    assert isinstance(excinfo.value, (ValueError, jax.errors.JaxRuntimeError))
    assert seen == []


def test_loop_index_in_fori_loop_counts_iterations_from_zero(maybe_jit):
    def record(value, name):
        (i,) = jhooks.loop_index()
        return value + i.astype(value.dtype)

    def f(x):
        def body(i, x):
            return jhooks.hook_point(x * 2.0, "x")

        return jax.lax.fori_loop(2, 5, body, x)

    out = maybe_jit(lambda x: jhooks.run_with_hooks(f, x, fwd_hooks=[("x", record)]))(jnp.zeros(2))
    # loop_index gives 0, 1, 2 (the iteration count, i - 2), not fori's i = 2, 3, 4:
    # ((0 * 2 + 0) * 2 + 1) * 2 + 2 = 4.
    np.testing.assert_allclose(out, [4.0, 4.0])


# 6. The demo: one gradient norm per step, as PyTorch's, and a loss that falls


def test_demo_prints_one_grad_norm_per_step_as_torch(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    demo = importlib.import_module("demo")
    from small_cnn import SmallCNN
    from small_cnn_torch import TorchSmallCNN

    steps = 4
    history = demo.main(steps=steps)
    lines = [line for line in capsys.readouterr().out.splitlines() if "grad norm" in line]
    assert len(lines) == steps == len(history)  # one norm per step, not per example
    # Each figure is printed beside what the hooks changed.
    assert all("(no hooks: " in line and "clamp changed " in line for line in lines)
    losses = [s.loss for s in history]
    assert all(b < a for a, b in zip(losses, losses[1:]))

    def twin():
        return TorchSmallCNN(SmallCNN(jax.random.PRNGKey(0), classes=10))

    net, plain = twin(), twin()
    clamped = []
    net.act.register_full_backward_hook(
        lambda m, gi, go: clamped.append(int((gi[0] < 0).sum())) or (gi[0].clamp(min=0.0),)
    )
    net.fc.bias.register_hook(torch.zeros_like)
    norms, plain_norms = [], []
    net.conv.register_full_backward_pre_hook(lambda m, go: norms.append(go[0].norm().item()))
    plain.conv.register_full_backward_pre_hook(
        lambda m, go: plain_norms.append(go[0].norm().item())
    )
    optim = torch.optim.SGD(net.parameters(), lr=0.05)
    x = torch.tensor(np.asarray(jax.random.normal(jax.random.PRNGKey(1), (32, 1, 8, 8))))
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    x.requires_grad_(True)  # so that the first layer's full backward hook fires
    torch_losses, plain_bias_norms = [], []
    for _ in range(steps):
        # The same step without hooks: a model with no hooks and the same weights.
        plain.load_state_dict(net.state_dict())
        plain.zero_grad()
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        plain_bias_norms.append(plain.fc.bias.grad.norm().item())
        optim.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optim.step()
        torch_losses.append(loss.item())
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    np.testing.assert_allclose([s.grad_norm for s in history], norms, rtol=1e-4)
    np.testing.assert_allclose([s.plain_grad_norm for s in history], plain_norms, rtol=1e-4)
    np.testing.assert_allclose(
        [s.plain_bias_grad_norm for s in history], plain_bias_norms, rtol=1e-4
    )
    assert [s.clamped for s in history] == clamped
    assert all(s.entries == net.conv(x).numel() for s in history)  # 32 examples x 4x6x6


# 2. Points inside a hookable module's call are named under its path


class Attn(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return x + jhooks.hook_point(jnp.tanh(self.lin(x)), "hook_z")


class Block(eqx.Module):
    attn: Attn


class Blocks(eqx.Module):
    blocks: list

    def __call__(self, x):
        for block in self.blocks:
            x = block.attn(x)
        return x


def blocks_and_torch_twin():
    keys = jax.random.split(jax.random.key(0), 2)
    model = jhooks.hookable(Blocks([Block(Attn(eqx.nn.Linear(3, 3, key=k))) for k in keys]))

    class TorchAttn(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin, self.hook_z = torch.nn.Linear(3, 3), torch.nn.Identity()
            with torch.no_grad():
                self.lin.weight.copy_(torch.tensor(np.asarray(lin.weight)))
                self.lin.bias.copy_(torch.tensor(np.asarray(lin.bias)))

        def forward(self, x):
            return x + self.hook_z(torch.tanh(self.lin(x)))

    net = torch.nn.Module()
    net.blocks = torch.nn.ModuleList()
    for block in model.blocks:
        torch_block = torch.nn.Module()
        torch_block.attn = TorchAttn(block.attn.lin)
        net.blocks.append(torch_block)
    return model, net


def test_points_in_a_module_call_are_named_by_its_path_like_torch(maybe_jit):
    model, net = blocks_and_torch_twin()
    x = jnp.array([0.5, -1.0, 2.0])
    _, cache = maybe_jit(lambda x: jhooks.run_with_cache(model, x, names_filter="*hook_z"))(x)
    assert list(cache) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    torch_cache = {}
    for name, module in net.named_modules():
        if name.endswith("hook_z"):
            module.register_forward_hook(lambda m, a, out, n=name: torch_cache.update({n: out}))
    h = torch.tensor(np.asarray(x))
    for block in net.blocks:
        h = block.attn(h)
    assert list(torch_cache) == list(cache)  # the same names as PyTorch's named_modules
    for name in cache:
        np.testing.assert_allclose(cache[name], torch_cache[name].detach().numpy(), rtol=1e-6)
    # A hook on one layer's point changes that layer only: with layer 1's z zeroed,
    # the output is layer 0's.
    out = maybe_jit(
        lambda x: jhooks.run_with_hooks(
            model, x, fwd_hooks=[("blocks.1.attn.hook_z", lambda z, n: z * 0.0)]
        )
    )(x)
    layer_0 = net.blocks[0].attn(torch.tensor(np.asarray(x))).detach().numpy()
    np.testing.assert_allclose(out, layer_0, rtol=1e-6)


# 3. Stateful layers: BatchNorm and eqx.nn.State in runs and forward hooks


class BNNet(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __call__(self, x, state):
        y, state = self.bn(self.lin(x), state)
        return jnp.tanh(y), state


def bn_model():
    model, state = eqx.nn.make_with_state(BNNet)(
        eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.BatchNorm(4, "batch", mode="batch")
    )
    model = jhooks.hookable(model)
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    return model, state, batched, jax.random.normal(jax.random.key(1), (5, 3))


def test_run_with_cache_over_a_vmapped_batchnorm_keeps_the_state_once(maybe_jit):
    model, state, batched, x = bn_model()
    want_out, want_state = batched(x, state)
    for names_filter in (None, "bn"):
        (out, new_state), cache = maybe_jit(
            lambda x, s, f=names_filter: jhooks.run_with_cache(batched, x, s, names_filter=f)
        )(x, state)
        np.testing.assert_allclose(out, want_out, rtol=1e-6)
        y, bn_state = cache["bn"]
        # y per example, the state once (not stacked per example), as vmap returns it.
        assert y.shape == (5, 4)
        for got, want in zip(jax.tree.leaves(bn_state), jax.tree.leaves(want_state)):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-6)
    # The BatchNorm normalises over the batch, as PyTorch's in training mode.
    bn = torch.nn.BatchNorm1d(4, eps=1e-5)
    lin = torch.tensor(np.asarray(jax.vmap(model.lin)(x)))
    np.testing.assert_allclose(y, bn(lin).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_a_forward_hook_on_a_stateful_layer_gets_y_and_state(maybe_jit):
    model, state, batched, x = bn_model()
    handle = jhooks.register_forward_hook(model.bn, lambda m, args, out: (out[0] * 0.5, out[1]))
    out, _ = maybe_jit(batched)(x, state)
    handle.remove()
    lin = torch.tensor(np.asarray(jax.vmap(model.lin)(x)))
    bn = torch.nn.BatchNorm1d(4, eps=1e-5)
    bn.register_forward_hook(lambda m, args, out: out * 0.5)
    np.testing.assert_allclose(out, torch.tanh(bn(lin)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_a_wrong_forward_hook_on_a_stateful_layer_is_named():
    model, state, batched, x = bn_model()

    def halve(module, args, out):
        return out * 0.5

    def only_y(module, args, out):
        return out[0]

    handle = jhooks.register_forward_hook(model.bn, halve)
    with pytest.raises(
        TypeError,
        match=r"forward hook .*halve of module 'bn' \(BatchNorm\) raised TypeError: can't "
        r"multiply sequence .* It was given the module's output \(float32\[4\], State\), a "
        r"tuple .*return None or an output of that structure, e.g. `\(y \* 0.5, state\)`",
    ):
        batched(x, state)
    handle.remove()
    handle = jhooks.register_forward_hook(model.bn, only_y)
    with pytest.raises(
        ValueError,
        match=r"hook .*only_y of module 'bn' \(BatchNorm\) returned output float32\[4\], "
        r"expected \(float32\[4\], State\)",
    ):
        batched(x, state)
    handle.remove()


# 5. Module outputs with leaves that are not floating-point arrays


class Labelled(eqx.Module):
    def __call__(self, x):
        return jnp.sin(x), 3, "label"


class UsesLabel(eqx.Module):
    inner: Labelled

    def __call__(self, x):
        y, n, label = self.inner(x)
        assert isinstance(n, int) and label == "label"  # still Python values
        return y * n


def test_identity_forward_hook_on_int_and_str_outputs(maybe_jit):
    net = jhooks.hookable(UsesLabel(Labelled()))
    x = jnp.array([0.5, 1.0])
    handle = jhooks.register_forward_hook(net.inner, lambda m, args, out: out)
    np.testing.assert_allclose(maybe_jit(net)(x), 3 * np.sin([0.5, 1.0]), rtol=1e-6)
    handle.remove()
    # The cache keeps the int and the str as they are; their gradient entries are None.
    (_, cache) = jhooks.run_with_cache(lambda x: jnp.sum(net(x)), x, incl_bwd=True)
    y, n, label = cache["inner"]
    np.testing.assert_allclose(y, np.sin([0.5, 1.0]), rtol=1e-6)
    assert (n, label) == (3, "label")
    grad_y, grad_n, grad_label = cache["inner_grad"]
    np.testing.assert_allclose(grad_y, [3.0, 3.0])
    assert grad_n is None and grad_label is None
    out = jhooks.run_with_hooks(
        net, x, fwd_hooks=[("inner", lambda v, name: (v[0] * 2.0, v[1], v[2]))]
    )
    np.testing.assert_allclose(out, 6 * np.sin([0.5, 1.0]), rtol=1e-6)

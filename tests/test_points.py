"""Named hook points, run_with_hooks and run_with_cache, checked against PyTorch hooks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

# float32 against PyTorch: values of order 1 round apart by a few 1e-6 (2.4e-6 seen).
RTOL = 1e-5
ATOL = 1e-5


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(size=(5, 4)).astype(np.float32),
        "b1": rng.normal(size=(5,)).astype(np.float32),
        "w2": rng.normal(size=(3, 5)).astype(np.float32),
        "b2": rng.normal(size=(3,)).astype(np.float32),
    }


def _x(seed=1, batch=6):
    return np.random.default_rng(seed).normal(size=(batch, 4)).astype(np.float32)


def mlp(params, x):
    h = jhooks.hook_point(x @ params["w1"].T + params["b1"], "fc1")
    a = jhooks.hook_point(jax.nn.relu(h), "act")
    return jhooks.hook_point(a @ params["w2"].T + params["b2"], "fc2")


def loss(params, x):
    return jnp.sum(jnp.tanh(mlp(params, x)) ** 2)


def torch_mlp(params):
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with torch.no_grad():
        net[0].weight.copy_(torch.from_numpy(params["w1"]))
        net[0].bias.copy_(torch.from_numpy(params["b1"]))
        net[2].weight.copy_(torch.from_numpy(params["w2"]))
        net[2].bias.copy_(torch.from_numpy(params["b2"]))
    names = {"fc1": net[0], "act": net[1], "fc2": net[2]}
    return net, names


def torch_loss(out):
    return torch.sum(torch.tanh(out) ** 2)


def on_output_grad(fn):
    """A PyTorch forward hook that puts the tensor hook `fn` on the module's output."""

    def forward_hook(module, args, output):
        output.register_hook(fn)

    return forward_hook


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_point_is_identity_outside_a_run():
    x = jnp.ones(3)
    assert jhooks.hook_point(x, "a") is x
    plain = jax.make_jaxpr(lambda p, x: loss(p, x))(_params(), _x())
    bare = jax.make_jaxpr(
        lambda p, x: jnp.sum(
            jnp.tanh(jax.nn.relu(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]) ** 2
        )
    )(_params(), _x())
    assert str(plain) == str(bare)


def test_cache_matches_torch_forward_hooks(maybe_jit):
    params, x = _params(), _x()
    net, names = torch_mlp(params)
    cache_t = {}
    for name, module in names.items():
        module.register_forward_hook(lambda m, a, o, name=name: cache_t.__setitem__(name, o))
    out_t = net(torch.from_numpy(x))

    out, cache = maybe_jit(lambda p, x: jhooks.run_with_cache(mlp, p, x))(params, x)
    close(out, out_t.detach())
    assert set(cache) == {"fc1", "act", "fc2"}
    for name in names:
        close(cache[name], cache_t[name].detach())


@pytest.mark.parametrize(
    "names_filter, kept",
    [
        ("act", {"act"}),
        (["fc1", "fc2"], {"fc1", "fc2"}),
        (lambda name: name.startswith("fc"), {"fc1", "fc2"}),
        (None, {"fc1", "act", "fc2"}),
    ],
)
def test_names_filter(maybe_jit, names_filter, kept):
    params, x = _params(), _x()
    _, full = jhooks.run_with_cache(mlp, params, x)
    _, cache = maybe_jit(lambda p, x: jhooks.run_with_cache(mlp, p, x, names_filter=names_filter))(
        params, x
    )
    assert set(cache) == kept
    for name in kept:
        close(cache[name], full[name])


def test_cache_with_gradients_matches_torch_retain_grad(maybe_jit):
    params, x = _params(), _x()
    net, names = torch_mlp(params)
    outs = {}

    def keep(m, a, o, name):
        o.retain_grad()
        outs[name] = o

    for name, module in names.items():
        module.register_forward_hook(lambda m, a, o, name=name: keep(m, a, o, name))
    value_t = torch_loss(net(torch.from_numpy(x)))
    value_t.backward()

    value, cache = maybe_jit(
        lambda p, x: jhooks.run_with_cache(loss, p, x, names_filter=["act", "fc2"], incl_bwd=True)
    )(params, x)
    close(value, value_t.detach())
    assert set(cache) == {"act", "fc2", "act_grad", "fc2_grad"}
    for name in ("act", "fc2"):
        close(cache[name], outs[name].detach())
        close(cache[name + "_grad"], outs[name].grad)


def test_patching_matches_torch_forward_hook(maybe_jit):
    params, x = _params(), _x()
    net, names = torch_mlp(params)

    def ablate_t(module, args, output):
        output = output.clone()
        output[:, 1] = 0.0
        return output

    names["act"].register_forward_hook(ablate_t)
    xt = torch.from_numpy(x).requires_grad_(True)
    value_t = torch_loss(net(xt))
    value_t.backward()

    seen = []

    def ablate(value, name):
        seen.append(name)
        return value.at[:, 1].set(0.0)

    def run(p, x):
        return jhooks.run_with_hooks(loss, p, x, fwd_hooks=[("act", ablate)])

    value, grad = maybe_jit(jax.value_and_grad(run, argnums=1))(params, x)
    close(value, value_t.detach())
    close(grad, xt.grad)
    assert seen == ["act"]
    # The hook was for that call only.
    close(loss(params, x), torch_loss(torch_mlp(params)[0](torch.from_numpy(x))).detach())


def test_backward_hook_matches_torch_tensor_hook(maybe_jit):
    params, x = _params(), _x()
    net, names = torch_mlp(params)
    names["act"].register_forward_hook(on_output_grad(lambda g: g * 3.0))
    names["fc2"].register_forward_hook(on_output_grad(torch.relu))
    xt = torch.from_numpy(x).requires_grad_(True)
    torch_loss(net(xt)).backward()

    seen = []

    def scale(grad, name):
        seen.append(name)
        return grad * 3.0

    def run(p, x):
        return jhooks.run_with_hooks(
            loss,
            p,
            x,
            bwd_hooks=[("act", scale), (lambda n: n == "fc2", lambda g, n: jax.nn.relu(g))],
        )

    grad = maybe_jit(jax.grad(run, argnums=1))(params, x)
    close(grad, xt.grad)
    assert seen == ["act"]


def test_predicate_hooks_see_every_matching_name(maybe_jit):
    params, x = _params(), _x()
    seen = []

    def record(value, name):
        seen.append((name, value.shape))

    maybe_jit(lambda p, x: jhooks.run_with_hooks(mlp, p, x, fwd_hooks=[(lambda n: True, record)]))(
        params, x
    )
    assert seen == [("fc1", (6, 5)), ("act", (6, 5)), ("fc2", (6, 3))]


def test_cache_inside_a_run_sees_patched_values(maybe_jit):
    params, x = _params(), _x()

    def patched(p, x):
        return jhooks.run_with_hooks(mlp, p, x, fwd_hooks=[("act", lambda v, n: v * 2.0)])

    out, cache = maybe_jit(lambda p, x: jhooks.run_with_cache(patched, p, x))(params, x)
    h = x @ params["w1"].T + params["b1"]
    close(cache["fc1"], h)
    close(cache["act"], 2.0 * np.maximum(h, 0.0))
    close(out, cache["fc2"])


def test_per_example_hooks_under_vmap(maybe_jit):
    params, x = _params(), _x()
    shapes = []

    def one(p, xi):
        def fwd(value, name):
            shapes.append(value.shape)
            return value * jax.lax.stop_gradient(jnp.sum(xi))

        def bwd(grad, name):
            shapes.append(grad.shape)
            return grad * jnp.sum(grad)

        return jhooks.run_with_hooks(
            loss, p, xi, fwd_hooks=[("act", fwd)], bwd_hooks=[("act", bwd)]
        )

    grads = maybe_jit(jax.vmap(jax.grad(one, argnums=1), in_axes=(None, 0)))(params, x)
    assert shapes == [(5,), (5,)]

    net, names = torch_mlp(params)
    for i in range(x.shape[0]):
        s = float(x[i].sum())
        handles = [
            names["act"].register_forward_hook(lambda m, a, o, s=s: o * s),
            names["act"].register_forward_hook(on_output_grad(lambda g: g * g.sum())),
        ]
        xt = torch.from_numpy(x[i]).requires_grad_(True)
        torch_loss(net(xt)).backward()
        close(grads[i], xt.grad)
        for h in handles:
            h.remove()


def test_cache_under_vmap(maybe_jit):
    params, x = _params(), _x()
    out, cache = maybe_jit(
        jax.vmap(lambda xi: jhooks.run_with_cache(loss, params, xi, incl_bwd=True))
    )(x)
    _, full = jhooks.run_with_cache(mlp, params, x)
    close(cache["act"], full["act"])
    expected = jax.vmap(
        jax.grad(lambda a: jnp.sum(jnp.tanh(a @ params["w2"].T + params["b2"]) ** 2))
    )(full["act"])
    close(cache["act_grad"], expected)


def test_unknown_names_list_close_matches(maybe_jit):
    params, x = _params(), _x()

    def hook(value, name):
        return None

    with pytest.raises(
        ValueError,
        match=r"run_with_hooks \(hook test_unknown_names_list_close_matches.<locals>.hook\): "
        r"no hook point named 'actt'. Did you mean 'act'\?",
    ):
        maybe_jit(lambda p, x: jhooks.run_with_hooks(mlp, p, x, fwd_hooks=[("actt", hook)]))(
            params, x
        )
    with pytest.raises(ValueError, match=r"no hook point named 'fc3'. Did you mean 'fc2', 'fc1'\?"):
        maybe_jit(lambda p, x: jhooks.run_with_hooks(mlp, p, x, bwd_hooks=[("fc3", hook)]))(
            params, x
        )
    with pytest.raises(
        ValueError, match=r"run_with_cache \(names_filter\): no hook point named 'ac'"
    ):
        maybe_jit(lambda p, x: jhooks.run_with_cache(mlp, p, x, names_filter=["fc1", "ac"]))(
            params, x
        )
    with pytest.raises(
        ValueError, match=r"no hook point named 'zzz'. The points reached: 'act', 'fc1', 'fc2'."
    ):
        maybe_jit(lambda p, x: jhooks.run_with_cache(mlp, p, x, names_filter="zzz"))(params, x)
    with pytest.raises(ValueError, match="The points reached: none."):
        jhooks.run_with_cache(jnp.sin, x, names_filter="act")


def test_bad_hooks_are_named():
    params, x = _params(), _x()

    def wrong_shape(value, name):
        return value[:, :2]

    with pytest.raises(
        ValueError,
        match=r"hook test_bad_hooks_are_named.<locals>.wrong_shape at hook point 'act' returned "
        r"activation float32\[6,2\], expected float32\[6,5\]",
    ):
        jhooks.run_with_hooks(mlp, params, x, fwd_hooks=[("act", wrong_shape)])

    def wrong_grad(grad, name):
        return grad.astype(jnp.float16)

    with pytest.raises(
        ValueError,
        match=r"hook test_bad_hooks_are_named.<locals>.wrong_grad at hook point 'act' returned "
        r"gradient float16\[6,5\]",
    ):
        jax.grad(lambda x: jhooks.run_with_hooks(loss, params, x, bwd_hooks=[("act", wrong_grad)]))(
            x
        )
    with pytest.raises(TypeError, match=r"the hook for 'act' in fwd_hooks must be callable, got 3"):
        jhooks.run_with_hooks(mlp, params, x, fwd_hooks=[("act", 3)])
    with pytest.raises(TypeError, match=r"fwd_hooks takes a list of \(name, hook\) pairs"):
        jhooks.run_with_hooks(mlp, params, x, fwd_hooks=[wrong_shape])
    with pytest.raises(TypeError, match=r"names_filter must be a point name, a glob pattern"):
        jhooks.run_with_cache(mlp, params, x, names_filter=3)
    with pytest.raises(TypeError, match="hook_point takes a string name, got 1"):
        jhooks.hook_point(x, 1)


def test_cache_errors():
    params, x = _params(), _x()

    def twice(p, x):
        return mlp(p, x) + mlp(p, x)

    # A point reached again in one run is another point: `act`, then `act:1`. Its own
    # name selects every reach (as a PyTorch hook runs at every call), `act:1` one.
    act = jax.nn.relu(x @ params["w1"].T + params["b1"])
    for names_filter in (None, ["fc1", "act", "fc2"]):
        out, cache = jhooks.run_with_cache(twice, params, x, names_filter=names_filter)
        assert list(cache) == ["fc1", "act", "fc2", "fc1:1", "act:1", "fc2:1"]
        close(cache["act"], act)
        close(cache["act:1"], act)
        close(cache["fc2:1"], act @ params["w2"].T + params["b2"])
    _, cache = jhooks.run_with_cache(twice, params, x, names_filter="act:1")
    assert list(cache) == ["act:1"]
    out = jhooks.run_with_hooks(twice, params, x, fwd_hooks=[("act", lambda v, n: v * 0)])
    close(out, 2 * jnp.broadcast_to(params["b2"], out.shape))
    for name in ("act:1", lambda n: n == "act:1"):
        out = jhooks.run_with_hooks(twice, params, x, fwd_hooks=[(name, lambda v, n: v * 0)])
        close(out, mlp(params, x) + jnp.broadcast_to(params["b2"], out.shape))

    def nested(p, x):
        h = jhooks.hook_point(x * 2.0, "outside")
        return jax.vmap(lambda hi: mlp(p, hi))(h)

    # A point under a vmap inside fn comes back stacked along the batch axis.
    out, cache = jhooks.run_with_cache(nested, params, x, names_filter=["outside", "fc1"])
    assert list(cache) == ["outside", "fc1"]
    close(cache["outside"], 2.0 * x)
    close(cache["fc1"], 2.0 * x @ params["w1"].T + params["b1"])
    # Hooks see it as the cache shows it, with the batch axis first.
    shapes = []
    jhooks.run_with_hooks(
        nested, params, x, fwd_hooks=[("fc1", lambda v, n: shapes.append(v.shape))]
    )
    assert shapes == [(6, 5)]
    with pytest.raises(
        ValueError,
        match=r"incl_bwd=True\) differentiates fn's output, which must be a scalar, a tuple "
        r"or list whose first element is one .*; fn returned float32\[6,3\]",
    ):
        jhooks.run_with_cache(mlp, params, x, incl_bwd=True)


def test_jitted_fn_retraces_for_new_hooks_only():
    params, x = _params(), _x()
    traces = []

    @jax.jit
    def f(p, x):
        traces.append(1)
        return mlp(p, x)

    plain = f(params, x)
    assert len(traces) == 1
    hooks = [("act", lambda v, n: v * 0.0)]
    patched = jhooks.run_with_hooks(f, params, x, fwd_hooks=hooks)
    assert len(traces) == 2
    close(patched, jnp.broadcast_to(params["b2"], plain.shape))
    again = jhooks.run_with_hooks(f, params, x, fwd_hooks=hooks)
    assert len(traces) == 2
    close(again, patched)
    # Back to no hooks: the first program, never the hooked one.
    close(f(params, x), plain)
    assert len(traces) == 2
    # A hook computing the same structure is the same program, whatever Python made
    # it: a lambda made again (in a loop, a rerun notebook cell), another code, other
    # numbers (the hooks' constants are the program's arguments).
    for _ in range(3):
        jhooks.run_with_hooks(f, params, x, fwd_hooks=[("act", lambda v, n: v * 0.0)])
    other = jhooks.run_with_hooks(f, params, x, fwd_hooks=[("act", lambda v, n: v * 2.0)])
    for scale in (2.0, 3.0):
        hook = [("act", lambda v, n: v * scale)]  # noqa: B023
        scaled = jhooks.run_with_hooks(f, params, x, fwd_hooks=hook)
    assert len(traces) == 2
    # Another structure is another program.
    jhooks.run_with_hooks(f, params, x, fwd_hooks=[("act", lambda v, n: v * 2.0 + 1.0)])
    assert len(traces) == 3
    h = np.maximum(x @ params["w1"].T + params["b1"], 0.0)
    close(scaled, 3.0 * h @ params["w2"].T + params["b2"])
    close(other, 2.0 * h @ params["w2"].T + params["b2"])
    # An unknown name is caught on a cache hit too.
    bad = [("actt", lambda v, n: None)]
    for _ in range(2):
        with pytest.raises(ValueError, match="no hook point named 'actt'"):
            jhooks.run_with_hooks(f, params, x, fwd_hooks=bad)
    assert len(traces) == 5


def test_jitted_fn_with_backward_hooks_and_gradients():
    params, x = _params(), _x()
    traces = []

    @jax.jit
    def f(p, x):
        traces.append(1)
        return loss(p, x)

    hooks = [("act", lambda g, n: g * 3.0)]
    g1 = jax.grad(lambda x: jhooks.run_with_hooks(f, params, x, bwd_hooks=hooks))(x)
    g2 = jax.grad(lambda x: jhooks.run_with_hooks(f, params, x, bwd_hooks=hooks))(x)
    n = len(traces)
    g3 = jax.grad(lambda x: jhooks.run_with_hooks(f, params, x, bwd_hooks=hooks))(x)
    assert len(traces) == n
    close(g1, g2)
    close(g1, g3)
    close(g1, 3.0 * jax.grad(loss, argnums=1)(params, x))
    value, cache = jhooks.run_with_cache(f, params, x, names_filter=[], incl_bwd=True)
    close(value, loss(params, x))
    assert cache == {}


def _memory(fn, *args):
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def test_cache_of_one_point_costs_no_more_memory_than_returning_it():
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(256, 256)).astype(np.float32)) for _ in range(6)]
    x = jnp.asarray(rng.normal(size=(128, 256)).astype(np.float32))

    def deep(ws, x, keep=None, probe=None):
        kept = None
        for i, w in enumerate(ws):
            x = jnp.tanh(x @ w)
            if i == keep and probe is not None:
                x = x + probe
            x = jhooks.hook_point(x, f"layer{i}")
            if i == keep:
                kept = x
        return (jnp.sum(x**2), kept) if keep is not None else jnp.sum(x**2)

    by_hand = _memory(lambda ws, x: deep(ws, x, keep=2), ws, x)
    cached = _memory(lambda ws, x: jhooks.run_with_cache(deep, ws, x, names_filter="layer2"), ws, x)
    everything = _memory(lambda ws, x: jhooks.run_with_cache(deep, ws, x), ws, x)
    assert cached <= by_hand
    # And the filter matters: without it all six activations are returned.
    assert everything >= 6 * x.size * 4 > by_hand

    def grad_by_hand(ws, x, probe):
        return jax.value_and_grad(lambda p: deep(ws, x, 2, p), has_aux=True)(probe)

    probe = jnp.zeros_like(x)
    grad_by_hand_bytes = _memory(grad_by_hand, ws, x, probe)
    grad_cached = _memory(
        lambda ws, x: jhooks.run_with_cache(deep, ws, x, names_filter="layer2", incl_bwd=True),
        ws,
        x,
    )
    assert grad_cached <= grad_by_hand_bytes
    (_, kept), grad = jax.jit(grad_by_hand)(ws, x, probe)
    _, cache = jax.jit(
        lambda ws, x: jhooks.run_with_cache(deep, ws, x, names_filter="layer2", incl_bwd=True)
    )(ws, x)
    close(cache["layer2"], kept)
    np.testing.assert_allclose(cache["layer2_grad"], grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("wrap", ["scan", "checkpoint"])
def test_hooks_inside_scan_and_checkpoint_are_never_stale(maybe_jit, wrap):
    ws = jnp.stack([jnp.asarray(_params(i)["w1"][:4]) for i in range(3)])
    x = jnp.asarray(_x()[0])

    def layer(x, w):
        return jhooks.hook_point(jnp.tanh(w @ x), "layer")

    def body(x, w):
        return layer(x, w), None

    if wrap == "scan":

        def f(x):
            return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)
    else:

        def f(x):
            for w in ws:
                x = jax.checkpoint(layer)(x, w)
            return jnp.sum(x**2)

    def unrolled(x, scale, grad_scale):
        for w in ws:
            x = jnp.tanh(w @ x) * scale
            x = jhooks.register_hook(x, lambda g: g * grad_scale)
        return jnp.sum(x**2)

    # The same traced body under different hooks, one after another.
    for scale, grad_scale in [(2.0, 1.0), (0.5, 3.0), (None, None)]:
        fwd = [] if scale is None else [("layer", lambda v, n, s=scale: v * s)]
        bwd = [] if grad_scale is None else [("layer", lambda g, n, s=grad_scale: g * s)]

        def run(x, fwd=fwd, bwd=bwd):
            return jhooks.run_with_hooks(f, x, fwd_hooks=fwd, bwd_hooks=bwd)

        value, grad = maybe_jit(jax.value_and_grad(run))(x)
        expected = jax.value_and_grad(unrolled)(x, scale or 1.0, grad_scale or 1.0)
        close(value, expected[0])
        close(grad, expected[1])

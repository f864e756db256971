"""PyTorch's `test/nn/test_module_hooks.py`, case by case, on jhooks.

Each test is named `test_module_hooks_<Class>_<case>` after the PyTorch test it
translates, runs the same model and hooks in PyTorch 2.13 to get the expected values,
and asserts jhooks gives them, eagerly and under `jax.jit`. The cases that cannot be
translated are listed with their reason in docs/pytorch.md ("PyTorch's own tests, case
by case").
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

D = 4  # PyTorch's tests use 10; the order of hooks does not depend on it


def _seq(key):
    k1, k2 = jax.random.split(key)
    return eqx.nn.Sequential([eqx.nn.Linear(D, D, key=k1), eqx.nn.Linear(D, D, key=k2)])


class Net(eqx.Module):
    seq1: eqx.nn.Sequential
    seq2: eqx.nn.Sequential

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.seq1, self.seq2 = _seq(k1), _seq(k2)

    def __call__(self, x):
        return self.seq2(self.seq1(x))


class ToyModel(eqx.Module):
    net1: Net
    net2: Net

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.net1, self.net2 = Net(k1), Net(k2)

    def __call__(self, x):
        return self.net2(self.net1(x))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seq1 = torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(2)])
        self.seq2 = torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(2)])

    def forward(self, x):
        return self.seq2(self.seq1(x))


class TorchToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net1, self.net2 = TorchNet(), TorchNet()

    def forward(self, x):
        return self.net2(self.net1(x))


def toy():
    return jhooks.hookable(ToyModel(jax.random.PRNGKey(0)))


x0 = jnp.linspace(-1.0, 1.0, D)


def torch_order(register, call_backward):
    """The order PyTorch fires hooks `0..4` registered by `register(module, hook, i)` on
    a TorchToyModel, after a forward (and a backward) pass."""
    fired = []
    model = TorchToyModel()
    register(model, lambda i: lambda *args: fired.append(i))
    out = model(torch.ones(1, D, requires_grad=True))
    if call_backward:
        out.sum().backward()
    return fired


def jhooks_order(register, maybe_jit, call_backward):
    fired = []
    model = toy()
    register(model, lambda i: lambda *args: fired.append(i))
    if call_backward:
        maybe_jit(jax.grad(lambda x: jnp.sum(model(x))))(x0)
    else:
        maybe_jit(lambda x: model(x))(x0)
    return fired


def _order(path, method, prepends, backward, maybe_jit):
    """The order hooks `0..4`, registered with `prepend` as given on the submodule at
    `path`, fire in PyTorch, after checking jhooks fires them in the same order."""

    def register(m, hook):
        target = functools.reduce(getattr, path.split("."), m)
        for i, prepend in enumerate(prepends):
            getattr(target, method)(hook(i), prepend=prepend)

    expected = torch_order(register, call_backward=backward)
    assert jhooks_order(register, maybe_jit, call_backward=backward) == expected
    return expected


def test_module_hooks_TestModuleHooks_test_forward_hooks(maybe_jit):
    prepends = [False, True, False, False, True]
    order = _order("net1.seq2", "register_forward_hook", prepends, False, maybe_jit)
    assert order == [4, 1, 0, 2, 3]


def test_module_hooks_TestModuleHooks_test_forward_pre_hooks(maybe_jit):
    prepends = [True, False, False, False, True]
    order = _order("net2.seq1", "register_forward_pre_hook", prepends, False, maybe_jit)
    assert order == [4, 0, 1, 2, 3]


def test_module_hooks_TestModuleHooks_test_full_backward_hooks(maybe_jit):
    prepends = [False, False, False, True, True]
    order = _order("net1", "register_full_backward_hook", prepends, True, maybe_jit)
    assert order == [4, 3, 0, 1, 2]


def test_module_hooks_TestModuleHooks_test_full_backward_pre_hooks(maybe_jit):
    prepends = [True, True, False, False, False]
    order = _order("net1", "register_full_backward_pre_hook", prepends, True, maybe_jit)
    assert order == [1, 0, 2, 3, 4]

    # A backward pre-hook that zeroes grad_output zeroes the input's gradient.
    a = torch.ones(2, requires_grad=True)
    lin = torch.nn.Linear(2, 2)
    lin.register_full_backward_pre_hook(lambda m, go: (go[0] * 0,))
    lin(a).sum().backward()
    jlin = jhooks.hookable(eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(1)))
    jlin.register_full_backward_pre_hook(lambda m, go: (go[0] * 0,))
    g = maybe_jit(jax.grad(lambda a: jnp.sum(jlin(a))))(jnp.ones(2))
    assert a.grad is not None
    np.testing.assert_array_equal(g, a.grad.numpy())


def test_module_hooks_TestModuleHooks_test_mixed_hooks(maybe_jit):
    def register(m, hook):
        m.register_forward_pre_hook(hook(0))
        m.register_forward_hook(hook(1))
        m.register_full_backward_pre_hook(hook(2))
        m.register_full_backward_hook(hook(3))

    expected = torch_order(register, call_backward=True)
    assert jhooks_order(register, maybe_jit, call_backward=True) == expected == [0, 1, 2, 3]


class KwargModel(eqx.Module):
    def __call__(self, x, bias=None):
        return x if bias is None else x + bias


class TorchKwargModel(torch.nn.Module):
    def forward(self, x, bias=None):
        return x if bias is None else x + bias


def _kwarg_pre_hook(fired, m, args, kwargs):
    fired.append(0)
    return args, {**kwargs, "bias": 2 * kwargs["bias"]}


def _kwarg_hook(fired, m, args, kwargs, out):
    fired.append(1)
    return out + kwargs["bias"]


def _torch_kwarg_pre_hook(fired, m, args, kwargs):
    fired.append(0)
    kwargs["bias"] = 2 * kwargs["bias"]
    return args, kwargs


def test_module_hooks_TestModuleHooks_test_kwarg_hooks(maybe_jit):
    x, bias = np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)
    for with_post in (False, True):
        t_fired, j_fired = [], []
        tm, jm = TorchKwargModel(), jhooks.hookable(KwargModel())
        if with_post:
            tm.register_forward_hook(functools.partial(_kwarg_hook, t_fired), with_kwargs=True)
            jm.register_forward_hook(functools.partial(_kwarg_hook, j_fired), with_kwargs=True)
        tm.register_forward_pre_hook(
            functools.partial(_torch_kwarg_pre_hook, t_fired), with_kwargs=True
        )
        jm.register_forward_pre_hook(functools.partial(_kwarg_pre_hook, j_fired), with_kwargs=True)
        t_out = tm(torch.tensor(x), bias=torch.tensor(bias))
        j_out = maybe_jit(lambda x, b, jm=jm: jm(x, bias=b))(x, bias)
        np.testing.assert_allclose(j_out, t_out.numpy())  # x + 2 bias, then x + 4 bias
        assert j_fired == t_fired

    # A module's own method as a forward hook with kwargs.
    tm, jm = TorchKwargModel(), jhooks.hookable(KwargModel())
    tm.register_forward_hook(lambda m, a, k, out: out + k["bias"], with_kwargs=True)
    jm.register_forward_hook(lambda m, a, k, out: out + k["bias"], with_kwargs=True)
    t_out = tm(torch.tensor(x), bias=torch.tensor(bias))
    np.testing.assert_allclose(maybe_jit(lambda x, b: jm(x, bias=b))(x, bias), t_out.numpy())


def test_module_hooks_TestModuleHooks_test_remove_kwarg_hooks(maybe_jit):
    x, bias = np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)
    t_fired, j_fired = [], []
    tm, jm = TorchKwargModel(), jhooks.hookable(KwargModel())
    t_handles = (
        tm.register_forward_hook(functools.partial(_kwarg_hook, t_fired), with_kwargs=True),
        tm.register_forward_pre_hook(
            functools.partial(_torch_kwarg_pre_hook, t_fired), with_kwargs=True
        ),
    )
    j_handles = (
        jm.register_forward_hook(functools.partial(_kwarg_hook, j_fired), with_kwargs=True),
        jm.register_forward_pre_hook(functools.partial(_kwarg_pre_hook, j_fired), with_kwargs=True),
    )
    call = maybe_jit(lambda x, b: jm(x, bias=b))
    for step in range(3):
        t_out = tm(torch.tensor(x), bias=torch.tensor(bias))
        np.testing.assert_allclose(call(x, bias), t_out.numpy())  # 4, then 2, then 1 bias
        assert j_fired == t_fired
        if step < 2:
            t_handles[step].remove()
            j_handles[step].remove()


class FailsInForward(eqx.Module):
    def __call__(self, x, fail=True):
        if fail:
            raise RuntimeError("failing in forward")
        return x * 2.0


def test_module_hooks_TestModuleHooks_test_always_called_forward_hooks():
    # jhooks runs an always_call hook when the call raises while it is traced.
    stack = []
    model = jhooks.hookable(FailsInForward())

    def ctx_setup_hook(m, args):
        stack.append(2)

    def ctx_setup_failure_hook(m, args):
        stack.append(2)
        raise RuntimeError("failing in ctx setup")

    def ctx_shutdown_hook(m, args, out):
        stack.append(-1)

    def throw_hook(m, args, out):
        raise RuntimeError("failing in throw")

    pre = model.register_forward_pre_hook(ctx_setup_hook)
    post = model.register_forward_hook(ctx_shutdown_hook, always_call=True)
    with pytest.raises(RuntimeError, match="failing in forward"):
        model(x0)
    assert stack == [2, -1]
    model(x0, fail=False)
    assert stack == [2, -1] * 2
    pre.remove()
    model.register_forward_pre_hook(ctx_setup_failure_hook)
    with pytest.raises(RuntimeError, match="failing in ctx setup"):
        model(x0, fail=False)
    assert stack == [2, -1] * 3
    post2 = model.register_forward_hook(throw_hook, prepend=True, always_call=True)
    # The error is the pre-hook's, not the always-called hook's, which warns (PyTorch too).
    with pytest.raises(RuntimeError, match="failing in ctx setup"):
        with pytest.warns(UserWarning, match="failing in throw"):
            model(x0, fail=False)
    assert stack == [2, -1] * 4
    post.remove()
    post2.remove()
    with jhooks.register_module_forward_hook(ctx_shutdown_hook, always_call=True):
        with pytest.raises(RuntimeError, match="failing in ctx setup"):
            model(x0, fail=False)
        assert stack == [2, -1] * 5
    with pytest.raises(RuntimeError, match="failing in ctx setup"):
        model(x0)
    assert stack == [2, -1] * 5 + [2]


class Sigmoid(eqx.Module):
    def __call__(self, x):
        return jax.nn.sigmoid(x)


def sigmoid():
    return jhooks.hookable(Sigmoid())


def test_module_hooks_TestModuleGlobalHooks_test_module_global_hooks(maybe_jit):
    # PyTorch's global backward hook is the deprecated one; the full one is its
    # jhooks form (docs/pytorch.md).
    counter = {"forwards": 0, "backwards": 0}
    x = jnp.ones((3, 3))
    expected_out = np.full((3, 3), 1 / (1 + 1 / math.e), np.float32)
    np.testing.assert_allclose(torch.sigmoid(torch.ones(3, 3)).numpy(), expected_out, rtol=1e-6)

    def fw_hook(inc, m, args, out):
        assert isinstance(args, tuple)
        counter["forwards"] += inc

    def bw_hook(inc, m, gi, go):
        assert isinstance(gi, tuple) and isinstance(go, tuple)
        counter["backwards"] += inc

    modules = [sigmoid() for _ in range(3)]

    def backward(m):  # output.backward(ones * 2)
        vjp = maybe_jit(lambda x: jax.vjp(m, x)[1](jnp.full((3, 3), 2.0)))
        return vjp(x)

    with jhooks.register_module_forward_hook(functools.partial(fw_hook, 1)):
        for m in modules:
            np.testing.assert_allclose(m(x), expected_out, rtol=1e-6)
        assert counter == {"forwards": 3, "backwards": 0}
        with jhooks.register_module_full_backward_hook(functools.partial(bw_hook, 1)):
            for m in modules:
                backward(m)
            assert counter["backwards"] == 3
            with jhooks.register_module_forward_hook(functools.partial(fw_hook, 2)):
                with jhooks.register_module_full_backward_hook(functools.partial(bw_hook, 2)):
                    counter = {"forwards": 0, "backwards": 0}
                    backward(modules[0])
                    assert counter == {"forwards": 3, "backwards": 3}
                backward(modules[1])
                assert counter == {"forwards": 6, "backwards": 4}
            backward(modules[2])
            assert counter == {"forwards": 7, "backwards": 5}


def test_module_hooks_TestModuleGlobalHooks_test_module_global_hook_invalid_outputs():
    def bw_fail1(m, gi, go):
        return gi[:-1]

    def bw_fail2(m, gi, go):
        return (*gi, jnp.ones((2, 2)))

    loss = lambda x: jnp.sum(sigmoid()(x))  # noqa: E731
    # PyTorch: "got 0, but expected 1" and "got 2, but expected 1".
    with jhooks.register_module_full_backward_hook(bw_fail1):
        with pytest.raises(ValueError, match="bw_fail1 .*returned 0 grad_input entries"):
            jax.grad(loss)(jnp.ones((3, 3)))
    with jhooks.register_module_full_backward_hook(bw_fail2):
        with pytest.raises(ValueError, match="bw_fail2 .*returned 2 grad_input entries"):
            jax.grad(loss)(jnp.ones((3, 3)))


def _sigmoid_case(register, maybe_jit, x_np, grad_out):
    """Runs a Sigmoid with hooks in PyTorch and jhooks: (output, input gradient) each."""
    tm = torch.nn.Sigmoid()
    register(tm, torch)
    xt = torch.tensor(x_np, requires_grad=True)
    out_t = tm(xt)
    out_t.backward(torch.tensor(grad_out))
    jm = sigmoid()
    register(jm, jnp)
    out, vjp = jax.vjp(jm, jnp.asarray(x_np))
    g = maybe_jit(lambda x: jax.vjp(jm, x)[1](jnp.asarray(grad_out))[0])(jnp.asarray(x_np))
    np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=1e-6)
    assert xt.grad is not None
    np.testing.assert_allclose(g, xt.grad.numpy(), rtol=1e-5, atol=1e-7)


X = np.array([[0.5, -1.0, 2.0], [-0.3, 0.1, 1.5]], np.float32)


def _global(register_torch, register_jhooks):
    """A `register(module, xp)` for `_sigmoid_case` that registers global hooks."""
    handles = []

    def register(m, xp):
        handles.extend((register_torch if xp is torch else register_jhooks)())

    return register, handles


def test_module_hooks_TestModuleGlobalHooks_test_module_backward_global_hook_writeable(maybe_jit):
    hook = lambda m, gi, go: tuple(g * 2 for g in gi)  # noqa: E731
    register, handles = _global(
        lambda: [torch.nn.modules.module.register_module_full_backward_hook(hook)],
        lambda: [jhooks.register_module_full_backward_hook(hook)],
    )
    try:
        _sigmoid_case(register, maybe_jit, X, np.ones_like(X))
    finally:
        for h in handles:
            h.remove()


def test_module_hooks_TestModuleGlobalHooks_test_module_global_forward_preforward_hook_writeable(
    maybe_jit,
):
    post = lambda m, args, out: -out  # noqa: E731
    module = torch.nn.modules.module
    register, handles = _global(
        lambda: [
            module.register_module_forward_pre_hook(
                lambda m, args: torch.nn.functional.relu(args[0])
            ),
            module.register_module_forward_hook(post),
        ],
        lambda: [
            jhooks.register_module_forward_pre_hook(lambda m, args: jax.nn.relu(args[0])),
            jhooks.register_module_forward_hook(post),
        ],
    )
    try:
        _sigmoid_case(register, maybe_jit, X, 2 * np.ones_like(X))
    finally:
        for h in handles:
            h.remove()


def _removable(register_name):
    module = sigmoid()
    handles = {}

    def removable_hook(*args):
        handles["h1"].remove()
        return args[-1] if register_name == "register_forward_hook" else args[1]

    def removable_hook_2(*args):
        handles["h2"].remove()
        return args[-1] if register_name == "register_forward_hook" else args[1]

    handles["h1"] = getattr(module, register_name)(removable_hook)
    handles["h2"] = getattr(module, register_name)(removable_hook_2)
    x = jnp.asarray(X)
    np.testing.assert_allclose(module(x), torch.sigmoid(torch.tensor(X)).numpy(), rtol=1e-6)
    calls = []
    with module.register_forward_hook(lambda m, a, o: calls.append(1)):
        module(x)  # the removed hooks do not run again
    assert calls == [1]
    return handles


def test_module_hooks_TestModuleGlobalHooks_test_module_forward_preforward_hook_removable():
    _removable("register_forward_pre_hook")


def test_module_hooks_TestModuleGlobalHooks_test_module_forward_forward_hook_removable():
    _removable("register_forward_hook")


def test_module_hooks_TestModuleGlobalHooks_test_global_and_local_hooks_order(maybe_jit):
    def run(make):
        order = []
        log = lambda name: lambda *args: order.append(name)  # noqa: E731
        make(log)
        return order

    def torch_side(log):
        m = torch.nn.Sigmoid()
        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(log("global_pre")),
            torch.nn.modules.module.register_module_forward_hook(log("global_fwd")),
            torch.nn.modules.module.register_module_full_backward_hook(log("global_bwd")),
        ]
        m.register_forward_pre_hook(log("local_pre"))
        m.register_forward_hook(log("local_fwd"))
        m.register_full_backward_hook(log("local_bwd"))
        try:
            m(torch.randn(2, 2, requires_grad=True)).sum().backward()
        finally:
            for h in handles:
                h.remove()

    def jhooks_side(log):
        m = sigmoid()
        m.register_forward_pre_hook(log("local_pre"))
        m.register_forward_hook(log("local_fwd"))
        m.register_full_backward_hook(log("local_bwd"))
        with (
            jhooks.register_module_forward_pre_hook(log("global_pre")),
            jhooks.register_module_forward_hook(log("global_fwd")),
            jhooks.register_module_full_backward_hook(log("global_bwd")),
        ):
            maybe_jit(jax.grad(lambda x: jnp.sum(m(x))))(jnp.ones((2, 2)))

    expected = run(torch_side)
    assert run(jhooks_side) == expected
    assert expected.index("global_pre") < expected.index("local_pre")
    assert expected.index("global_bwd") < expected.index("local_bwd")


@pytest.mark.parametrize(
    "kind",
    ["register_backward_hook", "register_full_backward_hook", "register_full_backward_pre_hook"],
)
def test_module_hooks_TestModuleHookNN_test_hooks(kind, maybe_jit):
    counter = {"forwards": 0, "backwards": 0}

    def fw_hook(inc, m, args, out):
        counter["forwards"] += inc

    def bw_hook(inc, m, *grads):
        np.testing.assert_allclose(grads[-1][0], 2 * np.ones((3, 3)))  # grad_output
        counter["backwards"] += inc

    m = sigmoid()
    x = jnp.ones((3, 3))

    def backward():
        g = jax.vjp(m, x)[1](jnp.full((3, 3), 2.0))
        return jax.block_until_ready(g)

    register = getattr(m, kind)
    m.register_forward_hook(functools.partial(fw_hook, 1))
    m(x)
    m(x)
    assert counter == {"forwards": 2, "backwards": 0}
    if kind == "register_backward_hook":
        with pytest.warns(FutureWarning):
            first = register(jhooks.host(functools.partial(bw_hook, 1)))
    else:
        first = register(jhooks.host(functools.partial(bw_hook, 1)))
    del first
    backward()
    assert counter == {"forwards": 3, "backwards": 1}
    second = m.register_forward_hook(functools.partial(fw_hook, 2))
    if kind == "register_backward_hook":
        with pytest.warns(FutureWarning):
            third = register(jhooks.host(functools.partial(bw_hook, 2)))
    else:
        third = register(jhooks.host(functools.partial(bw_hook, 2)))
    backward()
    assert counter == {"forwards": 6, "backwards": 4}
    third.remove()
    backward()
    assert counter == {"forwards": 9, "backwards": 5}
    second.remove()
    backward()
    assert counter == {"forwards": 10, "backwards": 6}


def test_module_hooks_TestModuleHookNN_test_hook_cpp(maybe_jit):
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(5, axis_name="batch", mode="batch")
    bn = jhooks.hookable(bn)
    seen = []
    bn.register_full_backward_hook(lambda m, gi, go: seen.append((len(gi), go[0].shape)))

    def loss(xs):
        out, _ = jax.vmap(bn, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(xs, state)
        return jnp.sum(out)

    maybe_jit(jax.grad(loss))(jnp.asarray(np.random.default_rng(0).normal(size=(5, 5)), "f4"))
    # args = (x, state), and grad_output one entry per array of (y, new_state): PyTorch
    # has (x,) and (y,). The first entries are PyTorch's, per example.
    assert seen == [(2, (5,))]


def test_module_hooks_TestModuleHookNN_test_backward_hooks_interaction(maybe_jit):
    cnt = {"t": 0, "j": 0}

    def make(key, xp):
        def bw_pre_hook(m, go):
            cnt[key] += 1
            return (go[0] * 0.5,)

        def bw_hook(m, gi, go):
            np.testing.assert_allclose(np.asarray(go[0]), np.full((1, 2), 0.5))
            cnt[key] += 1
            return go

        return bw_pre_hook, bw_hook

    tm = torch.nn.Sigmoid()
    pre, post = make("t", torch)
    tm.register_full_backward_pre_hook(pre)
    tm.register_full_backward_hook(post)
    tm(torch.ones(1, 2, requires_grad=True)).sum().backward()

    jm = sigmoid()
    pre, post = make("j", jnp)
    jm.register_full_backward_pre_hook(pre)
    jm.register_full_backward_hook(post)
    jax.grad(lambda x: jnp.sum(jm(x)))(jnp.ones((1, 2)))  # eager: the hook sees arrays
    assert cnt["j"] == cnt["t"] == 2


def test_module_hooks_TestModuleHookNN_test_hook_invalid_outputs():
    m = sigmoid()
    loss = lambda x: jnp.sum(m(x))  # noqa: E731
    x = jnp.ones((3, 3))
    cases = [
        (m.register_full_backward_hook, lambda m, gi, go: gi[:-1], "0 grad_input entries"),
        (
            m.register_full_backward_hook,
            lambda m, gi, go: (*gi, jnp.ones((2, 2))),
            "2 grad_input entries",
        ),
        (m.register_full_backward_pre_hook, lambda m, go: (), "0 grad_output entries"),
        (
            m.register_full_backward_pre_hook,
            lambda m, go: (*go, jnp.ones((2, 2))),
            "2 grad_output entries",
        ),
    ]
    for register, hook, message in cases:
        with register(hook):
            with pytest.raises(ValueError, match=message):
                jax.grad(loss)(x)


class ThreeArgs(eqx.Module):
    def __call__(self, arg1, arg2, arg3):
        return jnp.sum(arg1) + jnp.sum(arg2) + jnp.sum(arg3)


def test_module_hooks_TestModuleHookNN_test_hook_requires_grad(maybe_jit):
    # PyTorch checks that the hook wrapper keeps requires_grad per argument. In JAX:
    # the gradient through each argument is unchanged by the hook wrapper, and the
    # argument passed through stop_gradient stays without one.
    mod = jhooks.hookable(ThreeArgs())

    def loss(x):
        return mod(x, jax.lax.stop_gradient(x), x)

    before = maybe_jit(jax.grad(loss))(jnp.ones(2))
    mod.register_full_backward_hook(lambda m, gi, go: None)
    np.testing.assert_array_equal(maybe_jit(jax.grad(loss))(jnp.ones(2)), before)
    inp = torch.ones(2, requires_grad=True)
    (inp.sum() + inp.detach().sum() + inp.sum()).backward()
    assert inp.grad is not None
    np.testing.assert_array_equal(before, inp.grad.numpy())


def test_module_hooks_TestModuleHookNN_test_hook_no_requires_grad(maybe_jit):
    lin_t = torch.nn.Linear(2, 3)
    jlin = eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0))
    jlin = jhooks.hookable(
        eqx.tree_at(
            lambda m: (m.weight, m.bias),
            jlin,
            (jnp.asarray(lin_t.weight.detach().numpy()), jnp.asarray(lin_t.bias.detach().numpy())),
        )
    )
    inp = np.random.default_rng(0).random(2).astype(np.float32)
    seen, return_val = [], ["None"]

    def hook(m, gi, go):
        seen.append((gi, go[0].shape))
        if return_val[0] == "grad_input":
            return gi
        if return_val[0] == "invalid":
            return (jnp.asarray(inp),)
        return None

    jlin.register_full_backward_hook(hook)
    loss = lambda m: jnp.sum(m(jnp.asarray(inp)))  # noqa: E731  # the input is a constant
    for value in ("None", "grad_input"):
        return_val[0] = value
        maybe_jit(jax.grad(loss))(jlin)
    assert seen == [((None,), (3,))] * 2
    return_val[0] = "invalid"  # PyTorch: "where no input requires gradient"
    with pytest.raises(ValueError, match="no input of the call is differentiated"):
        jax.grad(loss)(jlin)


class L1Loss(eqx.Module):
    def __call__(self, a, b):
        return jnp.mean(jnp.abs(a - b))


def test_module_hooks_TestModuleHookNN_test_hook_last_arg_requires_grad(maybe_jit):
    mod = jhooks.hookable(L1Loss())
    mod.register_full_backward_hook(lambda m, gi, go: None)
    inp = torch.rand(1, requires_grad=True)
    torch.nn.L1Loss()(inp.detach() * 0.5, inp).backward()
    x = jnp.asarray(inp.detach().numpy())
    g = maybe_jit(jax.grad(lambda x: mod(jax.lax.stop_gradient(x) * 0.5, x)))(x)
    assert inp.grad is not None
    np.testing.assert_allclose(g, inp.grad.numpy())


class ExtraInput(eqx.Module):
    def __call__(self, non_tensor, tensor):
        return tensor * 1.0, non_tensor


def test_module_hooks_TestModuleHookNN_test_hook_extra_input(maybe_jit):
    seen = []
    mod = jhooks.hookable(ExtraInput())
    mod.register_full_backward_hook(
        lambda m, gi, go: seen.append((gi[0] is None, gi[1] is None, go[0] is None, go[1] is None))
    )
    maybe_jit(jax.grad(lambda x: jnp.sum(mod(True, x)[0])))(jnp.ones(2))
    assert seen == [(True, False, False, True)]


class BackwardSize(eqx.Module):
    def __call__(self, arg1, arg2):
        tmp = jnp.sum(arg1) * arg2
        tmp = tmp + jnp.sum(arg2) * jnp.sum(arg1)
        return jnp.broadcast_to(jnp.sum(tmp).reshape(1), (8,))


def test_module_hooks_TestModuleHookNN_test_hook_backward_size(maybe_jit):
    seen = []
    mod = jhooks.hookable(BackwardSize())
    mod.register_full_backward_hook(
        lambda m, gi, go: seen.append(([g.shape for g in gi], [g.shape for g in go]))
    )
    loss = lambda a, b: jnp.sum(mod(a, b))  # noqa: E731
    maybe_jit(jax.grad(loss, argnums=(0, 1)))(jnp.ones((5, 5)), jnp.ones((10, 10)))
    assert seen == [([(5, 5), (10, 10)], [(8,)])]


def test_module_hooks_TestModuleHookNN_test_hook_backward_writeable(maybe_jit):
    def register(m, xp):
        hook = lambda m, gi, go: tuple(g * 2 for g in gi)  # noqa: E731
        m.register_full_backward_hook(hook)

    _sigmoid_case(register, maybe_jit, X, np.ones_like(X))


def test_module_hooks_TestModuleHookNN_test_hook_forward_preforward_writable(maybe_jit):
    def register(m, xp):
        relu = torch.nn.functional.relu if xp is torch else jax.nn.relu
        m.register_forward_pre_hook(lambda m, args: relu(args[0]))
        m.register_forward_hook(lambda m, args, out: -out)

    _sigmoid_case(register, maybe_jit, X, 2 * np.ones_like(X))

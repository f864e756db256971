"""Hooks see values and pass them to each other, as in PyTorch (docs/semantics.md, the
rule of runs): an eager run calls a hook with side effects on concrete values where the
program reaches it (a graph break), backward hooks in the backward pass, and a backward
hook reads what a forward hook kept. Oracles: the same hooks in PyTorch on the same
weights, and the same computation written by hand in JAX."""

from __future__ import annotations

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jhooks

RNG = np.random.default_rng(0)
W1 = RNG.normal(size=(4, 6)).astype(np.float32) * 0.5
B1 = RNG.normal(size=(6,)).astype(np.float32) * 0.1
W2 = RNG.normal(size=(6, 3)).astype(np.float32) * 0.5
B2 = RNG.normal(size=(3,)).astype(np.float32) * 0.1
X = RNG.normal(size=(5, 4)).astype(np.float32)
PARAMS = {
    "w1": jnp.asarray(W1),
    "b1": jnp.asarray(B1),
    "w2": jnp.asarray(W2),
    "b2": jnp.asarray(B2),
}


def model(p, x):
    h = jhooks.hook_point(jnp.tanh(x @ p["w1"] + p["b1"]), "h")
    return jhooks.hook_point(h @ p["w2"] + p["b2"], "out")


def loss(p, x):
    return jnp.sum(model(p, x) ** 2)


def torch_net():
    first, second = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
    with torch.no_grad():
        first.weight.copy_(torch.from_numpy(W1.T.copy()))
        first.bias.copy_(torch.from_numpy(B1))
        second.weight.copy_(torch.from_numpy(W2.T.copy()))
        second.bias.copy_(torch.from_numpy(B2))
    act = torch.nn.Tanh()
    return torch.nn.Sequential(first, act, second), act, first, second


def close(a, b, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=atol)


def test_an_eager_hook_prints_converts_and_branches_on_values(capsys):
    seen = []

    def look(z, name):
        print(name, np.round(np.asarray(z)[0, :2], 3))
        seen.append((float(z.mean()), z.max().item()))
        if z.mean() > 0:  # a Python branch on the value
            return z * 0.0
        return None

    for x in (X, -X):
        out = jhooks.run_with_hooks(model, PARAMS, jnp.asarray(x), fwd_hooks=[("h", look)])
        h = np.tanh(x @ W1 + B1)
        expected = (h * 0.0 if h.mean() > 0 else h) @ W2 + B2
        close(out, expected)
        close(seen[-1], (h.mean(), h.max()))
        assert f"h {np.round(h[0, :2], 3)}" in capsys.readouterr().out
    assert all(type(v) is float for pair in seen for v in pair)


def test_under_the_users_jit_a_hook_that_needs_a_value_is_told_the_ways_out():
    def look(z, name):
        return z * float(z.mean())

    run = jax.jit(lambda x: jhooks.run_with_hooks(model, PARAMS, x, fwd_hooks=[("h", look)]))
    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"hook .*look") as info:
        run(X)
    assert "jhooks.host" in str(info.value)


def test_under_the_users_jit_a_hook_with_side_effects_is_told_once():
    calls = []

    def count(z, name):
        calls.append(name)

    run = jax.jit(lambda x: jhooks.run_with_hooks(model, PARAMS, x, fwd_hooks=[("h", count)]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            run(X + i)
    told = [str(w.message) for w in caught if "once per compilation" in str(w.message)]
    assert len(told) == 1 and len(calls) == 1  # JAX's rule: once per compilation
    assert "hook test_under_the_users_jit_a_hook_with_side_effects_is_told_once." in told[0]
    assert "Call the run outside your jit" in told[0] and "jhooks.host" in told[0]
    assert caught[0].filename == __file__
    # Outside the jit it runs on every call, on values.
    for i in range(3):
        jhooks.run_with_hooks(model, PARAMS, X + i, fwd_hooks=[("h", count)])
    assert len(calls) == 4


def test_under_the_users_jit_a_jhooks_host_hook_is_not_told_to_use_jhooks_host(maybe_jit):
    """A hook wrapped in `jhooks.host` runs on the host on every call, in the user's jit
    too: the once-per-compilation warning (which points to jhooks.host) is not for it."""
    kept = []

    def keep(z, name):
        kept.append(np.asarray(z))

    run = maybe_jit(
        lambda x: jhooks.run_with_hooks(model, PARAMS, x, fwd_hooks=[("h", jhooks.host(keep))])
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            run(X + i)
        jax.effects_barrier()
    assert [str(w.message) for w in caught] == []
    assert len(kept) == 3
    by_hand = [np.asarray(jhooks.run_with_cache(model, PARAMS, X + i)[1]["h"]) for i in range(3)]
    for got, want in zip(kept, by_hand):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_backward_hook_runs_when_the_backward_runs():
    # TransformerLens' "backward hook runs successfully": 0 after the forward, 1 after.
    count = [0]

    def counter(grad, name):
        count[0] += 1

    out, pull = eqx.filter_vjp(
        lambda p: jhooks.run_with_hooks(model, p, X, bwd_hooks=[("h", counter)]), PARAMS
    )
    assert count == [0]
    pull(jnp.ones_like(out))
    assert count == [1]
    pull(jnp.ones_like(out))
    assert count == [2]  # once per backward pass


def _grad_times_activation_torch():
    net, act, first, _ = torch_net()
    saved = {}

    def keep(module, args, output):
        saved["a"] = output.detach()
        output.register_hook(lambda g: g * saved["a"])

    act.register_forward_hook(keep)
    net(torch.from_numpy(X)).pow(2).sum().backward()
    return first.weight.grad.numpy().T, first.bias.grad.numpy()


@pytest.mark.parametrize("where", ["eager", "jit", "filter_jit", "filter_vjp"])
def test_a_backward_hook_uses_what_a_forward_hook_kept_as_in_torch(where):
    saved = {}

    def keep(z, name):
        saved["a"] = z

    def times_activation(g, name):
        return g * saved["a"]

    def objective(p):
        hooks = {"fwd_hooks": [("h", keep)], "bwd_hooks": [("h", times_activation)]}
        return jnp.sum(jhooks.run_with_hooks(model, p, X, **hooks) ** 2)

    if where == "filter_vjp":
        out, pull = eqx.filter_vjp(objective, PARAMS)
        grads = pull(jnp.ones_like(out))[0]
    else:
        wrap = {"eager": lambda f: f, "jit": jax.jit, "filter_jit": eqx.filter_jit}[where]
        grads = wrap(jax.grad(objective))(PARAMS)
    w1, b1 = _grad_times_activation_torch()
    close(grads["w1"], w1)
    close(grads["b1"], b1)
    if where in ("eager", "filter_vjp"):
        close(saved["a"], np.tanh(X @ W1 + B1))  # the concrete activation, not a tracer


def test_grad_cam_and_kfac_factors_as_in_torch():
    # Grad-CAM's channel weights and K-FAC's factors from a forward hook (the layer's
    # input, its output) and a backward hook (the gradient of the output).
    kept, found = {}, {}

    def keep(z, name):
        kept[str(name)] = z

    def factors(g, name):
        a = kept["h"]
        found["cam"] = np.maximum((np.asarray(g).mean(0) * np.asarray(a)).sum(-1), 0.0)
        found["G"] = np.asarray(g).T @ np.asarray(g) / g.shape[0]
        found["A"] = np.asarray(a).T @ np.asarray(a) / a.shape[0]

    jax.grad(
        lambda p: jnp.sum(
            jhooks.run_with_hooks(model, p, X, fwd_hooks=[("h", keep)], bwd_hooks=[("h", factors)])
            ** 2
        )
    )(PARAMS)
    net, act, _, _ = torch_net()
    ref = {}

    def keep_t(module, args, output):
        ref["a"] = output.detach()

    def factors_t(module, grad_input, grad_output):
        g, a = grad_output[0], ref["a"]
        ref["cam"] = torch.relu((g.mean(0) * a).sum(-1))
        ref["G"] = g.T @ g / g.shape[0]
        ref["A"] = a.T @ a / a.shape[0]

    act.register_forward_hook(keep_t)
    act.register_full_backward_hook(factors_t)
    net(torch.from_numpy(X)).pow(2).sum().backward()
    for k in ("cam", "G", "A"):
        close(found[k], ref[k].numpy())


def test_per_example_gradient_norms_by_hand_as_opacus():
    # Opacus' grad sampler for a linear layer, by hand: the layer's input from a forward
    # hook, its output's gradient from a backward hook; the per-example gradient of the
    # weight is their outer product, whose norm is the product of the norms.
    inputs, norms = {}, []

    def keep_input(z, name):
        inputs["h"] = np.asarray(z)

    def per_example(g, name):
        g = np.asarray(g)
        full = np.concatenate([inputs["h"], np.ones((g.shape[0], 1), np.float32)], axis=1)
        norms.append(np.linalg.norm(g, axis=1) * np.linalg.norm(full, axis=1))

    jax.grad(
        lambda p: jnp.sum(
            jhooks.run_with_hooks(
                model, p, X, fwd_hooks=[("h", keep_input)], bwd_hooks=[("out", per_example)]
            )
            ** 2
        )
    )(PARAMS)

    def one(p, x):
        return jnp.sum(model(p, x[None]) ** 2)

    grads = jax.vmap(jax.grad(one), in_axes=(None, 0))(PARAMS, jnp.asarray(X))
    reference = np.sqrt(
        np.sum(np.asarray(grads["w2"]) ** 2, axis=(1, 2)) + np.sum(np.asarray(grads["b2"]) ** 2, 1)
    )
    close(norms[0], reference, atol=1e-4)


def scanned(p, x):
    def body(c, w):
        a = jhooks.hook_point(jnp.tanh(c @ w), "a")
        b = jhooks.hook_point(a * 2.0, "b")
        return b, None

    ws = jnp.stack([p["w1"][:, :4], p["w1"][:, 2:6]])
    return jax.lax.scan(body, x, ws)[0]


@pytest.mark.parametrize("jit", [False, True])
def test_hooks_in_one_scan_iteration_pass_values(jit):
    store = {}

    def save(v, name):
        store["a"] = v

    def use(v, name):
        return v - store["a"]  # the same iteration's "a"

    def run(x):
        return jhooks.run_with_hooks(scanned, PARAMS, x, fwd_hooks=[("a", save), ("b", use)])

    out = (jax.jit(run) if jit else run)(jnp.asarray(X))
    c = X
    for w in (W1[:, :4], W1[:, 2:6]):
        a = np.tanh(c @ w)
        c = 2.0 * a - a
    close(out, c)


def test_a_hooks_error_is_raised_as_it_was_and_the_next_call_works():
    calls = []

    def failing(z, name):
        calls.append(name)
        if len(calls) == 2:
            raise KeyError("no such head")

    run = lambda: jhooks.run_with_hooks(model, PARAMS, X, fwd_hooks=[("h", failing)])  # noqa: E731
    run()
    with pytest.raises(KeyError, match="no such head"):
        run()
    close(run(), model(PARAMS, jnp.asarray(X)))
    assert len(calls) == 3


def test_a_replacement_on_values_in_a_differentiated_run_is_refused():
    def log(z, name):
        print(float(z.mean()))

    def double(z, name):
        return z * 2.0

    hooks = [("h", log), ("out", double)]  # `double` runs on values: after `log`
    with pytest.raises(ValueError, match=r"hook .*double at point 'out' runs on concrete values"):
        jax.grad(lambda p: jnp.sum(jhooks.run_with_hooks(model, p, X, fwd_hooks=hooks)))(PARAMS)
    # Not differentiated, the same hooks run.
    out = jhooks.run_with_hooks(model, PARAMS, X, fwd_hooks=hooks)
    close(out, 2.0 * model(PARAMS, jnp.asarray(X)))


def test_hooks_on_values_leave_no_tracer_and_compile_once():
    acts = []
    traces = []

    def counted(p, x):
        traces.append(1)
        return model(p, x)

    with jax.checking_leaks():
        for i in range(4):
            jhooks.run_with_hooks(
                counted, PARAMS, X + i, fwd_hooks=[("h", lambda z, n: acts.append(z))]
            )
    assert len(traces) <= 2  # traced for its layout and its program, once
    for i, a in enumerate(acts):
        assert not isinstance(a, jax.core.Tracer)
        close(a, np.tanh((X + i) @ W1 + B1))


def looped(x):
    def body(c, _):
        return jhooks.hook_point(jnp.tanh(c), "h"), None

    return jax.lax.scan(body, x, None, length=3)[0]


def test_a_hook_on_values_reads_its_iteration():
    seen = []

    def zero_second(z, name):
        (layer,) = jhooks.loop_index()
        seen.append(int(layer))
        return z * 0.0 if int(layer) == 1 else None  # a Python branch on the index

    for _ in range(2):
        out = jhooks.run_with_hooks(looped, jnp.asarray(X[0]), fwd_hooks=[("h", zero_second)])
        c = np.tanh(X[0])
        c = np.tanh(c * 0.0)
        close(out, np.tanh(c))
    assert seen == [0, 1, 2, 0, 1, 2]  # once per iteration, in order


def test_a_helper_reading_the_iteration_of_a_hook_on_values_is_refused():
    def helper():
        return jhooks.loop_index()

    def keep(z, name, kept=[]):  # noqa: B006 - it writes: it runs on values
        kept.append(helper())

    with pytest.raises(ValueError, match=r"whose code does not name loop_index"):
        jhooks.run_with_hooks(looped, jnp.asarray(X[0]), fwd_hooks=[("h", keep)])


def test_emit_from_a_hook_on_values_is_refused():
    log = []

    def norm_and_log(g, name):
        log.append(name)
        jhooks.emit("norm", jnp.linalg.norm(g))

    def objective(p):
        return jnp.sum(jhooks.run_with_hooks(model, p, X, bwd_hooks=[("h", norm_and_log)]))

    # Raised in the backward pass, which JAX runs: JAX's runtime error carries it.
    with pytest.raises(Exception, match=r"ValueError: hook .*norm_and_log at hook point 'h' "):
        jhooks.grad(objective)(PARAMS)


def test_threads_running_hooks_on_values_each_get_their_own_values():
    import threading

    results = {}

    def worker(k):
        mine = []

        def keep(z, name):
            mine.append(float(z.sum()))

        for i in range(10):
            x = jnp.asarray(X) + (k + i) / 10
            jhooks.run_with_hooks(model, PARAMS, x, fwd_hooks=[("h", keep)])
        results[k] = mine

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        expected = [np.tanh((X + (k + i) / 10) @ W1 + B1).sum() for i in range(10)]
        close(results[k], expected, atol=1e-4)


def test_a_backward_replacement_on_values_differentiated_again_is_refused():
    # Grad of grad through a backward hook on values: its replacement's tangent is not
    # known (it was taken as the identity: half the hessian), so the run refuses it.
    calls = []

    def doubled(g, name):
        calls.append(name)
        return g * 2.0

    def objective(x):
        return jnp.sum(jhooks.run_with_hooks(model, PARAMS, x, bwd_hooks=[("h", doubled)]) ** 2)

    with pytest.raises(Exception, match=r"hook .*doubled at point 'h' runs on concrete values"):
        jax.hessian(lambda x: objective(x[None]))(jnp.asarray(X[0]))
    # Once differentiated, it runs and doubles the gradient at "h", as in PyTorch.
    grad = jax.grad(objective)(jnp.asarray(X))

    gh = jax.grad(lambda h: jnp.sum((h @ PARAMS["w2"] + PARAMS["b2"]) ** 2))(jnp.tanh(X @ W1 + B1))
    _, pull = jax.vjp(lambda x: jnp.tanh(x @ PARAMS["w1"] + PARAMS["b1"]), jnp.asarray(X))
    close(grad, pull(2.0 * gh)[0], atol=1e-4)


SHARED: dict = {}
SAVED: dict = {}


def _keep_saved(z, name):
    SHARED["n"] = 1.0
    SAVED["a"] = z


def _reads_shared_first():
    seen = SHARED  # the same dict, closed over and named as a global

    def use(g, name):
        return 0.0 * SHARED.get("n", 0.0) + 0.0 * seen.get("n", 0.0) + g * SAVED["a"]

    return use


@pytest.mark.parametrize("jit", [False, True])
def test_a_backward_hook_reaching_one_dict_twice_still_reads_the_forward_value(jit):
    use = _reads_shared_first()

    def objective(x):
        hooks = {"fwd_hooks": [("h", _keep_saved)], "bwd_hooks": [("h", use)]}
        return jnp.sum(jhooks.run_with_hooks(model, PARAMS, x, **hooks) ** 2)

    grad = (jax.jit(jax.grad(objective)) if jit else jax.grad(objective))(jnp.asarray(X))
    h = jnp.tanh(X @ W1 + B1)
    gh = jax.grad(lambda h: jnp.sum((h @ PARAMS["w2"] + PARAMS["b2"]) ** 2))(h)
    _, pull = jax.vjp(lambda x: jnp.tanh(x @ PARAMS["w1"] + PARAMS["b1"]), jnp.asarray(X))
    close(grad, pull(gh * h)[0], atol=1e-4)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_the_host_call_under_vmap_calls_once_per_example_with_numpy_values(jitted):
    # The program's call of a hook on values (`_core/_jax_compat/_host_call.py`): its
    # operands reach Python as NumPy arrays, and under a vmap it is called once per
    # example, an unbatched operand as it is (io_callback's rule).
    from jhooks._core import as_arrays, host_call

    seen = []

    def callback(a, b):
        seen.append((type(a), a.shape, b.shape))
        (kept,) = as_arrays([a])
        return (np.asarray(kept) * 2 + b,)

    def f(a, b):
        return host_call(callback, [a, b], [jax.ShapeDtypeStruct(a.shape, a.dtype)])[0]

    a, b = jnp.arange(6.0).reshape(3, 2), jnp.asarray([1.0, -1.0])
    vmapped = jax.vmap(f, in_axes=(0, None))
    out = (jax.jit(vmapped) if jitted else vmapped)(a, b)
    np.testing.assert_allclose(out, np.asarray(a) * 2 + np.asarray(b))
    assert seen == [(np.ndarray, (2,), (2,))] * 3


def test_under_the_users_jit_a_pure_hook_holding_its_argument_is_not_told():
    # A steering hook over a vector the jit is given (a `partial`, a closure): no side
    # effect, so no warning (it was told it had side effects: its tracer has no key).
    def steer(z, name, vector):
        return z + vector

    def run(x, v):
        def closure(z, name):
            return z * v

        hooks = [("h", functools.partial(steer, vector=v)), ("h", closure)]
        return jhooks.run_with_hooks(model, PARAMS, x, fwd_hooks=hooks)

    v = jnp.linspace(0.0, 1.0, W1.shape[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax.jit(run)(X, v)
    told = [str(w.message) for w in caught if "once per compilation" in str(w.message)]
    assert told == []
    expected = jhooks.run_with_hooks(
        model, PARAMS, X, fwd_hooks=[("h", lambda z, name: (z + v) * v)]
    )
    close(out, expected)


def test_a_hook_on_values_over_an_array_sharded_across_eight_devices():
    # The host call in a program over 8 (simulated) devices: the hook gets the whole
    # value, concrete, once per call, and its replacement is used.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("batch",))
    xs = jax.device_put(
        jnp.asarray(np.random.default_rng(1).normal(size=(16, 4)), jnp.float32),
        NamedSharding(mesh, P("batch")),
    )
    seen = []

    def keep(z, name):
        seen.append((z.shape, float(z.mean())))
        return z * 2.0

    for _ in range(2):
        out = jhooks.run_with_hooks(model, PARAMS, xs, fwd_hooks=[("h", keep)])
    h = np.tanh(np.asarray(xs) @ W1 + B1)
    np.testing.assert_allclose(out, (2 * h) @ W2 + B2, rtol=1e-5, atol=1e-5)
    assert [s for s, _ in seen] == [(16, 6), (16, 6)]
    np.testing.assert_allclose([m for _, m in seen], [h.mean(), h.mean()], rtol=1e-5)


@pytest.mark.parametrize("ends", ["returns", "a later hook raises", "interrupted", "model raises"])
def test_a_kept_value_is_concrete_in_any_container_whatever_ends_the_call(ends):
    """Issue 43: a value kept in a tuple, a namedtuple, a deque or a queue stayed a
    tracer, and one kept before the call failed stayed a tracer for good. A hook with
    side effects runs on values: what it keeps is the concrete activation, in any
    container, and stays so whatever ends the call (a later hook's error, a
    KeyboardInterrupt, the model's own error)."""
    import collections
    import queue

    Kept = collections.namedtuple("Kept", ["name", "value"])
    pairs, named, deque, fifo = [], [], collections.deque(), queue.Queue()

    def keep(z, name):
        pairs.append((str(name), z))
        named.append(Kept(str(name), z))
        deque.append(z)
        fifo.put(z)

    def after(z, name):
        if ends == "a later hook raises":
            raise RuntimeError("later")
        if ends == "interrupted":
            raise KeyboardInterrupt

    def fails(p, x):
        out = model(p, x)
        if ends == "model raises":  # after the point, as the trace is made
            raise ValueError("the model's own error")
        return out

    raised = {"returns": None, "a later hook raises": RuntimeError}
    raised.update({"interrupted": KeyboardInterrupt, "model raises": ValueError})
    for i in range(3):
        x = X + i
        hooks = [("h", keep), ("out", after)]
        if raised[ends] is None:
            jhooks.run_with_hooks(fails, PARAMS, x, fwd_hooks=hooks)
        else:
            with pytest.raises(raised[ends]):
                jhooks.run_with_hooks(fails, PARAMS, x, fwd_hooks=hooks)
        if ends == "model raises":  # the program never ran: nothing is kept
            assert not (pairs or named or deque or not fifo.empty())
            continue
        expected = np.tanh(x @ W1 + B1)
        values = [pairs[-1][1], named[-1].value, deque[-1], fifo.get_nowait()]
        for value in values:
            assert isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
            close(value, expected)
        assert pairs[-1][0] == named[-1].name == "h"
    assert len(pairs) == len(named) == len(deque) == (0 if ends == "model raises" else 3)


def test_a_backward_hook_reading_a_forward_hooks_value_runs_only_in_the_backward():
    """Grad-CAM's pair: a forward hook keeps the activation, a backward hook with a side
    effect returns the gradient times it. Its Python runs once, in the backward pass, on
    values, as in PyTorch (it ran at the forward too, traced, until it read the kept
    value: its `calls.append` ran twice)."""
    x = RNG.normal(size=(3,)).astype(np.float32)
    calls, kept = [], {}

    def keep(z, name):
        kept["a"] = z

    def times_act(g, name):
        calls.append(type(g).__name__)
        return g * kept["a"]

    def f(x):
        return jnp.sum(jhooks.hook_point(jnp.tanh(x), "h") ** 2)

    hooks = dict(fwd_hooks=[("h", keep)], bwd_hooks=[("h", times_act)])
    out, pull = jax.vjp(lambda x: jhooks.run_with_hooks(f, x, **hooks), jnp.asarray(x))
    assert calls == []  # the forward ran: no backward hook yet
    (grad,) = pull(jnp.float32(1.0))
    assert calls == ["ArrayImpl"]

    t_calls, t_kept = [], {}
    tx = torch.tensor(x, requires_grad=True)
    h = torch.tanh(tx)
    t_kept["a"] = h.detach()
    h.register_hook(lambda g: t_calls.append("grad") or g * t_kept["a"])
    (h**2).sum().backward()
    assert len(t_calls) == len(calls) == 1
    np.testing.assert_allclose(float(out), float((h**2).sum().detach()), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), tx.grad.numpy(), rtol=1e-5)
    # Under the user's jit, JAX's rule: the hooks are traced once per compilation.
    with pytest.warns(UserWarning, match="once per compilation"):
        jitted = jax.jit(jax.grad(lambda x: jhooks.run_with_hooks(f, x, **hooks)))(x)
    np.testing.assert_allclose(np.asarray(jitted), tx.grad.numpy(), rtol=1e-5)


def test_grad_cam_under_jax_checking_leaks():
    """What a forward hook of a differentiated run keeps is jhooks' to give its
    concrete value: `jax.checking_leaks()` does not call it a leak (it raised 'Leaked
    trace' at the hook's own trace). Under the user's jit the hooks are the user's
    traced code: keeping a tracer there is JAX's leak, and still refused."""
    x = RNG.normal(size=(3,)).astype(np.float32)
    kept = {}

    def keep(z, name):
        kept["a"] = z

    def times_act(g, name):
        return g * kept["a"]

    def f(x):
        return jnp.sum(jhooks.hook_point(jnp.tanh(x), "h"))

    hooks = dict(fwd_hooks=[("h", keep)], bwd_hooks=[("h", times_act)])
    with jax.checking_leaks():
        grad = jax.grad(lambda x: jhooks.run_with_hooks(f, x, **hooks))(x)
    assert not isinstance(kept["a"], jax.core.Tracer)
    tanh = np.tanh(x)
    np.testing.assert_allclose(np.asarray(grad), (1 - tanh**2) * tanh, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(kept["a"]), tanh, rtol=1e-6)
    with jax.checking_leaks(), pytest.raises(Exception, match="Leaked"):
        jax.jit(jax.grad(lambda x: jhooks.run_with_hooks(f, x, **hooks)))(x)


def test_a_registered_module_hook_keeping_its_output_in_a_run_is_told_and_taken_back():
    """PyTorch's `register_forward_hook(lambda m, args, out: acts.append(out))`, with
    the model called inside a run: the module hook is traced with the model, so what it
    keeps has no value. It left a tracer in the user's list on every call, silently, and
    the list's growth traced the run again each call; now it is taken out, with one
    warning naming the hook and the ways to keep values, and the run traces once. Called
    outside a run, the module hook keeps concrete values, as in PyTorch."""
    lin = jhooks.hookable(eqx.nn.Linear(4, 3, key=jax.random.PRNGKey(0)))
    acts, traces = [], []

    def keep_output(module, args, output):
        acts.append(output)

    handle = lin.register_forward_hook(keep_output)

    def f(m, x):
        traces.append(1)
        return m(x)

    try:
        xs = [jnp.asarray(RNG.normal(size=4), jnp.float32) for _ in range(3)]
        with pytest.warns(UserWarning, match="registered hook .*keep_output kept a traced"):
            out = jhooks.run_with_hooks(f, lin, xs[0])
        np.testing.assert_allclose(out, lin.weight @ xs[0] + lin.bias, rtol=1e-6)
        for x in xs[1:]:
            out = jhooks.run_with_hooks(f, lin, x)
            np.testing.assert_allclose(out, lin.weight @ x + lin.bias, rtol=1e-6)
        assert acts == []
        assert len(traces) == 1  # it was 3: the list's tracers changed the hook's key
        lin(xs[0])  # outside a run: on values
        assert len(acts) == 1 and not isinstance(acts[0], jax.core.Tracer)
        np.testing.assert_allclose(acts[0], lin.weight @ xs[0] + lin.bias, rtol=1e-6)
    finally:
        handle.remove()


# Grad of grad through a run's backward hooks (docs/semantics.md, "Second order"): the
# hooks run in both backward passes, eagerly as under jit, as PyTorch's double backward
# (`create_graph=True`) runs `y.register_hook`'s. Oracle: PyTorch, and 24 x sum(w**3) by
# hand for the doubling hook.
W3 = np.asarray([0.3, -0.7, 1.1], np.float32)


def cubed(x):
    return jnp.sum(jhooks.hook_point(x * jnp.asarray(W3), "h") ** 3)


def _torch_grad_of_grad(hook, x):
    tx = torch.tensor(x, requires_grad=True)
    y = tx * torch.from_numpy(W3)
    y.register_hook(hook)
    (first,) = torch.autograd.grad((y**3).sum(), tx, create_graph=True)
    first.backward()
    assert tx.grad is not None
    return tx.grad.numpy()


def _grad_of_grad(hooks, where, jit):
    """`x -> d2/dx2 cubed(x)` with `hooks` as the run's backward hooks: the run
    differentiated twice (`outer`), or its function differentiating itself (`body`)."""
    if where == "body":
        body = jax.grad(jax.grad(cubed))
        gg = lambda x: jhooks.run_with_hooks(body, x, bwd_hooks=hooks)  # noqa: E731
    else:
        gg = jax.grad(jax.grad(lambda x: jhooks.run_with_hooks(cubed, x, bwd_hooks=hooks)))
    return jax.jit(gg) if jit else gg


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("where", ["outer", "body"])
def test_grad_of_grad_runs_a_pure_backward_hook_in_both_passes_as_in_torch(where, jit):
    gg = _grad_of_grad([("h", lambda g, name: g * 2.0)], where, jit)
    for x in (0.8, 0.8, 0.5):  # a first call, a warm one, another value
        expected = _torch_grad_of_grad(lambda g: g * 2, x)
        close(gg(jnp.float32(x)), expected)
        close(expected, 24 * x * np.sum(W3.astype(np.float64) ** 3))


@pytest.mark.parametrize(
    "how", ["eager", "eager, jhooks.host", "jit, jhooks.host", "body", "body, jhooks.host"]
)
def test_grad_of_grad_calls_a_backward_hook_on_values_in_both_passes_as_in_torch(how):
    # PyTorch calls the hook twice: with the first pass's gradient, then the second's.
    seen: list = []
    expected: list = []
    _torch_grad_of_grad(lambda g: expected.append(g.detach().numpy().copy()), 0.8)
    assert len(expected) == 2

    def keep(g, name):
        seen.append(np.asarray(g))

    hook = jhooks.host(keep) if "host" in how else keep
    where = "body" if how.startswith("body") else "outer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # under jit: once per compilation
        gg = _grad_of_grad([("h", hook)], where, how.startswith("jit"))
        for _ in range(2):  # a first call, then a warm one
            seen.clear()
            out = gg(jnp.float32(0.8))
            jax.effects_barrier()
            close(out, _torch_grad_of_grad(lambda g: None, 0.8))
            assert len(seen) == 2
            for a, b in zip(seen, expected):
                close(a, b)


def test_forward_over_reverse_of_a_run_scales_only_the_reverse_pass():
    # `jax.hessian` is jacfwd(jacrev): forward mode does not run hooks (docs/semantics.md,
    # "Second order"), eagerly as under jit: 12 x sum(w**3), half of grad of grad.
    f = lambda x: jhooks.run_with_hooks(cubed, x, bwd_hooks=[("h", lambda g, name: g * 2.0)])  # noqa: E731
    expected = 12 * 0.8 * np.sum(W3.astype(np.float64) ** 3)
    close(jax.hessian(f)(jnp.float32(0.8)), expected)
    close(jax.jit(jax.hessian(f))(jnp.float32(0.8)), expected)

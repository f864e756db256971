"""The jit key of registered hooks: never stale, no needless recompiles, thread safe."""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks


class Counted(jhooks.Module):
    fc: eqx.nn.Linear
    traces: list = eqx.field(static=True)

    def __call__(self, x):
        self.traces.append(1)
        return self.fc(x)


def _net(traces: list) -> Counted:
    return Counted(eqx.nn.Linear(3, 3, key=jax.random.key(0)), traces)


def double(module, args, out):
    return out * 2.0


# The trace counts below see only each test's own registrations (conftest.py).
pytestmark = pytest.mark.usefixtures("settled_hook_state")


def test_reregistering_the_same_hook_compiles_once():
    traces: list = []
    net = _net(traces)
    step = jax.jit(lambda net, x: net(x))
    x = jnp.ones(3)
    plain = step(net, x)
    for _ in range(10):
        # The PyTorch pattern: a fresh registration of the same hook every step.
        with net.fc.register_forward_hook(lambda m, args, out: out * 2.0):
            np.testing.assert_allclose(step(net, x), 2 * plain, rtol=1e-6)
        np.testing.assert_allclose(step(net, x), plain)
    assert len(traces) == 2  # the plain program and the hooked one, once each


def test_a_changed_closure_value_retraces_and_an_old_one_is_reused():
    traces: list = []
    net = _net(traces)
    step = jax.jit(lambda net, x: net(x))
    x = jnp.ones(3)
    plain = step(net, x)
    for scale in [2.0, 3.0, 2.0, 3.0]:
        with net.fc.register_forward_hook(lambda m, args, out: out * scale):  # noqa: B023
            np.testing.assert_allclose(step(net, x), scale * plain, rtol=1e-6)
    assert len(traces) == 3  # plain, x2, x3


def test_negative_zero_in_a_closure_is_another_program():
    traces: list = []
    net = _net(traces)
    step = jax.jit(lambda net, x: net(x))
    x = jnp.ones(3)
    signs = []
    for fill in [0.0, -0.0, 0.0]:
        with net.fc.register_forward_hook(lambda m, args, out: jnp.full_like(out, fill)):  # noqa: B023
            signs.append(bool(np.signbit(step(net, x)).all()))
    assert signs == [False, True, False]  # 0.0 == -0.0 in Python, not in the program
    assert len(traces) == 2


def test_functions_that_reach_no_hook_retrace_once_per_hook_state():
    traces: list = []
    net = _net([])
    other = jax.jit(lambda x: (traces.append(1), x * 2)[1])
    x = jnp.ones(3)
    other(x)
    for _ in range(5):
        with net.register_forward_hook(double):
            other(x)
        other(x)
    # Documented bound: at most once per distinct hook state (here two), never per
    # registration.
    assert len(traces) == 2


def test_hook_registered_while_tracing_is_gone_after_removal(maybe_jit):
    traces: list = []
    net = _net(traces)
    x = jnp.ones(3)
    plain = np.asarray(net(x))
    added: list = []

    def register_once(module, args):
        if not added:
            added.append(module.register_forward_hook(lambda m, a, out: out + 100.0))

    pre = net.fc.register_forward_pre_hook(register_once)
    step = maybe_jit(lambda net, x: net(x))
    step(net, x)
    pre.remove()
    np.testing.assert_allclose(step(net, x), plain + 100.0, rtol=1e-6)
    added[0].remove()
    np.testing.assert_allclose(step(net, x), plain, rtol=1e-6)


def test_hook_registered_and_removed_inside_the_step(maybe_jit):
    net = _net([])
    x = jnp.ones(3)
    plain = np.asarray(net(x))

    def step(net, x):
        with net.fc.register_forward_hook(double):
            return net(x)

    np.testing.assert_allclose(maybe_jit(step)(net, x), 2 * plain, rtol=1e-6)
    np.testing.assert_allclose(maybe_jit(lambda n, x: n(x))(net, x), plain, rtol=1e-6)


def test_full_backward_hook_runs_for_input_then_parameter_gradients():
    net = jhooks.hookable(eqx.nn.Linear(3, 2, key=jax.random.key(1)))
    seen: list = []
    net.register_full_backward_hook(
        jhooks.host(lambda m, gi, go: seen.append((gi[0] is not None, go[0].copy())))
    )
    f = jax.jit(lambda net, x: jnp.sum(net(x) * jnp.arange(1.0, 3.0)))
    x = jnp.ones(3)
    jax.grad(f, argnums=1)(net, x)
    jax.grad(f, argnums=0)(net, x)
    jax.grad(f, argnums=1)(net, x)
    jax.effects_barrier()
    assert [s[0] for s in seen] == [True, False, True]
    for _, go in seen:
        np.testing.assert_allclose(go, [1.0, 2.0])


def test_node_hooks_are_those_registered_when_the_node_is_called():
    node = jhooks.Node(lambda a: a * 3.0)
    out, vjp = jax.vjp(node, jnp.ones(2))
    with node.register_hook(lambda gi, go: (gi[0] * 10,)):
        (g,) = vjp(jnp.ones(2))
    # Documented: JAX builds the backward rule when the forward runs.
    np.testing.assert_allclose(g, 3.0 * jnp.ones(2))
    with node.register_hook(lambda gi, go: (gi[0] * 10,)):
        out, vjp = jax.vjp(node, jnp.ones(2))
    np.testing.assert_allclose(vjp(jnp.ones(2))[0], 30.0 * jnp.ones(2))


def test_registration_from_threads_while_steps_run():
    net = _net([])
    step = jax.jit(lambda net, x: net(x))
    x = jnp.ones(3)
    plain = np.asarray(step(net, x))
    errors: list = []
    stop = threading.Event()

    def register_and_remove():
        try:
            while not stop.is_set():
                h = net.fc.register_forward_hook(lambda m, a, out: out * 1.0)
                h.remove()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=register_and_remove) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(200):
            # Identity hooks come and go: every result must be the plain one.
            np.testing.assert_allclose(step(net, x), plain, rtol=1e-6)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors


def test_ten_thousand_steps_with_hooks_toggled_compile_boundedly():
    traces: list = []
    net = _net(traces)
    x = jnp.ones(3)

    @jax.jit
    def step(net, x):
        return jax.grad(lambda net: jnp.sum(net(x) ** 2))(net)

    total = jnp.zeros(())
    for i in range(10_000):
        if i % 2:
            with net.fc.register_full_backward_pre_hook(lambda m, go: (go[0] * 0.5,)):
                g = step(net, x)
        else:
            g = step(net, x)
        total = total + g.fc.bias[0]
    assert len(traces) == 2
    assert step._cache_size() == 2  # flat: two programs, however many steps
    assert np.isfinite(total)


def test_handle_ids_are_unique_and_removal_idempotent():
    net = _net([])
    handles = [net.fc.register_forward_hook(double) for _ in range(3)]
    handles.append(jhooks.register_module_forward_hook(double))
    assert len({h.id for h in handles}) == 4
    for h in handles:
        h.remove()
        h.remove()
    with pytest.raises(TypeError, match="must be callable"):
        net.fc.register_forward_hook(3)  # type: ignore[arg-type]


def test_aot_compiled_and_exported_programs_keep_their_hooks():
    net = _net([])
    x = jnp.ones(3)
    plain = np.asarray(net(x))
    compiled = jax.jit(lambda net, x: net(x)).lower(net, x).compile()
    exported = jax.export.export(jax.jit(lambda x: net(x)))(x)
    with net.fc.register_forward_hook(double):
        # Documented: lowering fixes the hooks; these programs no longer look at them.
        np.testing.assert_allclose(compiled(net, x), plain, rtol=1e-6)
        np.testing.assert_allclose(exported.call(x), plain, rtol=1e-6)
    with net.fc.register_forward_hook(jhooks.host(lambda m, a, out: None)):
        with pytest.raises(NotImplementedError, match="host_callbacks"):
            jax.export.export(jax.jit(lambda x: net(x)))(x)

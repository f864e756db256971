"""Guided errors for PyTorch habits inside hooks (issue 27): each names the hook, what it
was given, and the fix; JAX's own error is chained as the cause. Every body runs with
and without `jax.jit` (`eqx.filter_jit` for modules).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

X = jnp.arange(15.0).reshape(5, 3) / 10


def filter_jit_or_not(maybe_jit):
    return eqx.filter_jit if maybe_jit is jax.jit else maybe_jit


def mlp():
    return jhooks.hookable(eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0)))


def batch_loss(model, x):
    return jnp.sum(jax.vmap(model)(x) ** 2)


def chain(error):
    """The errors `error` was raised from or during (JAX may put its own record of the
    forward pass's stack between them, as `__cause__`)."""
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen[1:]


def traced_error(excinfo, hook, chained=True):
    """The message of a guided error about a traced value; checks what every one says."""
    message = str(excinfo.value)
    assert message.startswith(f"hook {hook.__qualname__} tried to read a traced value ")
    assert "its arguments are traced" in message
    assert "`jhooks.host(fn)`" in message
    if chained:
        assert any(isinstance(e, jax.errors.JAXTypeError) for e in chain(excinfo.value))
    return message


# float / bool / .item() / np.asarray on a traced value: JAX's concretization error, guided


def test_float_in_a_forward_hook_points_to_host(maybe_jit):
    model = mlp()

    def log_mean(module, args, out):
        print(float(out.mean()))

    model.layers[0].register_forward_hook(log_mean)
    grad = filter_jit_or_not(maybe_jit)(eqx.filter_grad(batch_loss))
    with pytest.raises(jax.errors.ConcretizationTypeError) as excinfo:
        grad(model, X)
    message = traced_error(excinfo, log_mean)
    # Under vmap the hook sees one example's output of the first layer (4 features).
    assert "it was given float32[4]" in message
    assert message.endswith(
        "JAX said: ConcretizationTypeError: Abstract tracer value encountered where concrete "
        "value is expected: traced array with shape float32[]"
    )


@pytest.mark.parametrize("habit", ["item", "bool", "asarray"])
def test_item_bool_and_asarray_in_a_backward_hook(maybe_jit, habit):
    model = mlp()

    def clamp_if_large(module, grad_output):
        g = grad_output[0]
        if habit == "item":
            scale = g.max().item()
        elif habit == "bool":
            scale = 1.0 if bool(g.max() > 1) else 2.0
        else:
            scale = float(np.asarray(g).max())
        return (g * scale,)

    model.layers[1].register_full_backward_pre_hook(clamp_if_large)
    grad = filter_jit_or_not(maybe_jit)(eqx.filter_grad(batch_loss))
    with pytest.raises(TypeError) as excinfo:
        grad(model, X)
    message = traced_error(excinfo, clamp_if_large)
    # The hook is given its grad_output: one example's gradient at the output (2 features).
    assert "it was given (float32[2],)" in message
    want = {
        "item": jax.errors.ConcretizationTypeError,
        "bool": jax.errors.TracerBoolConversionError,
        "asarray": jax.errors.TracerArrayConversionError,
    }[habit]
    assert isinstance(excinfo.value, want)
    assert any(type(e) is want for e in chain(excinfo.value))


def test_float_in_a_value_hook_and_a_multi_grad_hook(maybe_jit):
    def log_norm(g):
        print(float(jnp.linalg.norm(g)))

    def log_both(grads):
        print([float(g.sum()) for g in grads])

    def loss(w):
        h = jhooks.register_hook(jnp.tanh(w), log_norm)
        return jnp.sum(h**2)

    def two(a, b):
        a, b = jhooks.register_multi_grad_hook((a, b), log_both)
        return jnp.sum(a * b)

    # Eagerly, jax.grad gives hooks concrete gradients (as PyTorch does); under jax.vmap or
    # jax.jit they are traced.
    w = jnp.ones((2, 3))
    with pytest.raises(jax.errors.ConcretizationTypeError) as excinfo:
        maybe_jit(jax.vmap(jax.grad(loss)))(w)
    assert "it was given float32[3]" in traced_error(excinfo, log_norm)
    with pytest.raises(jax.errors.ConcretizationTypeError) as excinfo:
        maybe_jit(jax.vmap(jax.grad(two, argnums=(0, 1))))(w, w)
    assert "it was given (float32[3], float32[3])" in traced_error(excinfo, log_both)


def test_float_in_a_node_hook_and_a_run_hook(maybe_jit):
    node = jhooks.Node(jnp.sin)

    def log_grad_input(grad_input, grad_output):
        print(float(grad_input[0].sum()))

    node.register_hook(log_grad_input)
    with pytest.raises(jax.errors.ConcretizationTypeError) as excinfo:
        maybe_jit(jax.vmap(jax.grad(lambda a: jnp.sum(node(a)))))(jnp.ones((2, 3)))
    assert "it was given (float32[3],)" in traced_error(excinfo, log_grad_input)

    model = mlp()

    def record(value, name):
        print(name, value.mean().item())

    run = maybe_jit(lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("layers.0", record)]))
    if maybe_jit is not jax.jit:
        # An eager run calls a hook with side effects on values: `.item()` works.
        np.testing.assert_allclose(run(X[0]), model(X[0]))
        return
    with pytest.raises(jax.errors.ConcretizationTypeError) as excinfo:
        run(X[0])
    # A run re-raises its tracing errors with a note (the cause is the error itself).
    assert "it was given float32[4]" in traced_error(excinfo, record, chained=False)


def test_a_leaked_tracer_is_found_by_jax_checking_leaks(frozen_gc):
    # A hook that keeps its traced argument in a list raises nothing when it runs: the list
    # holds a tracer, which fails later, when used. jhooks cannot see the list; JAX's leak
    # checker finds it (docs/semantics.md says so).
    kept = []
    for check in (False, True):
        model = mlp()  # a new model: its hook is new, so the step is traced again
        model.layers[0].register_forward_hook(lambda module, args, out: kept.append(out))
        if not check:
            eqx.filter_jit(eqx.filter_grad(batch_loss))(model, X)
            assert len(kept) == 1 and isinstance(kept[0], jax.core.Tracer)
            continue
        with jax.checking_leaks(), pytest.raises(Exception, match="Leaked trace"):
            eqx.filter_jit(eqx.filter_grad(batch_loss))(model, X)


# The batch axis in a hook under jax.vmap: a hook sees one example


def vmap_error(excinfo, hook, given):
    message = str(excinfo.value)
    assert message.startswith(
        f"hook {hook.__qualname__} raised {type(excinfo.value).__name__} under jax.vmap, "
        f"where a hook sees one example: it was given {given}, one example's shapes, "
        "without the batch axis"
    )
    original = type(excinfo.value).__mro__[1]
    assert any(type(e) is original for e in chain(excinfo.value))
    return message


def first_example(module, args, out):
    return out.at[0, :].set(0.0)


def keep_first_column(module, grad_output):
    return (grad_output[0][:, :1] * jnp.ones(2),)


def mask_examples(module, args, out):
    return out * jnp.array([1.0, 0.0, 1.0, 1.0, 0.0])  # one entry per example


@pytest.mark.parametrize(
    "hook, layer, register, error, given, said",
    [
        (first_example, 0, "forward", IndexError, "float32[4]", "IndexError: Too many indices"),
        (
            keep_first_column,
            1,
            "full_backward_pre",
            IndexError,
            "(float32[2],)",
            "IndexError: Too many indices",
        ),
        (
            mask_examples,
            0,
            "forward",
            TypeError,
            "float32[4]",
            "TypeError: mul got incompatible shapes for broadcasting: (4,), (5,).",
        ),
    ],
    ids=["index-forward", "index-backward", "broadcast-forward"],
)
def test_the_batch_axis_in_a_hook_under_vmap(maybe_jit, hook, layer, register, error, given, said):
    model = mlp()
    getattr(model.layers[layer], f"register_{register}_hook")(hook)
    grad = filter_jit_or_not(maybe_jit)(eqx.filter_grad(batch_loss))
    with pytest.raises(error) as excinfo:
        grad(model, X)
    message = vmap_error(excinfo, hook, given)
    assert f"The error: {said}" in message


def test_other_errors_in_hooks_are_left_as_they_are(maybe_jit):
    model = mlp()

    def refuse(module, args, out):
        raise ValueError("my own error")

    handle = model.layers[0].register_forward_hook(refuse)
    grad = filter_jit_or_not(maybe_jit)(eqx.filter_grad(batch_loss))
    with pytest.raises(ValueError) as excinfo:
        grad(model, X)
    assert str(excinfo.value) == "my own error"
    assert not any(isinstance(e, ValueError) for e in chain(excinfo.value))
    handle.remove()

    # The same shape error outside jax.vmap: the hook sees the batch, nothing to guide.
    def second_axis(module, args, out):
        return out[:, :, 0]

    model.layers[0].register_forward_hook(second_axis)
    with pytest.raises(IndexError, match="Too many indices") as excinfo:
        filter_jit_or_not(maybe_jit)(eqx.filter_grad(lambda m, x: jnp.sum(m(x[0]))))(model, X)
    assert "jax.vmap" not in str(excinfo.value)


# An in-place edit in a hook (issue 44): JAX's TypeError, guided with the hook, its point
# and the statement written functionally


def _jax_in_place_line():
    """JAX's own first line for `x[i] = y`, from JAX itself (its wording may change)."""
    with pytest.raises(TypeError) as excinfo:
        jnp.zeros(3)[0] = 1.0  # pyright: ignore[reportIndexIssue]
    return str(excinfo.value).splitlines()[0]


def in_place(who, statement, rewrite, returned):
    return (
        f"{who} edited an array in place (`{statement}`): JAX arrays are immutable (a hook may "
        "be given a traced value, and the value it is given is the model's too). Write the "
        f"edit functionally, `{rewrite}`, and return the new array, `return {returned}`: "
        "what a hook returns replaces the value it was given. JAX said: TypeError: "
        f"{_jax_in_place_line()}"
    )


def assert_guided_in_place(excinfo, expected):
    assert str(excinfo.value) == expected
    assert isinstance(excinfo.value, TypeError)  # `except TypeError` still catches it
    # JAX's own error is chained: the cause, or the error JAX's record of the trace holds.
    assert any(
        type(e) is TypeError and str(e).splitlines()[0] == _jax_in_place_line()
        for e in chain(excinfo.value)
    )


def heads(x):
    h = x[:, :, None] * jnp.arange(1.0, 4.0)  # (batch, pos, head)
    return jnp.sum(jhooks.hook_point(h * 2.0, "hook_z") ** 2)


def zero_head(z, name):
    z[:, :, 1] = 0
    return z


def zero_head_functionally(z, name):
    z = z.at[:, :, 1].set(0)
    return z


HEADS_X = jnp.arange(6.0).reshape(2, 3) / 10


@pytest.mark.parametrize("point", ["hook_z", "/mul"])
def test_an_in_place_edit_in_a_run_hook_is_guided(maybe_jit, point):
    def run(hook):
        return maybe_jit(lambda x: jhooks.run_with_hooks(heads, x, fwd_hooks=[(point, hook)]))

    kind = "hook point" if point == "hook_z" else "operation"
    who = f"hook zero_head at {kind} {point!r}"
    expected = in_place(who, "z[:, :, 1] = 0", "z = z.at[:, :, 1].set(0)", "z")
    # The spelling given works: head 1 (the input times 2 and 2) drops out of the sum.
    total = float(jnp.sum((HEADS_X * 2.0) ** 2 * (1.0 + 9.0)))
    np.testing.assert_allclose(float(run(zero_head_functionally)(HEADS_X)), total, rtol=1e-6)
    # Eagerly, that run's program is reused: the hook is called again in its hook pass.
    with pytest.raises(TypeError) as excinfo:
        run(zero_head)(HEADS_X)
    assert_guided_in_place(excinfo, expected)


def test_an_in_place_edit_in_a_run_hook_is_guided_on_the_first_trace(maybe_jit):
    def first(x):  # a function of its own: no program of it exists yet
        return heads(x)

    with pytest.raises(TypeError) as excinfo:
        maybe_jit(lambda x: jhooks.run_with_hooks(first, x, fwd_hooks=[("hook_z", zero_head)]))(
            HEADS_X
        )
    who = "hook zero_head at hook point 'hook_z'"
    expected = in_place(who, "z[:, :, 1] = 0", "z = z.at[:, :, 1].set(0)", "z")
    assert_guided_in_place(excinfo, expected)


def add_to_first(module, args, out):
    out[0] += 1.0
    return out


def test_an_in_place_edit_in_a_module_forward_hook_is_guided(maybe_jit):
    model = mlp()
    model.layers[0].register_forward_hook(add_to_first)
    with pytest.raises(TypeError) as excinfo:
        filter_jit_or_not(maybe_jit)(model)(X[0])
    who = "hook add_to_first of module 'layers.0' (Linear)"
    expected = in_place(who, "out[0] += 1.0", "out = out.at[0].add(1.0)", "out")
    assert_guided_in_place(excinfo, expected)


def zero_first(g):
    g[0] = 0.0
    return g


def test_an_in_place_edit_in_a_value_hook_is_guided(maybe_jit):
    def loss(w):
        return jnp.sum(jhooks.register_hook(jnp.tanh(w), zero_first) ** 2)

    with pytest.raises(TypeError) as excinfo:
        maybe_jit(jax.grad(loss))(jnp.ones(3))
    who = "hook zero_first on a value's gradient (jhooks.register_hook)"
    assert_guided_in_place(excinfo, in_place(who, "g[0] = 0.0", "g = g.at[0].set(0.0)", "g"))


@pytest.mark.parametrize(
    "statement, spelled",
    [
        ("z[:, :, 1] = 0  # ablate", ("z[:, :, 1] = 0", "z = z.at[:, :, 1].set(0)", "z")),
        ("z[..., i] -= x", ("z[..., i] -= x", "z = z.at[..., i].add(-x)", "z")),
        ("z[0] -= a * b", ("z[0] -= a * b", "z = z.at[0].add(-(a * b))", "z")),
        ("z[0, 1:] *= 2", ("z[0, 1:] *= 2", "z = z.at[0, 1:].multiply(2)", "z")),
        ("out[0][:, 1] /= s", ("out[0][:, 1] /= s", "out[0].at[:, 1].divide(s)", "out[0]")),
        ("z[0] //= 2", None),  # no .at[] method for it
        ("z = z + 1", None),
        ("return (", None),
    ],
)
def test_the_functional_spelling_of_a_statement(statement, spelled):
    from jhooks._core._inplace import functional

    assert functional(statement) == spelled


class Pair(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        y = self.linear(x)
        return y, 2.0 * y


class Outer(eqx.Module):
    pair: Pair

    def __call__(self, x):
        return self.pair(x)[1]


def test_an_in_place_edit_with_no_source_and_into_an_output_tuple(maybe_jit):
    # A hook whose source is not on disk (exec): the general spelling.
    namespace = {}
    exec("def no_source(z, name):\n    z[0] = 0.0\n    return z\n", namespace)
    no_source = namespace["no_source"]
    with pytest.raises(TypeError) as excinfo:
        maybe_jit(lambda x: jhooks.run_with_hooks(heads, x, fwd_hooks=[("hook_z", no_source)]))(
            HEADS_X
        )
    assert str(excinfo.value).startswith(
        "hook no_source at hook point 'hook_z' edited an array in place: JAX arrays are "
        "immutable (a hook may be given a traced value, and the value it is given is the "
        "model's too). Write the edit functionally, `x = x.at[idx].set(y)`, and return the "
        "new array, `return x`: "
    )

    # An array inside the output (a stateful layer's `(y, state)`): the new array, and the
    # output to return with it; the hook's own error about tuples is the cause.
    def bump(module, args, out):
        out[0][0] += 1.0
        return out

    model = jhooks.hookable(Outer(Pair(eqx.nn.Linear(3, 4, key=jax.random.key(0)))))
    model.pair.register_forward_hook(bump)
    with pytest.raises(TypeError) as excinfo:
        filter_jit_or_not(maybe_jit)(model)(X[0])
    assert str(excinfo.value).startswith(
        "hook test_an_in_place_edit_with_no_source_and_into_an_output_tuple.<locals>.bump of "
        "module 'pair' (Pair) edited an array in place (`out[0][0] += 1.0`): JAX arrays "
        "are immutable (a hook may be given a traced value, and the value it is given is the "
        "model's too). Write the edit functionally, `out[0].at[0].add(1.0)`, and return the "
        "output with that array in place of `out[0]`: "
    )


# A hook whose signature does not take what it is called with: Python's TypeError, guided
# with the signatures each kind of hook is called with


SIGNATURES = (
    "Hooks are called as PyTorch and TransformerLens call them: a run's hooks as "
    "hook(value, name), a module's forward hooks as hook(module, args, output), its forward "
    "pre-hooks as hook(module, args), its backward hooks as hook(module, grad_input, "
    "grad_output), a value's gradient hooks as hook(grad) (with_kwargs=True adds the "
    "keyword arguments)."
)


def _python_line(fn, *args):
    """Python's own first line for calling `fn` with `args` (its wording may change)."""
    with pytest.raises(TypeError) as excinfo:
        fn(*args)
    return str(excinfo.value).splitlines()[0]


def assert_guided_signature(excinfo, hook, where, *called_with):
    said = _python_line(hook, *called_with)
    assert str(excinfo.value) == (
        f"hook {hook.__qualname__} {where} cannot take the arguments it is called with "
        f"(TypeError: {said}). {SIGNATURES}"
    )
    assert isinstance(excinfo.value, TypeError)  # `except TypeError` still catches it
    assert type(excinfo.value.__cause__) is TypeError
    assert str(excinfo.value.__cause__) == said


@pytest.mark.parametrize("kind", ["pure", "on values"])
def test_a_run_hook_taking_one_argument_is_guided(maybe_jit, kind):
    model = mlp()
    seen = []

    def one_argument(z):
        if kind == "on values":
            seen.append(z)  # a side effect: an eager run calls it on values
        return z * 2.0

    run = maybe_jit(
        lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("layers.0", one_argument)])
    )
    with pytest.raises(TypeError) as excinfo:
        run(X[0])
    assert_guided_signature(excinfo, one_argument, "at hook point 'layers.0'", X[0], "layers.0")
    assert seen == []


def test_a_module_forward_hook_taking_two_arguments_is_guided(maybe_jit):
    model = mlp()

    def two_arguments(module, out):
        return out

    handle = model.layers[0].register_forward_hook(two_arguments)
    with pytest.raises(TypeError) as excinfo:
        filter_jit_or_not(maybe_jit)(model)(X[0])
    where = "of module 'layers.0' (Linear)"
    assert_guided_signature(excinfo, two_arguments, where, model.layers[0], (X[0],), X[0])
    handle.remove()
    np.testing.assert_allclose(filter_jit_or_not(maybe_jit)(model)(X[0]), model(X[0]))


def test_a_type_error_raised_inside_a_hook_is_left_as_it_is(maybe_jit):
    model = mlp()

    def scale(a):
        return a * 2.0

    def calls_a_helper_wrongly(z, name):
        return scale(z, 2.0)  # pyright: ignore[reportCallIssue]

    run = maybe_jit(
        lambda x: jhooks.run_with_hooks(model, x, fwd_hooks=[("layers.0", calls_a_helper_wrongly)])
    )
    with pytest.raises(TypeError) as excinfo:
        run(X[0])
    assert str(excinfo.value) == _python_line(scale, 1.0, 2.0)
    assert "cannot take the arguments" not in str(excinfo.value)


def test_a_backward_run_hook_under_the_users_vmap_and_grad_is_guided(maybe_jit):
    """A run under the user's `jax.vmap` inside `jax.grad`: its backward hooks are traced
    where the point is (for the outer grad), and `np.asarray` there gets the guided
    error, as under jit (it was JAX's bare error)."""
    w, x = jnp.ones((4, 3)), jnp.ones((5, 4))

    def model(w, x):
        return jnp.sum(x @ jhooks.hook_point(jnp.tanh(w), "tw"))

    def observe(g, name):
        print(np.asarray(g).sum())

    def loss(w):
        run = jax.vmap(lambda x: jhooks.run_with_hooks(model, w, x, bwd_hooks=[("tw", observe)]))
        return jnp.sum(run(x))

    with pytest.raises(jax.errors.TracerArrayConversionError) as excinfo:
        maybe_jit(jax.grad(loss))(w)
    assert "it was given float32[4,3]" in traced_error(excinfo, observe, chained=False)

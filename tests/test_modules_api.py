"""The typed module-level functions (API.md section 7), import hygiene, and their errors."""

import json
import os
import pathlib
import runpy
import shutil
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jhooks

ROOT = pathlib.Path(__file__).resolve().parent.parent


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(3, 4, key=k1)
        self.fc2 = eqx.nn.Linear(4, 2, key=k2)

    def __call__(self, x, scale=1.0):
        return self.fc2(jnp.tanh(self.fc1(x))) * scale


def mlp():
    return jhooks.hookable(MLP(jax.random.PRNGKey(0)))


def test_functions_and_methods_are_the_same_registration(maybe_jit):
    net, order = mlp(), []
    x = jnp.arange(3.0)
    plain = net(x)
    hooks = [
        jhooks.register_forward_pre_hook(net.fc1, lambda m, args: order.append("f pre")),
        net.fc1.register_forward_pre_hook(lambda m, args: order.append("m pre")),
        jhooks.register_forward_pre_hook(
            net.fc1, lambda m, args: order.append("f first"), prepend=True
        ),
        jhooks.register_forward_hook(net.fc2, lambda m, args, out: out * 2.0),
        net.fc2.register_forward_hook(lambda m, args, out: out + 1.0),
        jhooks.register_forward_hook(
            net, lambda m, args, kwargs, out: out * kwargs["scale"], with_kwargs=True
        ),
        jhooks.register_forward_pre_hook(
            net, lambda m, args, kwargs: (args, {"scale": 3.0}), with_kwargs=True
        ),
    ]
    out = maybe_jit(lambda x: net(x, scale=1.0))(x)
    np.testing.assert_allclose(out, ((plain * 2.0 + 1.0) * 3.0) * 3.0, rtol=1e-6)
    assert order == ["f first", "f pre", "m pre"]
    for h in hooks:
        h.remove()
    np.testing.assert_allclose(maybe_jit(lambda x: net(x))(x), plain, rtol=1e-6)


def test_backward_and_parameter_functions(maybe_jit):
    net, seen = mlp(), []
    x = jnp.arange(3.0)

    def loss(net, x):
        return jnp.sum(net(x) ** 2)

    plain, plain_x = jax.grad(loss, argnums=(0, 1))(net, x)
    jhooks.register_full_backward_pre_hook(net.fc2, lambda m, go: (go[0] * 2.0,))
    jhooks.register_full_backward_hook(net.fc1, lambda m, gi, go: seen.append(m) or None)
    jhooks.register_parameter_hook(net, "fc1.bias", jnp.zeros_like)
    grads, x_grad = maybe_jit(jax.grad(loss, argnums=(0, 1)))(net, x)
    np.testing.assert_allclose(grads.fc2.weight, plain.fc2.weight * 2.0, rtol=1e-6)
    np.testing.assert_allclose(x_grad, plain_x * 2.0, rtol=1e-5)
    assert float(jnp.abs(grads.fc1.bias).max()) == 0.0
    assert jhooks.module_path(seen[0]) == "fc1"  # shapes in place of arrays, path kept


def test_module_path_tells_modules_apart_in_global_hooks(maybe_jit):
    net, paths = mlp(), []
    with jhooks.register_module_forward_hook(
        lambda m, args, out: paths.append(jhooks.module_path(m))
    ):
        maybe_jit(lambda x: net(x))(jnp.ones(3))
    assert paths == ["fc1", "fc2", ""]


def test_errors_name_the_hook_and_what_was_expected(maybe_jit):
    plain = MLP(jax.random.PRNGKey(0))
    net = mlp()
    with pytest.raises(
        TypeError,
        match=r"^cannot register a hook on Linear: it is not hookable\. Call "
        r"`model = jhooks\.hookable\(model\)` on the whole model first",
    ):
        jhooks.register_forward_hook(plain.fc1, lambda m, args, out: out)
    with pytest.raises(TypeError, match=r"^cannot register a hook on MLP: it is not hookable"):
        jhooks.register_parameter_hook(plain, "fc1.bias", jnp.zeros_like)
    with pytest.raises(TypeError, match=r"^cannot register a hook on list: it is not an Equinox"):
        not_a_module: object = [net.fc1]
        jhooks.register_full_backward_hook(not_a_module, lambda m, gi, go: None)  # type: ignore
    with pytest.raises(TypeError, match=r"^cannot find the path of Linear: it is not hookable"):
        jhooks.module_path(plain.fc1)
    with pytest.raises(TypeError, match=r"^hook must be callable, got 3 of type int"):
        jhooks.register_full_backward_pre_hook(net.fc1, 3)  # type: ignore[arg-type]

    def bad_pre(m, args, kwargs):
        return args

    jhooks.register_forward_pre_hook(net.fc2, bad_pre, with_kwargs=True)
    with pytest.raises(
        ValueError,
        match=r"^forward pre-hook .*bad_pre of module 'fc2' \(Linear\) was registered with "
        r"with_kwargs=True and returned \(float32\[4\],\): it must return None or a pair "
        r"\(args, kwargs\) of a tuple and a dict\.",
    ):
        maybe_jit(lambda x: net(x))(jnp.ones(3))

    def wrong_grad(g):
        return g[:1]

    net = mlp()
    jhooks.register_parameter_hook(net, "fc2.bias", wrong_grad)
    with pytest.raises(
        ValueError,
        match=r"^hook .*wrong_grad on parameter 'fc2.bias' of module '' \(MLP\) returned "
        r"gradient float32\[1\], expected float32\[2\]",
    ):
        maybe_jit(jax.grad(lambda net: jnp.sum(net(jnp.ones(3)))))(net)
    with pytest.raises(
        ValueError,
        match=r"^register_parameter_hook\('fc2.b', .*wrong_grad\) on module '' \(MLP\): no "
        r"such parameter\. Valid names: fc1.weight, fc1.bias, fc2.weight, fc2.bias\.",
    ):
        jhooks.register_parameter_hook(net, "fc2.b", wrong_grad)


def run_python(code, **env):
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=ROOT,
        check=False,
    )


IMPORT_HYGIENE = """
import json, equinox as eqx, jax, jax.numpy as jnp

def classes():
    import equinox.nn
    found = {}
    for mod in (eqx, eqx.nn, jax, jax.numpy, jax.tree_util):
        for name, obj in vars(mod).items():
            if isinstance(obj, type):
                found[f"{mod.__name__}.{name}"] = obj
    found["jax.Array"] = jax.Array
    found["ArrayImpl"] = type(jnp.ones(1))
    return found

def snapshot():
    return {k: sorted(f"{a}={v!r}" for a, v in vars(c).items() if a != "__abstractmethods__")
            for k, c in classes().items()}

before = snapshot()
import jhooks
after = snapshot()
changed = sorted(k for k in before if before[k] != after.get(k))
print(json.dumps({"classes": len(before), "changed": changed,
                  "getattr": "__getattr__" in vars(eqx.Module)}))
"""


def test_importing_jhooks_changes_no_equinox_or_jax_class():
    result = run_python(IMPORT_HYGIENE, JHOOKS_EXPLAIN_MISSING_HOOKS="")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["classes"] > 50
    assert report == {"classes": report["classes"], "changed": [], "getattr": False}


EXPLAIN = """
import warnings
warnings.simplefilter("error")
import jhooks, equinox as eqx, jax
print("before hookable:", "__getattr__" in vars(eqx.Module))
plain = eqx.nn.MLP(2, 2, 2, 1, key=jax.random.PRNGKey(0))
model = jhooks.hookable(plain)
print("after hookable:", "__getattr__" in vars(eqx.Module))
for module in (eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0)), plain, plain.layers[0]):
    try:
        module.register_forward_hook(print)
    except AttributeError as e:
        print("error:", e)
try:
    plain.nonsense
except AttributeError as e:
    print("error:", e)
model.register_forward_hook(print)
"""


def test_missing_register_methods_are_explained_after_the_first_hookable_call():
    # Not at import (the hygiene test above): the first `hookable` call installs it.
    result = run_python(EXPLAIN, JHOOKS_EXPLAIN_MISSING_HOOKS="")
    assert result.returncode == 0, result.stderr
    not_hookable = (
        "this module is not hookable. Call `model = jhooks.hookable(model)` on the whole "
        "model first and use the model it returns (or subclass `jhooks.Module` instead of "
        "`eqx.Module`)."
    )
    assert result.stdout.strip().splitlines() == [
        "before hookable: False",
        "after hookable: True",
        f"error: Linear.register_forward_hook: {not_hookable}",
        "error: MLP.register_forward_hook: this is the model that was given to "
        "`jhooks.hookable`, which returns a new, hookable model (Equinox modules are "
        "immutable): use the model it returns, `model = jhooks.hookable(model)`.",
        f"error: Linear.register_forward_hook: {not_hookable}",
        "error: 'MLP' object has no attribute 'nonsense'",
    ]


def test_explanation_turned_off_leaves_equinox_unchanged():
    result = run_python(EXPLAIN, JHOOKS_EXPLAIN_MISSING_HOOKS="0")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[:2] == ["before hookable: False", "after hookable: False"]
    assert lines[2] == "error: 'Linear' object has no attribute 'register_forward_hook'"


PYRIGHT = shutil.which("pyright", path=os.path.dirname(sys.executable))


def test_typed_usage_passes_pyright():
    # scripts/test.sh installs pyright (the dev extra) in the newest-JAX venv, which runs
    # this test; the oldest-JAX run deselects it (types do not depend on JAX's version).
    assert PYRIGHT is not None, "pyright is not installed: pip install -e '.[dev]'"
    result = subprocess.run(
        [PYRIGHT, "--outputjson", "--pythonpath", sys.executable, "tests/typed_usage.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    report = json.loads(result.stdout)
    assert report["summary"]["errorCount"] == 0, report["generalDiagnostics"]


def test_typed_usage_runs():
    runpy.run_path(str(ROOT / "tests" / "typed_usage.py"), run_name="__main__")

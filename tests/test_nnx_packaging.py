"""Flax is optional: `import jhooks` imports no Flax (nor Haiku); Equinox models never need it."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

NO_FLAX = """
import sys
import equinox as eqx, jax, jax.numpy as jnp
import jhooks

assert not [m for m in sys.modules if m == "flax" or m.startswith("flax.")], "flax imported"
net = jhooks.hookable(eqx.nn.MLP(2, 1, 4, 1, key=jax.random.PRNGKey(0)))
h = jhooks.register_forward_hook(net.layers[0], lambda m, a, o: o * 2.0)
g = eqx.filter_grad(lambda n: jnp.sum(n(jnp.ones(2))))(net)
grads, norms = jhooks.clipped_grad(lambda m, x: jnp.sum(m(x)), 1.0, in_axes=(None, 0))(
    net, jnp.ones((3, 2))
)
names = [n for n, _ in jhooks.named_modules(net)] + [n for n, _ in jhooks.named_parameters(g)]
jhooks.run_with_cache(net, jnp.ones(2))
assert not [m for m in sys.modules if m == "flax" or m.startswith("flax.")], "flax imported"
assert not [m for m in sys.modules if m == "haiku" or m.startswith("haiku.")], "haiku imported"
print("ok", len(names))
"""


def test_import_jhooks_and_equinox_models_import_no_flax():
    result = subprocess.run(
        [sys.executable, "-c", NO_FLAX],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_flax_is_an_extra_and_tested():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("flax") for r in extras["flax"])
    assert any(r.startswith("flax") for r in extras["test"])
    assert not any(
        r.startswith("flax")
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    )


# What only the fence may touch: Flax's internal modules, and the private attributes
# jhooks relies on (a pytree class's flag, its static attributes, a variable's raw value).
FLAX_INTERNALS = (
    "flax.nnx.graphlib",
    "flax.nnx.pytreelib",
    "flax.nnx.variablelib",
    "flax.nnx.statelib",
    "flax.nnx.extract",
    "_pytree__",
    "_raw_value",
    "graphlib.",
)
FLAX_FENCE = ROOT / "jhooks" / "_nnx" / "_flax_compat.py"


def test_flax_internals_only_in_the_fence():
    wrong = []
    for path in sorted((ROOT / "jhooks").rglob("*.py")):
        if path == FLAX_FENCE:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            wrong += [f"{path.name}:{i} uses {x}" for x in FLAX_INTERNALS if x in code]
    assert wrong == []
    assert any(x in FLAX_FENCE.read_text() for x in FLAX_INTERNALS)  # the check sees them

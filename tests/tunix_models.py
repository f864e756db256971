"""tunix's published LLMs (google-tunix 0.1.7, Flax NNX) in tiny random-initialised
configurations, shared by `test_published_names.py` and `test_clipping_tunix.py`.

tunix's `__init__.py` imports its trainers (grain, datasets, transformers...); the model
modules need only Flax and JAX, so they are imported here without it (see `tunix_module`).
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import types
import warnings

import flax
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jhooks

FAMILIES = ["llama3", "qwen3", "gemma3"]
WINDOW = 3  # Gemma 3's sliding window, shorter than the prompt of the names' tests
TINY = dict(embed_dim=16, hidden_dim=32, num_heads=4, head_dim=8, num_kv_heads=2)


@pytest.fixture(autouse=True)
def standard_promotion():
    """tunix divides int32 positions by float32 timescales (RoPE): JAX's standard dtype
    promotion, where the suite's conftest makes it strict. Imported by the test modules
    that build tunix models (autouse there)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def tunix_module(family: str) -> types.ModuleType:
    """`tunix.models.<family>.model`, imported without running tunix's package
    `__init__`s (they import its trainers); the flag its import sets for Flax (no
    sharding of variables at creation) is put back for the rest of the suite, and set
    only while a model is built (`build`)."""
    if "tunix" not in sys.modules:
        spec = importlib.util.find_spec("tunix")
        assert spec is not None and spec.origin is not None
        root = pathlib.Path(spec.origin).parent
        for name, path in [("tunix", root), ("tunix.models", root / "models")]:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    name = f"tunix.models.{family}"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(pathlib.Path(sys.modules["tunix"].__path__[0]) / "models" / family)]
        sys.modules[name] = package
    flag = flax.config.flax_always_shard_variable
    try:
        return importlib.import_module(f"{name}.model")
    finally:
        flax.config.update("flax_always_shard_variable", flag)


def randomised(model: nnx.Module, seed: int) -> nnx.Module:
    """Every parameter drawn at random (tunix initialises its MLPs to zero, its norms to
    ones or zeros): values that tell every weight apart."""
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    drawn = [0.4 * jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(treedef, drawn))
    return model


def build(
    family: str, vocab: int = 32, layers: int = 2, hookable: bool = True, **config
) -> tuple[types.ModuleType, nnx.Module]:
    """(tunix's model module, the family's model) with `vocab` tokens, `layers` layers,
    the sizes `TINY` updated by `config` (Qwen 3's `num_experts=4,
    num_experts_per_tok=2`: a mixture of experts), every parameter random."""
    # tunix 0.1.7 gives its parameters `sharding=`, which Flax 0.12 deprecates, and
    # builds its models with Flax's eager sharding off (as its import sets it).
    flag = flax.config.flax_always_shard_variable
    flax.config.update("flax_always_shard_variable", False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'sharding' is deprecated", DeprecationWarning)
            tunix = tunix_module(family)
            sizes = {**TINY, **config}
            if family == "gemma3":
                sizes.setdefault("sliding_window_size", WINDOW)
                model_config = tunix.ModelConfig(
                    num_layers=layers, num_embed=vocab, param_dtype=jnp.float32, **sizes
                )
                model = tunix.Gemma3(model_config, rngs=nnx.Rngs(0))
            else:
                model_config = tunix.ModelConfig(
                    num_layers=layers, vocab_size=vocab, rope_theta=10_000, norm_eps=1e-6, **sizes
                )
                kind = tunix.Llama3 if family == "llama3" else tunix.Qwen3
                model = kind(model_config, rngs=nnx.Rngs(0))
    finally:
        flax.config.update("flax_always_shard_variable", flag)
    model = randomised(model, seed=len(family))
    return tunix, jhooks.hookable(model) if hookable else model

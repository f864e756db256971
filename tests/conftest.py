import gc

import jax
import pytest

import jhooks

jax.config.update("jax_numpy_dtype_promotion", "strict")
# Eight simulated CPU devices, so that sharded jit and shard_map run in-process
# (tests/test_modules_sharded.py). Set before any test touches a device, as Equinox's
# conftest does; everything else still runs on the default device, jax.devices()[0].
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test body both without and with `jax.jit`."""
    return jax.jit if request.param else (lambda f: f)


@pytest.fixture
def settled_hook_state():
    """For a test that counts traces: models and nodes of earlier tests that died with
    hooks still registered leave the jit key when they are collected, which retraces a
    jitted function once. Collect them now and publish the key, so that the counts see
    only the test's own registrations."""
    gc.collect()
    jhooks.register_module_forward_pre_hook(lambda module, args: None).remove()

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


@pytest.fixture
def frozen_gc():
    """For a test under `jax.checking_leaks()`, which collects garbage at the end of every
    trace: a cost in proportion to everything the process holds (over two minutes for one
    test late in the suite). What exists before the test is frozen out of collection; a
    leaked tracer is made during the test, so it is still found
    (tests/test_guided_errors.py checks that it is, with this fixture)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()

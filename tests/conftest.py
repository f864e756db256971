import gc
import os
import shutil
import tempfile

# Set before JAX starts its backend, and inherited by the processes that tests start (the
# docs build's notebook kernels, the scripts), measured in the README ("Two commands"):
# - One persistent compilation cache per test session, made by the first process (the
#   controller under pytest-xdist, whose workers inherit it) and removed when it ends:
#   tests compile the same programs over and over (a model's jitted and eager twins, op by
#   op evaluation), and an executable read back is the one XLA compiled, so no number
#   changes.
# - XLA's CPU code generation in one piece per program, not split across threads (each of
#   the two workers has a core of its own), at LLVM's optimization level 0, not 2, with
#   XLA's older elemental emitters rather than its MLIR fusion emitters: the programs'
#   operations are the same (XLA's own HLO passes do not change), their machine code less
#   optimized, which no test measures (the benchmarks run without these settings). Compiling
#   is most of the suite's time (an eager test compiles each operation on its own): a tiny
#   program compiles in 10 ms rather than 25 ms, and the clipping tests ran in 47 s rather
#   than 74 s side by side (issue 44). Float32 results round differently from level 1's in
#   a few places (1e-7 to 1e-5 of the largest value): the tolerances that compare two
#   computations say so where they needed it.
_CACHE_MADE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE_MADE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jhooks-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
for _flag in (
    "--xla_cpu_parallel_codegen_split_count=1",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # noqa: E402  (after the settings above)
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import jhooks  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # in case a plugin imported JAX first
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    if os.environ.get("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES") == "0":
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Property tests draw the same examples on every run: the test command is green every
# time or red every time (an unseeded run once drew a float32 rounding case that fails
# one run in many, then spent minutes shrinking it). A test's own @settings keeps this.
settings.register_profile("jhooks", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("jhooks")

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


@pytest.fixture(autouse=True, scope="module")
def compiled_programs_freed():
    """After each test module: its compiled programs freed (`jax.clear_caches`).

    XLA's CPU client maps each compiled program's code into memory, and a process may hold
    65,530 mappings (Linux's `vm.max_map_count`): a test worker that compiled half of the
    suite's programs reached it (LLVM's "Cannot allocate memory", then a segmentation fault
    in a later compilation). A module's programs are rarely another's; those that are come
    back from the persistent compilation cache."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def rebound_counts_cleared():
    """Each test counts its own traces for the warning on a rebound array (said once per
    function, at its second new array: `_runs/_failures.py`): otherwise another test's
    models, made by the same code (JAX's one `vmap` wrapper), count as rebound."""
    from jhooks._runs import _failures

    _failures._rebound.clear()
    yield


def pytest_unconfigure(config):
    if _CACHE_MADE is not None:
        shutil.rmtree(_CACHE_MADE, ignore_errors=True)


# Started first, so that no worker is left with it alone at the end: the strict docs build
# runs every notebook (about a fifth of the suite's time, in one test).
LONGEST_FIRST = ("tests/test_docs.py::test_mkdocs_builds_strictly",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid not in LONGEST_FIRST)

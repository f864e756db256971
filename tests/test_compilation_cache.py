"""The test workers' shared persistent compilation cache (tests/conftest.py) survives an
entry read while another worker writes it.

JAX writes a cache entry in place, so a worker can read an empty or cut entry that another
worker is writing: JAX then warns ("Error reading persistent compilation cache entry") and
compiles the program itself. Under the suite's `filterwarnings = ["error"]` that warning
once failed whichever test was compiling (pyproject.toml ignores it, with the reason).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def truncated_entry_probe(x):
    return 3.0 * x + 1.0


def the_entry():
    """The probe's entry in the cache folder."""
    folder = Path(jax.config.jax_compilation_cache_dir)
    entries = list(folder.glob("jit_truncated_entry_probe-*-cache"))
    assert len(entries) == 1, sorted(p.name for p in folder.iterdir())[:20]
    return entries[0]


def test_an_entry_read_while_another_worker_writes_it_is_compiled_again():
    probe = jax.jit(truncated_entry_probe)
    x = jnp.arange(4.0, dtype=jnp.float32)
    want = np.array([1.0, 4.0, 7.0, 10.0], np.float32)
    np.testing.assert_array_equal(probe(x), want)  # compiled, and written to the cache

    # Emptied, as a reader finds it while a writer has just opened it; the compiled program
    # dropped from memory, so that the next call reads the entry. JAX finds the entry cut,
    # says so, and compiles the program again: the same numbers.
    assert the_entry().stat().st_size > 0
    the_entry().write_bytes(b"")
    jax.clear_caches()
    with pytest.warns(UserWarning, match="Error reading persistent compilation cache entry"):
        got = jax.jit(truncated_entry_probe)(x)
    np.testing.assert_array_equal(got, want)

    # Again under the suite's own warning filters: not an error (without pyproject's
    # "ignore" for this warning, this call raises it). JAX writes no entry over one that
    # exists: the entry is still empty.
    jax.clear_caches()
    assert the_entry().stat().st_size == 0
    np.testing.assert_array_equal(jax.jit(truncated_entry_probe)(x), want)

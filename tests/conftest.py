import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test body both without and with `jax.jit`."""
    return jax.jit if request.param else (lambda f: f)

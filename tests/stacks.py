"""Two ways of applying a model's layers, shared by the operation tests: a Python loop
over a list (`Looped`, paths `layers.0`, `layers.1`...) and a `lax.scan` over the
layers stacked (`Scanned`, path `layers`, one iteration's addresses)."""

from typing import Any

import equinox as eqx
import jax


class Looped(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Scanned(eqx.Module):
    layers: Any  # stacked: every leaf with a leading axis of layers

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)
        return jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, params)[0]

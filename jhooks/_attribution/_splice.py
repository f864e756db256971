"""`jhooks.splice`: an autoencoder at a point, its features points of their own.

SAELens' `HookedSAETransformer` with `use_error_term=True`: the output of the point is
the reconstruction plus the autoencoder's error, so the model's output is unchanged,
while the features are points a run can read, patch and score.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core import check_callable
from .._runs import hook_point, run_with_hooks


@jax.tree_util.register_pytree_node_class
class Spliced:
    """`fn` with the autoencoder `sae` at the point `point` (see `jhooks.splice`).

    A pytree (`fn` and `sae` its children), so that a run's guards read it by content:
    the autoencoder's arrays are arguments of the program, not constants.
    """

    def __init__(self, fn: Callable, point: str, sae: Any, error_term: bool):
        self.fn, self.point, self.sae, self.error_term = fn, point, sae, error_term

    def tree_flatten(self) -> tuple[list, tuple]:
        return [self.fn, self.sae], (self.point, self.error_term)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: list) -> Spliced:
        return cls(children[0], aux[0], children[1], aux[1])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooks = [(self.point, self.through_sae)]
        return run_with_hooks(self.fn, *args, fwd_hooks=hooks, **kwargs)

    def through_sae(self, x: jax.Array, name: str) -> jax.Array:
        """The point's value through the autoencoder (forward hook at the point)."""
        sae = self.sae
        features = sae.encode(x)
        recon0 = sae.decode(features)
        features = hook_point(features, f"{name}.sae.features")
        recon = hook_point(sae.decode(features), f"{name}.sae.recon")
        if not self.error_term:
            return recon
        error0 = jax.lax.stop_gradient(x - recon0)
        error = hook_point(error0, f"{name}.sae.error")
        # x - ((recon0 - recon) + (error0 - error)): exactly x while nothing is patched
        # (both differences are +0.0, and x - 0.0 is x, the sign of a zero kept), with
        # the gradient of recon (so of the features) and of the error point.
        stop = jax.lax.stop_gradient
        return stop(x) - ((stop(recon0) - recon) + (stop(error0) - error))


def splice(fn: Callable, point: str, sae: Any, *, error_term: bool = True) -> Spliced:
    """`fn` with a sparse autoencoder at the point `point`, its features points.

    SAELens' `HookedSAETransformer.add_sae(sae, use_error_term=...)`, for any function
    with [`jhooks.hook_point`][]s.

    **Arguments:**

    - `fn`: the function (a model).
    - `point`: the point whose value goes through the autoencoder (a point name, or a
        hookable module's path).
    - `sae`: any object with `encode(x) -> features` and `decode(features) -> x`
        (an Equinox module, say), called on the point's value as it is.
    - `error_term`: add the autoencoder's error `x - decode(encode(x))` back, so the
        output is the unspliced function's, bit for bit (SAELens' `use_error_term`). The
        error is a constant of the backward pass (no gradient flows from it to `x`), as
        in SAELens. `False`: the point's value is replaced by the reconstruction.

    **Returns:**

    A function called as `fn` is. In a run, the points `point + ".sae.features"`,
    `point + ".sae.recon"` (the decoder's output) and, with the error term,
    `point + ".sae.error"` are reached after `point`: [`jhooks.run_with_cache`][],
    [`jhooks.run_with_hooks`][] and [`jhooks.attribution`][] select them as any point
    (patching the features changes the output).

    **Example:**

    ```python
    spliced = jhooks.splice(model, "blocks.0.hook_resid_post", sae)
    scores = jhooks.attribution(metric, spliced, clean, corrupt,
                                nodes="blocks.0.hook_resid_post.sae.features")
    ```
    """
    check_callable(fn, "the function passed to jhooks.splice")
    if not isinstance(point, str):
        raise TypeError(f"splice: point must be a point name (a str), got {point!r}.")
    for method in ("encode", "decode"):
        if not callable(getattr(sae, method, None)):
            raise TypeError(
                f"splice: the autoencoder must have an `{method}` method (SAELens' "
                f"`encode(x)` and `decode(features)`); {type(sae).__qualname__} has none."
            )
    return Spliced(fn, point, sae, bool(error_term))

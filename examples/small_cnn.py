"""The small CNN that the demo and the training notebooks share.

One convolution, a ReLU and a linear layer, on one single-channel image: small enough to
train in seconds on a CPU. The ReLU is a module, as `torch.nn.ReLU` is, so that it can hold
hooks. Its PyTorch twin, with the same weights, is in `small_cnn_torch.py`.
"""

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray


class ReLU(eqx.Module):
    """`jax.nn.relu` as a module (PyTorch: `torch.nn.ReLU`), so that it can be hooked."""

    def __call__(self, x: Array) -> Array:
        return jax.nn.relu(x)


class SmallCNN(eqx.Module):
    """`fc(act(conv(image)))` for one `(1, image_size, image_size)` image."""

    conv: eqx.nn.Conv2d
    act: ReLU
    fc: eqx.nn.Linear

    def __init__(
        self, key: PRNGKeyArray, *, image_size: int = 8, channels: int = 4, classes: int = 4
    ):
        conv_key, fc_key = jax.random.split(key)
        feature_size = image_size - 2  # a 3x3 convolution without padding
        self.conv = eqx.nn.Conv2d(1, channels, kernel_size=3, key=conv_key)
        self.act = ReLU()
        self.fc = eqx.nn.Linear(channels * feature_size**2, classes, key=fc_key)

    def __call__(self, image: Float[Array, "1 size size"]) -> Float[Array, " classes"]:
        return self.fc(self.act(self.conv(image)).reshape(-1))

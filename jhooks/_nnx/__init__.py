"""Flax NNX models get every module hook: `hookable`, the `register_*` functions,
points named by NNX paths, runs and `clipped_grad`, through NNX's transforms.

Importing this package registers Flax NNX with `jhooks._modules` (`_framework.py`)
and imports no Flax. See README.md beside this file."""

from ._framework import NNX as NNX

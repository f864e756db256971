"""Per-example gradients: `clipped_grad` (ghost norms read off the loss's jaxpr).

Re-exports only; see README.md beside this file."""

from ._clipping import clipped_grad as clipped_grad

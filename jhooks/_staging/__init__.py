"""The jaxpr interpreter and the marks it reaps: points and retained gradients inside
`lax.scan`, `cond`, nested `jit` and `checkpoint`.

Re-exports only; see README.md beside this file."""

from ._harvest import Harvester as Harvester
from ._harvest import Point as Point
from ._marks import PointLayout as PointLayout
from ._marks import bind_point as bind_point
from ._marks import loop_index_p as loop_index_p

"""The jaxpr interpreter and the marks it reaps: points and retained gradients inside
`lax.scan`, `cond`, nested `jit` and `checkpoint`.

Re-exports only; see README.md beside this file."""

from ._addresses import Found as Found
from ._addresses import Operation as Operation
from ._addresses import calls_model as calls_model
from ._addresses import find_operations as find_operations
from ._addresses import module_scope as module_scope
from ._addresses import operation_of as operation_of
from ._addresses import vmapped_call_scope as vmapped_call_scope
from ._harvest import Harvester as Harvester
from ._harvest import Point as Point
from ._marks import PointLayout as PointLayout
from ._marks import bind_point as bind_point
from ._marks import loop_index_p as loop_index_p
from ._rewrite import AtOperations as AtOperations
from ._traced import Traced as Traced

"""The mechanism: the hook primitive, the fence around JAX and Equinox internals, emit,
the checks of what hooks return, handles and the jit key, closure keys, host callbacks.

Re-exports only; see README.md beside this file."""

from ._checks import check_callable as check_callable
from ._checks import check_grads as check_grads
from ._checks import check_like as check_like
from ._checks import describe as describe
from ._checks import hook_name as hook_name
from ._closures import RUN as RUN
from ._closures import Walk as Walk
from ._closures import static_key as static_key
from ._context import ThreadStack as ThreadStack
from ._emit import Emitted as Emitted
from ._emit import call_hook as call_hook
from ._emit import collecting as collecting
from ._emit import emit as emit
from ._equinox_compat import dynamic_field_names as dynamic_field_names
from ._equinox_compat import field_values as field_values
from ._equinox_compat import is_equinox_class as is_equinox_class
from ._equinox_compat import new_module as new_module
from ._equinox_compat import set_field as set_field
from ._equinox_compat import unwrap_jit as unwrap_jit
from ._handles import Hooks as Hooks
from ._handles import RemovableHandle as RemovableHandle
from ._handles import add_hook as add_hook
from ._handles import jit_key as jit_key
from ._handles import program_key as program_key
from ._handles import retaining_key as retaining_key
from ._handles import staged_key as staged_key
from ._host import host as host
from ._jax_compat import ClosedJaxpr as ClosedJaxpr
from ._jax_compat import Literal as Literal
from ._jax_compat import Primitive as Primitive
from ._jax_compat import ShapedArray as ShapedArray
from ._jax_compat import ad as ad
from ._jax_compat import batching as batching
from ._jax_compat import current_trace as current_trace
from ._jax_compat import hide_frames_of as hide_frames_of
from ._jax_compat import is_tracer as is_tracer
from ._jax_compat import jaxprs_in_params as jaxprs_in_params
from ._jax_compat import mlir as mlir
from ._jax_compat import parent_of as parent_of
from ._jax_compat import reaches as reaches
from ._jax_compat import traced_for as traced_for
from ._plans import install as install
from ._plans import restore as restore
from ._plans import sites_in as sites_in
from ._primitive import BackwardRule as BackwardRule
from ._primitive import Batched as Batched
from ._primitive import axes as axes
from ._primitive import bind as bind
from ._primitive import hook_p as hook_p
from ._primitive import per_example as per_example
from ._static import number_key as number_key
from ._static import static as static

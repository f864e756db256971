"""Named points and runs: `hook_point`, `run_with_hooks`, `run_with_cache`, one compiled
program per run structure, points inside loops.

Re-exports only; see README.md beside this file."""

from ._activations import stack_activation as stack_activation
from ._active import names_read as names_read
from ._active import names_unkeyed as names_unkeyed
from ._generate import Generation as Generation
from ._generate import generate as generate
from ._loops import loop_index as loop_index
from ._module_runs import outermost_call as outermost_call
from ._operations import Operation as Operation
from ._operations import ops as ops
from ._points import hook_point as hook_point
from ._points import input_point as input_point
from ._points import named_point as named_point
from ._points import run_with_cache as run_with_cache
from ._points import run_with_hooks as run_with_hooks
from ._scopes import HookName as HookName
from ._scopes import current_scope as current_scope
from ._scopes import point_scope as point_scope
from ._scopes import register_interceptor as register_interceptor
from ._select import Selector as Selector
from ._select import did_you_mean as did_you_mean
from ._users_vmap import hookable_call as hookable_call

"""jhooks: PyTorch's hooks for JAX and Equinox."""

import os as _os
from importlib.metadata import version as _distribution_version

from ._activations import stack_activation as stack_activation
from ._clipping import clipped_grad as clipped_grad
from ._closures import static as static
from ._emit import emit as emit
from ._globals import (
    register_module_forward_hook as register_module_forward_hook,
)
from ._globals import (
    register_module_forward_pre_hook as register_module_forward_pre_hook,
)
from ._globals import (
    register_module_full_backward_hook as register_module_full_backward_hook,
)
from ._globals import (
    register_module_full_backward_pre_hook as register_module_full_backward_pre_hook,
)
from ._grad import grad as grad
from ._grad import value_and_grad as value_and_grad
from ._handles import RemovableHandle as RemovableHandle
from ._hookable import Module as Module
from ._hookable import hookable as hookable
from ._host import host as host
from ._jax_compat import hide_frames_of as _hide_frames_of
from ._loops import loop_index as loop_index
from ._module_hooks import register_forward_hook as register_forward_hook
from ._module_hooks import register_forward_pre_hook as register_forward_pre_hook
from ._module_hooks import register_full_backward_hook as register_full_backward_hook
from ._module_hooks import register_full_backward_pre_hook as register_full_backward_pre_hook
from ._module_hooks import register_parameter_hook as register_parameter_hook
from ._module_registry import module_path as module_path
from ._names import named_modules as named_modules
from ._names import named_parameters as named_parameters
from ._nodes import Node as Node
from ._points import (
    hook_point as hook_point,
)
from ._points import (
    run_with_cache as run_with_cache,
)
from ._points import (
    run_with_hooks as run_with_hooks,
)
from ._runs import HookName as HookName
from ._select import register_module_hooks as register_module_hooks
from ._types import BackwardHook as BackwardHook
from ._types import BackwardPreHook as BackwardPreHook
from ._types import ForwardHook as ForwardHook
from ._types import ForwardHookWithKwargs as ForwardHookWithKwargs
from ._types import ForwardPreHook as ForwardPreHook
from ._types import ForwardPreHookWithKwargs as ForwardPreHookWithKwargs
from ._types import ParameterHook as ParameterHook
from ._values import (
    register_hook as register_hook,
)
from ._values import (
    register_multi_grad_hook as register_multi_grad_hook,
)
from ._values import (
    retain_grad as retain_grad,
)

__version__ = _distribution_version("jhooks")

# Opt-in only: importing jhooks changes no class of Equinox or JAX (see `_hookable.py`).
if _os.environ.get("JHOOKS_EXPLAIN_MISSING_HOOKS", "") not in ("", "0"):
    from ._hookable import explain_missing_hooks as _explain_missing_hooks

    _explain_missing_hooks()

# As JAX and Equinox do: jhooks' own frames are left out of the tracebacks JAX filters,
# so an error points at the user's hook or call.
_hide_frames_of(_os.path.dirname(__file__))

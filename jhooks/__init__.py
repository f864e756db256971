"""jhooks: PyTorch's hooks for JAX and Equinox."""

import os as _os

from jax._src import traceback_util as _traceback_util

from ._clipping import clipped_grad as clipped_grad
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
from ._host import host as host
from ._modules import Module as Module
from ._modules import hookable as hookable
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
from ._select import register_module_hooks as register_module_hooks
from ._values import (
    register_hook as register_hook,
)
from ._values import (
    register_multi_grad_hook as register_multi_grad_hook,
)
from ._values import (
    retain_grad as retain_grad,
)

__version__ = "0.1.0"

# As JAX and Equinox do: jhooks' own frames are left out of the tracebacks JAX filters,
# so an error points at the user's hook or call.
_traceback_util.register_exclusion(_os.path.dirname(__file__))

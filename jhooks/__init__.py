"""jhooks: PyTorch's hooks for JAX and Equinox."""

import os as _os

from ._attribution import attribution as attribution
from ._attribution import splice as splice
from ._autograd import Node as Node
from ._autograd import filter_grad as filter_grad
from ._autograd import filter_value_and_grad as filter_value_and_grad
from ._autograd import grad as grad
from ._autograd import (
    register_hook as register_hook,
)
from ._autograd import (
    register_multi_grad_hook as register_multi_grad_hook,
)
from ._autograd import (
    retain_grad as retain_grad,
)
from ._autograd import value_and_grad as value_and_grad
from ._core import RemovableHandle as RemovableHandle
from ._core import emit as emit
from ._core import hide_frames_of as _hide_frames_of
from ._core import host as host
from ._core import static as static
from ._linen_haiku import LINEN_REFUSAL as _LINEN_REFUSAL  # noqa: F401  (registers Linen, Haiku)
from ._modules import BackwardHook as BackwardHook
from ._modules import BackwardPreHook as BackwardPreHook
from ._modules import ForwardHook as ForwardHook
from ._modules import ForwardHookWithKwargs as ForwardHookWithKwargs
from ._modules import ForwardPreHook as ForwardPreHook
from ._modules import ForwardPreHookWithKwargs as ForwardPreHookWithKwargs
from ._modules import Module as Module
from ._modules import ParameterHook as ParameterHook
from ._modules import hookable as hookable
from ._modules import module_path as module_path
from ._modules import named_modules as named_modules
from ._modules import named_parameters as named_parameters
from ._modules import register_forward_hook as register_forward_hook
from ._modules import register_forward_pre_hook as register_forward_pre_hook
from ._modules import register_full_backward_hook as register_full_backward_hook
from ._modules import register_full_backward_pre_hook as register_full_backward_pre_hook
from ._modules import (
    register_module_forward_hook as register_module_forward_hook,
)
from ._modules import (
    register_module_forward_pre_hook as register_module_forward_pre_hook,
)
from ._modules import (
    register_module_full_backward_hook as register_module_full_backward_hook,
)
from ._modules import (
    register_module_full_backward_pre_hook as register_module_full_backward_pre_hook,
)
from ._modules import register_module_hooks as register_module_hooks
from ._modules import register_parameter_hook as register_parameter_hook
from ._names import Name as Name
from ._names import NameMap as NameMap
from ._names import transformer_lens_names as transformer_lens_names
from ._nnx import NNX as _NNX  # noqa: F401  (registers Flax NNX; imports no Flax)
from ._per_example import clipped_grad as clipped_grad
from ._runs import Generation as Generation
from ._runs import HookName as HookName
from ._runs import Operation as Operation
from ._runs import generate as generate
from ._runs import (
    hook_point as hook_point,
)
from ._runs import loop_index as loop_index
from ._runs import ops as ops
from ._runs import (
    run_with_cache as run_with_cache,
)
from ._runs import (
    run_with_hooks as run_with_hooks,
)
from ._runs import stack_activation as stack_activation

# The release, as pyproject.toml and CHANGELOG.md give it (tests/test_version.py checks the
# three agree); written here rather than read from the installed metadata, which an editable
# install leaves at the version it was installed with.
__version__ = "0.5.0"

# Importing jhooks changes no class of Equinox or JAX: the explanation of a missing
# `register_*` method is installed by the first `hookable` call (see `_modules/_hookable.py`).

# As JAX and Equinox do: jhooks' own frames are left out of the tracebacks JAX filters,
# so an error points at the user's hook or call.
_hide_frames_of(_os.path.dirname(__file__))

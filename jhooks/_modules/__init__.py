"""Module hooks: registries, the `register_*` functions, global hooks, the call pipeline,
`hookable`, names and selection, hook types.

Re-exports only; see README.md beside this file."""

from ._explain import explain_missing_hooks as explain_missing_hooks
from ._frameworks import Framework as Framework
from ._frameworks import framework_of as framework_of
from ._frameworks import refusal_of as refusal_of
from ._frameworks import register_framework as register_framework
from ._frameworks import register_refusal as register_refusal
from ._globals import register_module_forward_hook as register_module_forward_hook
from ._globals import register_module_forward_pre_hook as register_module_forward_pre_hook
from ._globals import register_module_full_backward_hook as register_module_full_backward_hook
from ._globals import (
    register_module_full_backward_pre_hook as register_module_full_backward_pre_hook,
)
from ._hookable import ClassCache as ClassCache
from ._hookable import Module as Module
from ._hookable import hookable as hookable
from ._hookable import hookable_subclass as hookable_subclass
from ._hookable import unpickle as unpickle
from ._names import named_modules as named_modules
from ._names import named_parameters as named_parameters
from ._register import register_forward_hook as register_forward_hook
from ._register import register_forward_pre_hook as register_forward_pre_hook
from ._register import register_full_backward_hook as register_full_backward_hook
from ._register import register_full_backward_pre_hook as register_full_backward_pre_hook
from ._register import register_parameter_hook as register_parameter_hook
from ._registry import Registry as Registry
from ._registry import adopt as adopt
from ._registry import claimed_elsewhere as claimed_elsewhere
from ._registry import module_path as module_path
from ._registry import registry_or_none as registry_or_none
from ._select import register_module_hooks as register_module_hooks
from ._types import BackwardHook as BackwardHook
from ._types import BackwardPreHook as BackwardPreHook
from ._types import ForwardHook as ForwardHook
from ._types import ForwardHookWithKwargs as ForwardHookWithKwargs
from ._types import ForwardPreHook as ForwardPreHook
from ._types import ForwardPreHookWithKwargs as ForwardPreHookWithKwargs
from ._types import ParameterHook as ParameterHook

"""Hooks on values and calls: `register_hook`, `retain_grad`, multi-grad hooks,
`jhooks.Node`, PyTorch's `BackwardHook`, and `jhooks.grad`.

Re-exports only; see README.md beside this file."""

from ._backward_hooks import call_with_backward_hooks as call_with_backward_hooks
from ._filter_grad import filter_grad as filter_grad
from ._filter_grad import filter_value_and_grad as filter_value_and_grad
from ._grad import grad as grad
from ._grad import value_and_grad as value_and_grad
from ._nodes import Node as Node
from ._values import register_hook as register_hook
from ._values import register_multi_grad_hook as register_multi_grad_hook
from ._values import retain_grad as retain_grad

"""The hooks the benchmarks install, in both frameworks, and how they are installed.

Three hook sets, each in two flavours (value hooks on every layer's output, and
module hooks on every module):

- `identity`: hooks that return `None` (forward and full backward hooks on modules);
- `clip`: backward hooks that clip gradients to [-CLIP, CLIP];
- `host`: one hook per step that logs the norm of the gradient of the model's output
  on the host (`jhooks.host` in JAX, `.item()` in PyTorch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

import jhooks

CLIP = 0.01
LOG: list[float] = []  # what the host hooks record


def _record(norm: Any) -> None:
    LOG.append(float(norm))


_record_on_host = jhooks.host(_record)

# --------------------------------------------------------------------------- JAX


def identity_grad(grad: jax.Array) -> None:
    return None


def clip_grad(grad: jax.Array) -> jax.Array:
    return jnp.clip(grad, -CLIP, CLIP)


def log_grad_norm(grad: jax.Array) -> None:
    _record_on_host(jnp.linalg.norm(grad))


def forward_identity(module: Any, args: tuple, output: Any) -> None:
    return None


def backward_identity(module: Any, grad_input: tuple, grad_output: tuple) -> None:
    return None


def backward_clip(module: Any, grad_input: tuple, grad_output: tuple) -> tuple:
    return tuple(None if g is None else jnp.clip(g, -CLIP, CLIP) for g in grad_input)


def backward_log(module: Any, grad_input: tuple, grad_output: tuple) -> None:
    _record_on_host(jnp.linalg.norm(grad_output[0]))


def value_tap(hooks: str) -> Callable | None:
    """The `tap` that puts value hooks on every layer output (`None`: none there)."""
    if hooks == "identity":
        return lambda h: jhooks.register_hook(h, identity_grad)
    if hooks == "clip":
        return lambda h: jhooks.register_hook(h, clip_grad)
    return None


def install_module_hooks(net: Any, hooks: str) -> list:
    """Registers the hook set `hooks` on a `jhooks.hookable` model; returns the handles."""
    modules = [m for _, m in jhooks.named_modules(net)]  # type: ignore[attr-defined]
    handles = []
    if hooks == "identity":
        for m in modules:
            handles.append(m.register_forward_hook(forward_identity))
            handles.append(m.register_full_backward_hook(backward_identity))
    elif hooks == "clip":
        for m in modules:
            handles.append(m.register_full_backward_hook(backward_clip))
    elif hooks == "host":
        handles.append(net.register_full_backward_hook(backward_log))
    elif hooks != "idle":
        raise ValueError(hooks)
    return handles


# --------------------------------------------------------------------------- PyTorch


def torch_identity_grad(grad: torch.Tensor) -> None:
    return None


def torch_clip_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.clamp(-CLIP, CLIP)


def torch_log_grad_norm(grad: torch.Tensor) -> None:
    LOG.append(grad.norm().item())


def torch_forward_identity(module: Any, args: tuple, output: Any) -> None:
    return None


def torch_backward_identity(module: Any, grad_input: tuple, grad_output: tuple) -> None:
    return None


def torch_backward_clip(module: Any, grad_input: tuple, grad_output: tuple) -> tuple:
    return tuple(None if g is None else g.clamp(-CLIP, CLIP) for g in grad_input)


def torch_backward_log(module: Any, grad_input: tuple, grad_output: tuple) -> None:
    LOG.append(grad_output[0].norm().item())


def _torch_hooked(h: torch.Tensor, fn: Callable) -> torch.Tensor:
    h.register_hook(fn)
    return h


def torch_value_tap(hooks: str) -> Callable | None:
    if hooks == "identity":
        return lambda h: _torch_hooked(h, torch_identity_grad)
    if hooks == "clip":
        return lambda h: _torch_hooked(h, torch_clip_grad)
    return None


def install_torch_module_hooks(net: torch.nn.Module, hooks: str) -> list:
    handles = []
    if hooks == "identity":
        for m in net.modules():
            handles.append(m.register_forward_hook(torch_forward_identity))
            handles.append(m.register_full_backward_hook(torch_backward_identity))
    elif hooks == "clip":
        for m in net.modules():
            handles.append(m.register_full_backward_hook(torch_backward_clip))
    elif hooks == "host":
        handles.append(net.register_full_backward_hook(torch_backward_log))
    elif hooks != "idle":
        raise ValueError(hooks)
    return handles

"""What every benchmark shares: learning rate, hook sets, PyTorch threads, variant names."""

from __future__ import annotations

import torch

import jhooks

HAS_MODULE_HOOKS = hasattr(jhooks, "hookable") and hasattr(jhooks, "named_modules")
LR = 1e-2
HOOK_SETS = ("identity", "clip", "host")
TORCH_THREADS = torch.get_num_threads()  # PyTorch's default
# PyTorch eager is timed with its default threads and with one thread (`torch1`):
# on a small shared machine its default can be the slower of the two by far.
TORCH_KINDS = {"torch": TORCH_THREADS, "torch1": 1}


def variant_names() -> list[tuple[str, str, str]]:
    """`(name, flavor, hooks)` of every jhooks variant."""
    out = [("plain", "plain", "none")]
    out += [(f"value:{h}", "value", h) for h in HOOK_SETS]
    if HAS_MODULE_HOOKS:
        out += [("module:idle", "module", "idle")]
        out += [(f"module:{h}", "module", h) for h in HOOK_SETS]
    return out

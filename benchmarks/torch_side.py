"""The PyTorch side of a benchmark: eager and `torch.compile` steps with the same hooks."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from . import hooks as H
from .models import Case, copy_weights
from .settings import LR


def torch_variant(case: Case, flavor: str, hooks: str, source: Any) -> tuple[Any, Callable, list]:
    """`(model, forward, handles)`: a PyTorch copy of `source` with the variant's hooks."""
    model = case.torch_model()
    copy_weights(source, model)
    handles: list = []
    if flavor == "plain":
        return model, model, handles
    if flavor == "value":
        if hooks == "host":

            def forward(x: torch.Tensor) -> torch.Tensor:
                out = model(x)
                out.register_hook(H.torch_log_grad_norm)
                return out

            return model, forward, handles
        tap = H.torch_value_tap(hooks)
        return model, lambda x: model(x, tap), handles
    handles = H.install_torch_module_hooks(model, hooks)
    return model, model, handles


def torch_step(case: Case, model: Any, forward: Callable, x: Any, y: Any) -> Callable:
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = case.torch_loss(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


def torch_compiled(
    case: Case, flavor: str, hooks: str, source: Any, x: Any, y: Any, limit: int
) -> tuple[dict[str, Any], Callable | None]:
    """Tries `torch.compile` on the variant: `(report, step or None)`.

    The report says whether it compiled within `limit` seconds, how many graph breaks
    Dynamo took, and whether its gradients equal those of PyTorch eager with the same
    hooks (so the hooks ran as they do in eager mode).
    """
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)  # as it is timed
    breaks_before = sum(counters["graph_break"].values())
    model, _, _ = torch_variant(case, flavor, hooks, source)
    eager, eager_forward, _ = torch_variant(case, flavor, hooks, source)
    compiled = torch.compile(model)
    forward: Callable
    if flavor == "value":
        tap = H.torch_value_tap(hooks)
        forward = lambda x: compiled(x, tap)  # noqa: E731
    else:
        forward = compiled
    report: dict[str, Any] = {}
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    start = time.perf_counter()
    try:
        case.torch_loss(forward(x), y).backward()
        report["compile_s"] = time.perf_counter() - start
        report["status"] = "compiled"
    except _Timeout:
        report["status"] = f"timed out after {limit} s"
    except Exception as e:  # noqa: BLE001 - any failure is a finding to report
        report["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    report["graph_breaks"] = sum(counters["graph_break"].values()) - breaks_before
    if report["status"] != "compiled":
        return report, None
    case.torch_loss(eager_forward(x), y).backward()
    report["grads_match_eager"] = all(
        torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
        for a, b in zip(model.parameters(), eager.parameters())
    )
    return report, torch_step(case, model, forward, x, y)

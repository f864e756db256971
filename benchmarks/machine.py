"""The machine and the versions a benchmark ran on, recorded with its results."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import jax
import torch

from .settings import HAS_MODULE_HOOKS


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "gpu": jax.default_backend() == "gpu",
        "torch_threads": torch.get_num_threads(),
        "load_average_start": list(os.getloadavg()),
        "jhooks_commit": commit,
        "versions": {
            name: version(name)
            for name in ("jhooks", "jax", "jaxlib", "equinox", "optax", "torch", "numpy")
        },
        "module_hooks_available": HAS_MODULE_HOOKS,
    }

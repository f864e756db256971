"""Processes that run together and wait for each other (`jax.distributed` peers).

Used by the scaling benchmark's two-process runs and by tests/test_multiprocess.py.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path


def free_port() -> int:
    """A TCP port free on this machine now (the coordinator's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_together(
    commands: list[list[str]],
    logs: list[tuple[Path | None, Path]],
    env: dict[str, str],
    timeout_s: float,
    cwd: Path | None = None,
) -> list[int]:
    """Runs `commands` side by side; their return codes (negative: killed).

    Each writes its stdout and stderr to the files of `logs` (no pipe to fill; a stdout
    of `None` is discarded). As soon as one fails, or at the deadline, the others are
    killed: they would otherwise wait for their peer. Before the kill, each still running
    gets SIGUSR1: a command that registered it with `faulthandler` (the test's workers do)
    writes where each of its threads stands to its stderr, so that a hang says where it is.
    """
    procs = []
    try:
        for command, (out, err) in zip(commands, logs, strict=True):
            with ExitStack() as files:
                stderr = files.enter_context(open(err, "w"))
                stdout = subprocess.DEVNULL if out is None else files.enter_context(open(out, "w"))
                procs.append(
                    subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
                )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
    finally:
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.send_signal(signal.SIGUSR1)
        if running:
            time.sleep(2)  # time to write the tracebacks
        for p in running:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=10)
    return [p.returncode for p in procs]

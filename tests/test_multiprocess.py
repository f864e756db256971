"""Two processes joined by `jax.distributed` compute what one process computes.

Starts tests/data/multiprocess_worker.py twice on the CPU, each with two host devices,
joined with the gloo CPU collectives into a 4-device data mesh with the batch split over
both processes: three DP-SGD steps (`jhooks.clipped_grad` + SGD) and a `jhooks.run_with_cache`
of a hookable model. The parameters, per-example norms, logits and cached activations each
process gathers must equal the same computation on one device in this process.
"""

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jhooks

WORKER = Path(__file__).parent / "data" / "multiprocess_worker.py"
TIMEOUT_S = 50  # for both processes together; the test must finish in under 60 s


def load_worker():
    spec = importlib.util.spec_from_file_location("multiprocess_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_two_processes(folder):
    """Runs both workers; returns (return codes, stdouts, stderrs).

    Output goes to files (no pipe to fill). As soon as one worker fails, or at the
    deadline, the other is killed: it would otherwise wait for its peer.
    """
    env = dict(os.environ)
    # Two host devices per process; the workers get no persistent compilation cache of the
    # test session (two processes writing one cache at once gains nothing here).
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=2"])
    for name in list(env):
        if name.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_NUM_CPU")):
            del env[name]
    port = free_port()
    logs = [(folder / f"stdout{i}.txt", folder / f"stderr{i}.txt") for i in range(2)]
    procs = []
    try:
        for i, (out, err) in enumerate(logs):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(port), str(i), str(folder)],
                        stdout=stdout,
                        stderr=stderr,
                        env=env,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=10)
    return (
        [p.returncode for p in procs],
        [out.read_text() for out, _ in logs],
        [err.read_text() for _, err in logs],
    )


def run_with_retry(folder):
    """`run_two_processes`, again on a new port if another program took the one chosen."""
    result = run_two_processes(folder)
    if result[0] != [0, 0] and any("in use" in err for err in result[2]):
        result = run_two_processes(folder)
    return result


def test_two_processes_match_one(tmp_path):
    codes, stdouts, stderrs = run_with_retry(tmp_path)
    report = "\n".join(
        f"--- process {i}: return code {codes[i]}\n{stdouts[i]}\n{stderrs[i][-4000:]}"
        for i in range(2)
    )
    assert codes == [0, 0], f"the workers failed (a negative code: killed):\n{report}"

    worker = load_worker()
    with jax.default_device(jax.devices("cpu")[0]):
        model, xs, ys = worker.init()
        trained, all_norms = worker.train(model, xs, ys)
        logits, cache = worker.cached(model, xs)
    expected = {f"param_{name}": p for name, p in jhooks.named_parameters(trained)}
    expected |= {f"norms_{step}": n for step, n in enumerate(all_norms)}
    expected["logits"] = logits
    expected |= {f"cache_{name}": v for name, v in cache.items()}
    assert {"cache_fc1", "cache_fc2"} <= set(expected)
    # The steps changed the parameters, and clipping was active on some examples.
    assert not np.allclose(trained.fc1.weight, model.fc1.weight)
    assert np.any(np.asarray(all_norms[0]) > worker.MAX_NORM)

    for i in range(2):
        written = {p.stem for p in (tmp_path / f"p{i}").glob("*.npy")}
        assert written == set(expected), f"process {i} wrote {sorted(written)}\n{report}"
        for name, want in expected.items():
            got = np.load(tmp_path / f"p{i}" / f"{name}.npy")
            np.testing.assert_allclose(
                got, np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=f"process {i}: {name}"
            )

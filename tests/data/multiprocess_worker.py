"""One of the two processes of tests/test_multiprocess.py, and the computation both check.

Run as `python multiprocess_worker.py PORT PROCESS_ID FOLDER` with
`XLA_FLAGS=--xla_force_host_platform_device_count=2`: it joins the other process through
`jax.distributed` (gloo CPU collectives), builds a 4-device data mesh over both processes'
devices, runs `STEPS` data-parallel DP-SGD steps (`jhooks.clipped_grad` and SGD) and a
`jhooks.run_with_cache` with the batch sharded over the 4 devices, then the tensor-parallel
checks of `multiprocess_heads.py` (an attention model whose heads are split over the same 4
devices), and writes what it gathered to FOLDER/p{PROCESS_ID}/*.npy (and tp.json). The test
imports both files and computes the same on one device.
"""

import os
import sys

import equinox as eqx
import jax
import numpy as np

import jhooks

BATCH, FEATURES, HIDDEN, CLASSES = 8, 6, 16, 3
STEPS = 3
MAX_NORM = 0.5
LR = 0.1


class Net(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(FEATURES, HIDDEN, key=k1)
        self.fc2 = eqx.nn.Linear(HIDDEN, CLASSES, key=k2)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def init():
    """(model, xs, ys) with NumPy leaves, the same in every process."""
    model = jhooks.hookable(Net(jax.random.key(0)))
    model = jax.tree.map(lambda a: np.asarray(a) if eqx.is_array(a) else a, model)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    ys = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    return model, xs, ys


def example_loss(model, x, y):
    return -jax.nn.log_softmax(model(x))[y]


@eqx.filter_jit
def dp_step(model, xs, ys):
    """One DP-SGD step without noise: clipped sum over the batch, then SGD on its mean."""
    grads, norms = jhooks.clipped_grad(example_loss, max_norm=MAX_NORM)(model, xs, ys)
    model = eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g / BATCH, grads))
    return model, norms


@eqx.filter_jit
def cached(model, xs):
    return jhooks.run_with_cache(lambda m, x: jax.vmap(m)(x), model, xs)


def train(model, xs, ys):
    """`STEPS` steps; returns the final model and every step's norms, stacked."""
    all_norms = []
    for _ in range(STEPS):
        # One step in flight at a time: a program with collectives launched many times
        # without waiting hung on 2 CPU devices (benchmarks/scaling_step.py: XLA's
        # rendezvous timed out, one device's part never arrived); waiting avoids it.
        model, norms = jax.block_until_ready(dp_step(model, xs, ys))
        all_norms.append(norms)
    return model, all_norms


def main(port, process_id, folder):
    import faulthandler
    import signal
    import time

    # The launcher sends SIGUSR1 before it kills a worker that is still running (a hang):
    # every thread's Python traceback goes to stderr, which the test's report shows.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    start = time.monotonic()

    def log(what):  # the test shows this output when a worker fails or is killed
        print(f"{time.monotonic() - start:6.1f} s: {what}", flush=True)

    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"localhost:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=40,
    )
    assert jax.process_count() == 2 and jax.local_device_count() == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    assert mesh.devices.size == 4

    def place(a, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    model, xs, ys = init()
    model = jax.tree.map(lambda a: place(a, P()) if eqx.is_array(a) else a, model)
    xs, ys = place(xs, P("data")), place(ys, P("data"))
    assert not xs.is_fully_addressable  # the batch really is split over both processes

    def gathered(a):  # a batch-sharded output, gathered onto every process
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    def replicated(a):
        assert a.sharding.is_fully_replicated, a.sharding
        return np.asarray(a.addressable_data(0))

    out = os.path.join(folder, f"p{process_id}")
    os.makedirs(out, exist_ok=True)
    log("joined")
    trained, all_norms = train(model, xs, ys)
    for name, param in jhooks.named_parameters(trained):
        np.save(os.path.join(out, f"param_{name}.npy"), replicated(param))
    for step, norms in enumerate(all_norms):
        np.save(os.path.join(out, f"norms_{step}.npy"), gathered(norms))
    log("trained")
    logits, cache = cached(model, xs)
    np.save(os.path.join(out, "logits.npy"), gathered(logits))
    for name, value in cache.items():
        np.save(os.path.join(out, f"cache_{name}.npy"), gathered(value))
    import multiprocess_heads  # beside this file: tensor parallel over a `heads` mesh

    log("cached")
    multiprocess_heads.run_sharded(out, log)
    multihost_utils.sync_global_devices("written")
    jax.distributed.shutdown()
    log(f"process {process_id} done")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    # Everything is written and the runtime shut down: leave without the interpreter's
    # final garbage collection, where a process once hung after "done" (its traceback
    # at the deadline: "Garbage-collecting", no Python frame; issue 44).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

# nbconvert's configuration for the docs build (see ../hooks.py): kernels on IPC sockets
# in a temporary directory, so that no kernel listens on TCP without encryption.
import os
import tempfile

c = get_config()  # noqa: F821 (provided by traitlets when it loads this file)
c.KernelManager.transport = "ipc"
c.KernelManager.ip = os.path.join(tempfile.mkdtemp(prefix="jhooks-docs-kernels-"), "kernel")

"""Seeing device-to-host synchronisation on a machine without a GPU.

Every way of reading a tensor's value into Python, ``.item()``, ``float(t)``,
``int(t)``, ``bool(t)`` and so a Python ``if`` on a tensor, dispatches to
``aten._local_scalar_dense``. On a GPU each such read waits for the device queue to
drain; on the CPU it is cheap but goes through the same operator, so counting it on a
laptop shows what would synchronise on a GPU.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READ", "HostReadCounter"]

#: The operator behind every read of a tensor value into Python.
HOST_READ = torch.ops.aten._local_scalar_dense.default


class HostReadCounter(TorchDispatchMode):
    """Count the reads of tensor values on the host while active.

    Example::

        with HostReadCounter() as reads:
            gradlab.grad_ignore_norm_(model.parameters(), 1.0)
        assert reads.count == 0
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is HOST_READ:
            self.count += 1
        return func(*args, **(kwargs or {}))

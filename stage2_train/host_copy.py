"""Reading a device tensor back later without waiting for work queued after it.

`HostCopy(tensor)` starts the tensor's copy to pinned host memory behind the kernels already
queued, and records an event; `read()` waits for that event only. The training loop reads a
step's metrics (and, with several ranks, the stop agreement) this way once the next step is
queued, so the host never idles while the GPU finishes a step (run.read_metrics_late).
On the CPU the tensor is already where it is read.
"""

from __future__ import annotations

import torch


class HostCopy:
    """A tensor's value, copied to the host behind the kernels queued so far."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.done: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.tensor = pinned.copy_(tensor, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.tensor = tensor

    def read(self) -> torch.Tensor:
        """The host tensor, once its copy is done."""
        if self.done is not None:
            self.done.synchronize()
        return self.tensor

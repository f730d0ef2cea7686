"""The next step's micro-batches move to the GPU while the current step computes.

A step that ends by reading its metrics back (a host sync: several GPUs, or
`run.read_metrics_late=false`) would start the copy of the next batch (~94 MB of features per
step at the pystd shape) and the loader hand-off only after the GPU has gone idle, and the GPU
would wait for them at the top of every step. Instead, `StepRunner.queue` calls `fetch` once
the step's kernels are queued and before any sync: the
loader is asked for the next batches then, and their copy is issued on a side stream that
runs beside the step's kernels. `take` hands them to the next step after making the compute
stream wait for that copy.

Nothing changes in what is read or in which order: `fetch` pulls exactly the batches the next
`take` would have pulled, an exception raised while pulling (a damaged sequence under
`data.on_damaged=error`, a follow-mode timeout) is raised by that next `take`, where it used to
surface. The loop's one iterator runs across epoch ends (plan.py's PlanSampler), so the step
that ends an epoch fetches the next epoch's first batches; the last step of the run fetches
nothing. On the CPU the batches are pulled early and not moved (the step moves them, as before).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from stage2_train.data import Batch, batch_tensors


class DevicePrefetcher:
    """One step of micro-batches held ahead, already on (or on their way to) the device."""

    def __init__(self, device: torch.device, micro_batches: int) -> None:
        self.device = device
        self.micro_batches = micro_batches
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: list[Batch] | None = None
        self.copied: torch.cuda.Event | None = None
        self.error: BaseException | None = None

    def take(self, batches: Iterator[Batch]) -> list[Batch]:
        """The next step's micro-batches: the fetched ones, else pulled now (on the host)."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.ready is None:
            return [next(batches) for _ in range(self.micro_batches)]
        ready, self.ready = self.ready, None
        if self.stream is not None and self.copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self.copied)
            for batch in ready:  # allocated on the side stream, used and freed on this one
                for tensor in batch_tensors(batch):
                    tensor.record_stream(compute)
        return ready

    def fetch(self, batches: Iterator[Batch]) -> None:
        """Pull the next step's micro-batches and start their copy to the device."""
        pulled = []
        try:
            for _ in range(self.micro_batches):
                pulled.append(next(batches))
        except StopIteration:
            if pulled:  # the iterator ended inside a step
                self.error = RuntimeError(
                    f"the data loader ended after {len(pulled)} of a step's "
                    f"{self.micro_batches} micro-batches: the epoch plan and the loader disagree "
                    "(a bug; please report it with the run's config)"
                )
            return
        except Exception as err:  # raised by the next `take`, where the loop expects it
            self.error = err
            return
        if self.stream is None:
            self.ready = pulled
            return
        # the side stream waits for nothing: its copies read pinned host memory (the host
        # allocator keeps it until they finish) into its own allocations
        with torch.cuda.stream(self.stream):
            self.ready = [batch.to(self.device) for batch in pulled]
            self.copied = torch.cuda.Event()
            self.copied.record(self.stream)

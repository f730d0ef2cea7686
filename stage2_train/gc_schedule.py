"""Python's garbage collector on the training loop's schedule instead of allocation counts.

Why: CPython runs a full (generation 2) collection whenever enough objects have survived, at
moments nobody picks. A training process holds ~10^5-10^6 Python objects (modules, loader
state, torch.compile's artifacts), and one full pass over them takes ~0.2 s (up to 246 ms on
this project's CPU machine for a pystd run's ~420k objects, BENCHMARKS.md): a stall of the host
that, in a host-bound step, the GPU waits out; with several ranks, the rank that collects makes
the others wait at the next collective. As torchtitan does (its `gc_freq`), automatic collection is off
inside the loop; generations 0 and 1 are collected every `run.gc_every` steps on every rank at
once, and everything after each evaluation. Reference counting still frees every object that
is not in a cycle. Leaving the loop (finished, stopped or failed) turns automatic collection
back on.
"""

from __future__ import annotations

import gc
import time
from types import TracebackType


class ScheduledGC:
    """`with ScheduledGC(every):` around the loop; `after_step(step)` once per step."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.was_enabled = gc.isenabled()

    def __enter__(self) -> ScheduledGC:
        if self.every:
            gc.collect()  # start from a clean heap: what setup left in cycles goes now
            gc.disable()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.every and self.was_enabled:
            gc.enable()

    def after_step(self, step: int, evaluated: bool = False) -> float | None:
        """Collect when `step` is due (a full collection after an evaluation, which builds
        and drops many objects); the seconds it took, or None when nothing ran."""
        if not self.every or not (evaluated or step % self.every == 0):
            return None
        started = time.perf_counter()
        gc.collect() if evaluated else gc.collect(1)
        return round(time.perf_counter() - started, 4)

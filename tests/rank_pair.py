"""Two spawned processes, ranks 0 and 1, kept for the test session and handed jobs in turn.

The tests that run a function of theirs as two gloo ranks in processes of their own (each rank
in a process group it makes and leaves, its outcome put on a queue) paid for a fresh pair each:
two interpreters importing torch, transformers and the stages (~6 s of CPU each, ~6-8 s of wall
time a pair on two cores) before the first line of the job ran. One pair serves them all now;
each job runs as it did, in the os.environ and working directory of the test that hands it over
(read when the job starts: what a fresh pair inherited), and puts its (rank, outcome) pairs on
the queue it is handed. Jobs whose rank ends its own process (os._exit) need processes of their
own (`test_review_rank0_sections._run_ranks(..., own_processes=True)`).

A pair that fails a job (no answer in time, an error out of the job, a rank gone) is killed and
not reused: the next job starts a fresh one, so no job sees what a failed one left behind.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # registers its exit handler now: ours, registered after, runs first
import os
import queue
from typing import Any

_CONTEXT = multiprocessing.get_context("spawn")


def _serve(rank: int, jobs: Any, seen: Any) -> None:
    """A rank's loop: each job `(target, args, environ, cwd)` runs as
    `target(rank, *args, seen)`; None ends it. An error out of a job ends the process (its
    traceback on stderr), as it ended a fresh pair's."""
    while (job := jobs.get()) is not None:
        target, args, environ, cwd = job
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        target(rank, *args, seen)


class _Pair:
    def __init__(self) -> None:
        self.seen = _CONTEXT.Queue()
        self.jobs = [_CONTEXT.Queue() for _ in range(2)]
        # not daemonic: a rank may start processes of its own (extract's writer processes)
        self.ranks = [
            _CONTEXT.Process(target=_serve, args=(rank, self.jobs[rank], self.seen))
            for rank in range(2)
        ]
        for process in self.ranks:
            process.start()

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.ranks)

    def close(self, kill: bool = False) -> None:
        for jobs, process in zip(self.jobs, self.ranks, strict=True):
            if not kill and process.is_alive():
                jobs.put(None)
        for process in self.ranks:
            process.join(timeout=0 if kill else 10)
            if process.is_alive():  # a safety net only
                process.kill()
                process.join(timeout=10)


_pair: _Pair | None = None


def _close_pair() -> None:
    global _pair
    if _pair is not None:
        _pair.close()
        _pair = None


# before multiprocessing's own exit handler (atexit runs the last registered first), which would
# wait for the two ranks forever while they wait for a job
atexit.register(_close_pair)


def run_in_pair(target: Any, *args: Any, reports: int = 2, timeout: float = 120) -> dict[int, Any]:
    """`target(rank, *args, seen)` on ranks 0 and 1 of the session's pair (started if there is
    none, or a rank of it is gone); the (rank, outcome) pairs that `reports` of them put on
    `seen`, each waited for up to `timeout` seconds."""
    global _pair
    if _pair is not None and not _pair.alive():
        _pair.close(kill=True)
        _pair = None
    if _pair is None:
        _pair = _Pair()
    pair = _pair
    job = (target, args, dict(os.environ), os.getcwd())
    for jobs in pair.jobs:
        jobs.put(job)
    try:
        return dict(pair.seen.get(timeout=timeout) for _ in range(reports))
    except queue.Empty:
        pair.close(kill=True)  # a rank stuck in this job would stall the next one
        _pair = None
        raise

"""Running one request through an embedded engine's scheduler (clawrl/engine/scheduler.py)
on the test's own thread: submit it, wait until it has finished."""

from __future__ import annotations

import threading

from clawrl.engine.scheduler import Scheduler, Sequence


def run_to_end(scheduler: Scheduler, seq: Sequence, timeout_s: float) -> Sequence:
    """Submit `seq` and wait (at most `timeout_s`) for it to finish; returns it."""
    done = threading.Event()
    seq.notify = lambda: done.set() if seq.finish is not None else None
    scheduler.submit(seq)
    assert done.wait(timeout=timeout_s)
    return seq

"""Signals for the commands that run child processes (`clawrl up`, `clawrl eval`, `clawrl judge
evaluate`): SIGTERM stops them as Ctrl-C does, so their `finally` blocks stop the children,
and a child started with `die_with_parent` is never orphaned, even by kill -9 of its parent.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within: SIGTERM raises KeyboardInterrupt (in the main thread); restored after."""
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def die_with_parent() -> None:
    """`preexec_fn` for a child: SIGTERM when its parent dies (Linux), never orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

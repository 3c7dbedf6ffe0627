"""clawrl/base/signals.py: a command that runs children stops them on SIGTERM (its `finally` runs),
and a child started with `die_with_parent` goes when its parent is killed with -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

# A parent that starts a sleeping child with die_with_parent (optionally), prints its pid, and
# stops it in `finally` under sigterm_as_interrupt (optionally).
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from clawrl.base.signals import die_with_parent, sigterm_as_interrupt
    guard, preexec = sys.argv[1] == "1", sys.argv[2] == "1"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             stdout=subprocess.DEVNULL,
                             preexec_fn=die_with_parent if preexec else None)
    print(child.pid, flush=True)
    def run():
        try:
            time.sleep(120)
        finally:
            child.terminate(); child.wait()
            print("stopped", flush=True)
    if guard:
        try:
            with sigterm_as_interrupt():
                run()
        except KeyboardInterrupt:
            sys.exit(130)
    else:
        run()
""")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _start(guard: bool, preexec: bool) -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(int(guard)), str(int(preexec))],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


@pytest.mark.parametrize("guard", [True, False])
def test_sigterm_runs_finally_only_under_the_guard(guard: bool) -> None:
    parent, child = _start(guard, preexec=False)
    try:
        time.sleep(0.3)
        parent.send_signal(signal.SIGTERM)
        out, _ = parent.communicate(timeout=30)
        if guard:  # the child was stopped by the parent's own finally
            assert parent.returncode == 130 and "stopped" in out
            assert _gone(child)
        else:  # the default action: no finally, the child is orphaned (what the guard fixes)
            assert parent.returncode == -signal.SIGTERM and "stopped" not in out
            assert not _gone(child, within_s=1.0)
    finally:
        if not _gone(child, within_s=0):
            os.kill(child, signal.SIGKILL)
        parent.stdout.close()  # type: ignore[union-attr]


def test_a_child_goes_with_its_parent_killed_by_sigkill() -> None:
    parent, child = _start(guard=True, preexec=True)
    time.sleep(0.3)
    parent.kill()
    parent.wait(timeout=30)
    parent.stdout.close()  # type: ignore[union-attr]
    assert _gone(child), "the child outlived its parent's kill -9"

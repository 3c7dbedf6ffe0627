"""Child processes a test starts and owns: a free port, and a server child (the embedded
engine, SGLang's serving code) that is waited for and stopped (only it) at teardown."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from clawrl.cli.ports import free_port

__all__ = ["ChildServer", "free_port"]


class ChildServer:
    """`argv` started on a free port (`{port}` in argv is replaced), logging to `log_path`;
    ready when GET `ready_path` answers 200."""

    def __init__(self, name: str, argv: list[str], log_path: Path, *, ready_path: str,
                 env: dict[str, str] | None = None, poll_s: float = 0.2) -> None:
        self.name, self.ready_path, self.poll_s = name, ready_path, poll_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [a.replace("{port}", str(self.port)) for a in argv],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        raise RuntimeError(f"{self.name} not ready after {timeout_s}s:\n"
                           f"{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()

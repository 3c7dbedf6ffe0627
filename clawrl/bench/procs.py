"""The processes a bench (or a test that needs real processes) runs: the stand-in engine
(clawrl/bench/fake_engine.py) and the real proxy (`clawrl proxy`), each its own process, so
they can be measured apart and killed (`kill -9`) and restarted like in production.

    with BenchProcs(db_url, state_dir) as procs:
        procs.configure(reply_s=0.2, slots=8)
        procs.proxy_url  # http://127.0.0.1:<port>
        procs.kill_proxy(); procs.start_proxy()
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from clawrl.cli.ports import HOST, free_port


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


class BenchProcs:
    """A stand-in engine and a proxy on free ports, logging to `<state_dir>/bench.log`;
    `env` adds to (and overrides) the proxy's environment."""

    def __init__(self, db_url: str, state_dir: Path, env: dict[str, str] | None = None) -> None:
        self.state_dir = state_dir
        self.up_port, self.proxy_port = free_port(), free_port()
        self.env = {**os.environ, "CLAWRL_DATABASE__URL": db_url,
                    "CLAWRL_STATE_DIR": str(state_dir),
                    "CLAWRL_ENGINE__URL": f"http://{HOST}:{self.up_port}",
                    "CLAWRL_PROXY__RATE_LIMIT_RPM": "0", **(env or {})}
        self._log: IO[bytes] = (state_dir / "bench.log").open("ab")
        self.upstream: subprocess.Popen[bytes] | None = None
        self.proxy: subprocess.Popen[bytes] | None = None

    @property
    def upstream_url(self) -> str:
        return f"http://{HOST}:{self.up_port}"

    @property
    def proxy_url(self) -> str:
        return f"http://{HOST}:{self.proxy_port}"

    def __enter__(self) -> BenchProcs:
        try:
            self.upstream = subprocess.Popen(
                [sys.executable, "-m", "clawrl.bench.fake_engine", "--port", str(self.up_port)],
                env=self.env, stdout=self._log, stderr=self._log)
            wait_ready(f"{self.upstream_url}/health", self.upstream)
            self.start_proxy()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def configure(self, **config: float | str) -> None:
        """The stand-in's reply time, slots and tool command (clawrl/bench/fake_engine.py)."""
        httpx.post(f"{self.upstream_url}/bench/config", json=config).raise_for_status()

    def start_proxy(self, **env: str) -> None:
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "clawrl.cli.main", "proxy", "--host", HOST, "--port",
             str(self.proxy_port), "--log-level", "warning"],
            env={**self.env, **env}, stdout=self._log, stderr=self._log)
        wait_ready(f"{self.proxy_url}/readyz", self.proxy)

    def kill_proxy(self, sig: int = signal.SIGKILL, timeout_s: float = 90.0) -> int:
        """Signal the proxy and wait for it to end; returns its exit code."""
        assert self.proxy is not None
        self.proxy.send_signal(sig)
        code = self.proxy.wait(timeout_s)
        self.proxy = None
        return code

    def close(self) -> None:
        for proc in (self.proxy, self.upstream):
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in (self.proxy, self.upstream):
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.proxy = self.upstream = None
        self._log.close()


class TcpRelay:
    """A TCP forwarder to a real server (Postgres) that a bench or test cuts, an outage, and
    restores by starting it again (same port). `unix_socket`: forward to that socket instead
    (an embedded Postgres listens on one)."""

    def __init__(self, host: str, port: int, unix_socket: str | None = None) -> None:
        self.target = (host, port)
        self.unix_socket = unix_socket
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Refuse new connections and cut every open one."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.unix_socket is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self.unix_socket)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))

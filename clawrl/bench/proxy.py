"""`clawrl bench proxy`: what the proxy adds over calling the engine directly.

    clawrl bench proxy [--clients 1,32,256] [--single 300] [--per-client 4]
                       [--durability group|sync] [--json FILE]

Starts a stand-in engine (clawrl/bench/fake_engine.py) and the real proxy (`clawrl proxy`,
its own uvicorn process, logging every turn to a real Postgres: a scratch database on
CLAWRL_DATABASE__URL's server, else an embedded one under /tmp), then drives both with
closed-loop clients. Each client alternates direct and proxied requests, so the two paths
are measured side by side under the same load. At 1 client the stand-in
answers at once (per-request cost); at more clients replies take `--reply-s` (2 s),
streamed one token per `--chunk-ms` (10 ms), as an engine would. Reported per level and
mode: p50/p99 latency of each path and their difference (the overhead), time to first
chunk when streaming, the proxy's CPU ms per request, errors; then the proxy's peak RSS
and turns lost (responses served minus rows in Postgres after the writer drains).
Targets on a 2-core machine: overhead p50 <= 2 ms and p99 <= 10 ms at 32 clients,
0 turns lost, RSS <= 200 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import psycopg
from sqlalchemy.engine import make_url

from clawrl.base.db import create_async, libpq_url
from clawrl.base.dbcli import start_embedded, stop_embedded, upgrade
from clawrl.bench.client import Connection
from clawrl.bench.procs import wait_ready
from clawrl.cli.ports import free_port
from proxy import admin

HOST = "127.0.0.1"
T = TypeVar("T")


@dataclass
class Sample:
    path: str  # "direct" or "proxy"
    latency_ms: float
    first_chunk_ms: float | None
    ok: bool
    error: str | None = None  # e.g. "HTTP 502" or "ReadError"


@dataclass
class Row:
    clients: int
    mode: str
    per_path: int
    direct_p50: float
    proxy_p50: float
    direct_p99: float
    proxy_p99: float
    ttfc_overhead_p50: float | None
    proxy_cpu_ms: float
    engine_cpu_ms: float  # the stand-in's CPU per request: a yardstick for the machine
    errors: int
    error_kinds: str = ""

    @property
    def overhead_p50(self) -> float:
        return self.proxy_p50 - self.direct_p50

    @property
    def overhead_p99(self) -> float:
        return self.proxy_p99 - self.direct_p99


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when installed (as uvicorn runs the proxy), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def machine_line(extra: str = "") -> str:
    """The closing line of a benchmark's report: the machine's CPUs and its load now."""
    load = os.getloadavg()
    return (f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / "
            f"{load[2]:.1f} (1/5/15 min) at the end{extra}")


async def one_request(conn: Connection, stream: bool, path: str) -> Sample:
    body: dict[str, Any] = {"model": "bench", "max_tokens": 256, "stream": stream,
                            "messages": [{"role": "user", "content": f"bench {uuid.uuid4()}"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    first: float | None = None
    error: str | None = None
    try:
        reply = await asyncio.wait_for(conn.post(payload, keep=256 if stream else 0), 300)
        first = reply.first_chunk_at if stream else None
        if reply.status != 200:
            error = f"HTTP {reply.status}"
        elif not stream and b'"choices"' not in reply.body:
            error = "no choices"
        elif stream and (b'"error"' in reply.body or b"[DONE]" not in reply.body):
            error = "stream error event"
    except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError) as exc:
        error = type(exc).__name__
    end = time.perf_counter()
    return Sample(path, (end - start) * 1e3, None if first is None else (first - start) * 1e3,
                  error is None, error)


async def run_phase(targets: dict[str, tuple[str, dict[str, str]]], clients: int,
                    per_client: int, stream: bool, spread_s: float = 0.0) -> list[Sample]:
    """`clients` closed-loop workers, each alternating direct/proxy `per_client` times
    over its own keep-alive connection to each. Worker i starts `i * spread_s / clients`
    late: with fixed-length replies, workers started together would stay in lockstep and
    every request would queue behind the whole burst (real users do not synchronise)."""
    async def worker(i: int) -> list[Sample]:
        order = ["direct", "proxy"] if i % 2 == 0 else ["proxy", "direct"]
        conns = {path: Connection(*targets[path]) for path in order}
        out = []
        await asyncio.sleep(i * spread_s / clients)
        try:
            for _ in range(per_client):
                for path in order:
                    out.append(await one_request(conns[path], stream, path))
        finally:
            for conn in conns.values():
                await conn.close()
        return out

    results = await asyncio.gather(*(worker(i) for i in range(clients)))
    return [s for r in results for s in r]


class RssSampler:
    """Peak resident memory of a process, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@contextmanager
def bench_database(state_dir: Path) -> Iterator[str]:
    """A scratch database on CLAWRL_DATABASE__URL's server, or an embedded Postgres."""
    url = os.environ.get("CLAWRL_DATABASE__URL")
    if not url:
        db_url = start_embedded(state_dir)
        try:
            yield db_url
        finally:
            stop_embedded(state_dir)
        return
    name = f"clawrl_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def make_key(db_url: str, *, log_opt_out: bool = False,
                   scopes: Sequence[str] = ()) -> str:
    """The bench user's key, unlimited; `scopes` e.g. ["verifier"] to post outcomes."""
    db = create_async(db_url)
    try:
        await admin.ensure_user(db, "bench")
        if log_opt_out:
            await admin.set_opt_out(db, "bench", logging=True)
        # One key stands in for every simulated client: no per-key limits.
        return (await admin.create_key(db, "bench", name="bench", rate_limit_rpm=0,
                                       max_concurrent=0, scopes=scopes)).secret
    finally:
        await db.dispose()


def count_turns(db_url: str) -> int:
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute("SELECT count(*) FROM turns").fetchone()
    return int(row[0]) if row else 0


def summarize(clients: int, mode: str, samples: list[Sample], cpu_s: float,
              engine_cpu_s: float) -> Row:
    by = {p: [s for s in samples if s.path == p and s.ok] for p in ("direct", "proxy")}
    lat = {p: [s.latency_ms for s in v] for p, v in by.items()}
    ttfc = {p: [s.first_chunk_ms for s in v if s.first_chunk_ms is not None]
            for p, v in by.items()}
    n_proxy = sum(1 for s in samples if s.path == "proxy")
    ttfc_overhead = (pct(ttfc["proxy"], 0.5) - pct(ttfc["direct"], 0.5)
                     if mode == "stream" else None)
    return Row(clients, mode, n_proxy, pct(lat["direct"], 0.5), pct(lat["proxy"], 0.5),
               pct(lat["direct"], 0.99), pct(lat["proxy"], 0.99), ttfc_overhead,
               cpu_s * 1e3 / max(1, n_proxy), engine_cpu_s * 1e3 / max(1, len(samples)),
               sum(1 for s in samples if not s.ok),
               ", ".join(f"{p} {e}: {n}" for (p, e), n in sorted(Counter(
                   (s.path, s.error) for s in samples if s.error).items())))


def print_rows(rows: list[Row]) -> None:
    head = (f"{'clients':>7} {'mode':<10} {'n/path':>6} {'direct p50':>10} {'proxy p50':>9} "
            f"{'+p50':>7} {'direct p99':>10} {'proxy p99':>9} {'+p99':>7} {'+TTFC p50':>9} "
            f"{'CPU ms/req':>10} {'engine CPU':>10} {'errors':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ttfc = "" if r.ttfc_overhead_p50 is None else f"{r.ttfc_overhead_p50:.2f}"
        print(f"{r.clients:>7} {r.mode:<10} {r.per_path:>6} {r.direct_p50:>10.2f} "
              f"{r.proxy_p50:>9.2f} {r.overhead_p50:>7.2f} {r.direct_p99:>10.2f} "
              f"{r.proxy_p99:>9.2f} {r.overhead_p99:>7.2f} {ttfc:>9} {r.proxy_cpu_ms:>10.2f} "
              f"{r.engine_cpu_ms:>10.2f} {r.errors:>6}")
    print("(milliseconds; +p50/+p99/+TTFC = proxy minus direct, measured side by side; CPU ms/req"
          " = proxy process CPU per proxied request; engine CPU = the stand-in's per request)")
    for r in rows:
        if r.error_kinds:
            print(f"errors at {r.clients} clients, {r.mode}: {r.error_kinds}")


def bench(args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    with bench_database(state_dir) as db_url:
        upgrade(db_url)
        key = asyncio.run(make_key(db_url, log_opt_out=args.no_logging))
        up_port, proxy_port = free_port(), free_port()
        env = {**os.environ, "CLAWRL_DATABASE__URL": db_url, "CLAWRL_STATE_DIR": str(state_dir),
               "CLAWRL_ENGINE__URL": f"http://{HOST}:{up_port}",
               "CLAWRL_PROXY__RATE_LIMIT_RPM": "0",
               "CLAWRL_PROXY__DURABILITY": args.durability}
        log = (state_dir / "bench.log").open("ab")
        procs = [subprocess.Popen([sys.executable, "-m", "clawrl.bench.fake_engine", "--port",
                                   str(up_port)], env=env, stdout=log, stderr=log),
                 subprocess.Popen([sys.executable, "-m", "clawrl.cli.main", "proxy", "--host", HOST,
                                   "--port", str(proxy_port), "--log-level", "warning"],
                                  env=env, stdout=log, stderr=log)]
        try:
            if args.priority:  # ahead of the neighbours, all three processes alike
                for pid in (os.getpid(), procs[0].pid, procs[1].pid):
                    os.setpriority(os.PRIO_PROCESS, pid, -args.priority)
            wait_ready(f"http://{HOST}:{up_port}/health", procs[0])
            wait_ready(f"http://{HOST}:{proxy_port}/readyz", procs[1])
            return measure(args, db_url, key, up_port, proxy_port, procs[1].pid,
                           procs[0].pid)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
            log.close()


def measure(args: argparse.Namespace, db_url: str, key: str, up_port: int, proxy_port: int,
            proxy_pid: int, engine_pid: int) -> dict[str, Any]:
    chat = "/v1/chat/completions"
    targets = {"direct": (f"http://{HOST}:{up_port}{chat}", {}),
               "proxy": (f"http://{HOST}:{proxy_port}{chat}", {"Authorization": f"Bearer {key}"})}
    proxy_proc, engine_proc = psutil.Process(proxy_pid), psutil.Process(engine_pid)
    rss = RssSampler(proxy_pid)
    profiler = None
    if args.profile:  # sampled stacks of the proxy (py-spy: `pip install py-spy`)
        profiler = subprocess.Popen(["py-spy", "record", "-p", str(proxy_pid), "-r", "250",
                                     "-f", "raw", "-o", str(args.profile)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows: list[Row] = []
    served = 0

    def configure(tokens: int, reply_s: float) -> None:
        httpx.post(f"http://{HOST}:{up_port}/bench/config",
                   json={"tokens": tokens, "reply_s": reply_s}).raise_for_status()

    def phase(clients: int, per_client: int, stream: bool, spread_s: float = 0.0
              ) -> list[Sample]:
        return run_loop(run_phase(targets, clients, per_client, stream, spread_s))

    configure(16, 0.0)
    for stream in (False, True):  # warm-up: connections, caches, the JIT-less first calls
        served += sum(s.ok and s.path == "proxy"
                      for s in phase(4, max(1, min(10, args.single // 4)), stream))
    for clients in args.clients:
        if clients == 1:
            configure(16, 0.0)
            per_client = args.single
        else:
            configure(max(1, round(args.reply_s * 1000 / args.chunk_ms)), args.reply_s)
            # Above 32 clients, keep the total per level as at 32 (at least 1 each).
            per_client = (args.per_client if clients <= 32
                          else max(1, round(args.per_client * 32 / clients)))
        for mode in args.modes:
            cpu0 = sum(proxy_proc.cpu_times()[:2])
            engine0 = sum(engine_proc.cpu_times()[:2])
            spread = args.reply_s if clients > 1 else 0.0
            samples = phase(clients, per_client, mode == "stream", spread)
            cpu_s = sum(proxy_proc.cpu_times()[:2]) - cpu0
            engine_s = sum(engine_proc.cpu_times()[:2]) - engine0
            served += sum(s.ok and s.path == "proxy" for s in samples)
            rows.append(summarize(clients, mode, samples, cpu_s, engine_s))
            print(f"  done: {clients} clients, {mode}", file=sys.stderr, flush=True)
    # Drain: the writer logs turns in the background; wait until the count settles.
    rows_in_db, settled_at = count_turns(db_url), time.monotonic()
    while (not args.no_logging and time.monotonic() - settled_at < 5.0
           and rows_in_db < served):
        now_rows = count_turns(db_url)
        if now_rows != rows_in_db:
            rows_in_db, settled_at = now_rows, time.monotonic()
        time.sleep(0.5)
    peak = rss.stop()
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(30)
    print_rows(rows)
    lost = 0 if args.no_logging else max(0, served - rows_in_db)
    print(f"durability {args.durability}; proxy peak RSS {peak / 2**20:.0f} MB; responses "
          f"served {served}, rows in Postgres {rows_in_db}, turns lost {lost}")
    print(machine_line(f"; bench processes at nice {-args.priority}"))
    return {"rows": [asdict(r) | {"overhead_p50": r.overhead_p50,
                                  "overhead_p99": r.overhead_p99} for r in rows],
            "rss_mb": peak / 2**20, "served": served, "rows_in_db": rows_in_db, "lost": lost,
            "loadavg": list(os.getloadavg())}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl bench proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,32,256", help="comma-separated client counts")
    p.add_argument("--modes", default="nonstream,stream", help="nonstream and/or stream")
    p.add_argument("--single", type=int, default=300, help="requests per path at 1 client")
    p.add_argument("--per-client", type=int, default=4,
                   help="requests per path per client (above 32 clients scaled down to "
                        "keep the total as at 32)")
    p.add_argument("--reply-s", type=float, default=2.0, help="engine reply time (> 1 client)")
    p.add_argument("--chunk-ms", type=float, default=10.0, help="ms between streamed tokens")
    p.add_argument("--no-logging", action="store_true",
                   help="bench user opted out of logging: shows what the turn log costs")
    p.add_argument("--priority", type=int, default=0, metavar="N",
                   help="run the bench, stand-in and proxy at nice -N (root): on a shared "
                        "machine, measures the software rather than the neighbours")
    p.add_argument("--durability", choices=("group", "sync"), default="group",
                   help="the proxy's durability (sync: a reply's last byte waits for its "
                        "turn's commit or journal fsync); run both to see what sync costs")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--profile", type=Path,
                   help="record the proxy with py-spy into this file (collapsed stacks)")
    args = p.parse_args(argv)
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
        args.modes = [m.strip() for m in args.modes.split(",")]
        assert all(c > 0 for c in args.clients) and set(args.modes) <= {"nonstream", "stream"}
    except (ValueError, AssertionError):
        p.error("--clients takes positive integers, --modes nonstream and/or stream")
    state_dir = Path(tempfile.mkdtemp(prefix="clawrl-bench-", dir="/tmp"))
    try:
        result = bench(args, state_dir)
    except PermissionError:
        print("clawrl bench proxy: --priority needs root (or CAP_SYS_NICE)", file=sys.stderr)
        return 1
    except (RuntimeError, OSError, psycopg.Error) as exc:
        print(f"clawrl bench proxy: {exc}; logs in {state_dir}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    shutil.rmtree(state_dir, ignore_errors=True)
    return 0 if result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

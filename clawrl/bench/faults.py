"""`clawrl bench faults`: what survives a crash, an outage or a shutdown under load.

    clawrl bench faults [--clients 32] [--outage-s 30] [--scenarios kill,outage,sigterm]

Runs the real proxy (`clawrl proxy`, its own process) in front of the stand-in engine
(clawrl/bench/fake_engine.py: replies take `--reply-s`, streamed a token at a time) with a
real Postgres (a scratch database on CLAWRL_DATABASE__URL's server, else an embedded one),
and `--clients` closed-loop clients, streaming and not. A reply counts as served when the
client has read all of it (the body; `[DONE]` of a stream) with its turn id. Scenarios:

- kill: `kill -9` of the proxy under load, for each durability ("group", the default, and
  "sync"); the proxy is started again (it replays its journal) and the served turns are
  looked up: lost = served but not stored; with "group" the lost ones are at most the
  turns of the last ~100 ms before the kill (printed: the oldest lost, in ms before it);
- outage: Postgres cut off for `--outage-s` under load (a TCP relay between proxy and
  Postgres, cut and restored): turns lost, requests failed, and the time from the restore
  until every served turn is in Postgres (the journal drained);
- sigterm: SIGTERM of the proxy under load (a graceful stop, as `clawrl up` does on
  Ctrl-C): turns lost (target 0), requests refused (target 0: proxy/drain.py).

On a whole real stack (engine on the tiny world model, proxy, judge worker, trainer;
clawrl/bench/faults_stack.py), with clients holding conversations:

- judge, train, engine: `kill -9` of that process under load, started again after
  `--down-s`: judge jobs lost, samples trained twice, requests failed (and whether they were
  in flight at the kill);
- up: SIGTERM of a whole `clawrl up` under load: turns lost (target 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from clawrl.base.db import libpq_url
from clawrl.base.dbcli import upgrade
from clawrl.bench.client import Connection
from clawrl.bench.faults_stack import (
    StackRow,
    print_stack_rows,
    scenario_kill_stack,
    scenario_sigterm_up,
)
from clawrl.bench.procs import BenchProcs, TcpRelay
from clawrl.bench.proxy import bench_database, make_key, run_loop

CHAT = "/v1/chat/completions"


@dataclass
class Load:
    """What the clients saw: turn ids of replies read in full (with when), failures."""

    served: dict[str, float] = field(default_factory=dict)  # turn id -> perf_counter()
    failed: int = 0
    refused: int = 0  # non-200 answers
    errors: Counter[str] = field(default_factory=Counter)  # what the failed ones raised
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def drive(url: str, key: str, clients: int, stream: bool, load: Load,
                keep_going: Callable[[], bool] = lambda: True) -> None:
    """Closed-loop clients until `load.stop`; a client whose request fails (the proxy is
    gone) retries after 50 ms while `keep_going()`, else ends."""
    body = {"model": "bench", "max_tokens": 64, "stream": stream,
            "messages": [{"role": "user", "content": "faults"}]}

    async def client(i: int) -> None:
        conn = Connection(url + CHAT, {"Authorization": f"Bearer {key}"})
        await asyncio.sleep(i * 0.2 / clients)  # out of lockstep
        try:
            while not load.stop.is_set():
                payload = json.dumps({**body, "messages": [
                    {"role": "user", "content": f"faults {i} {time.perf_counter()}"}]}).encode()
                try:
                    reply = await conn.post(payload, keep=64 if stream else 0)
                except ConnectionRefusedError:  # not a failed request: nobody listens
                    if not keep_going():
                        return
                    await asyncio.sleep(0.05)
                    continue
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    load.failed += 1
                    closed = str(exc) == "the server closed the connection"
                    load.errors["closed before answering" if closed
                                else type(exc).__name__] += 1
                    if not keep_going():
                        return
                    await asyncio.sleep(0.05)
                    continue
                complete = (b"[DONE]" in reply.body) if stream else (b'"choices"' in reply.body)
                if reply.status == 200 and complete and reply.turn_id:
                    load.served[reply.turn_id] = time.perf_counter()
                else:
                    load.refused += 1
                    await asyncio.sleep(0.05)
        finally:
            await conn.close()

    await asyncio.gather(*(client(i) for i in range(clients)))


def stored_uids(db_url: str) -> set[str]:
    with psycopg.connect(libpq_url(db_url)) as conn:
        return {str(r[0]) for r in conn.execute("SELECT uid FROM turns").fetchall()}


def wait_stored(db_url: str, uids: set[str], timeout_s: float) -> tuple[set[str], float]:
    """Poll until every uid is stored or `timeout_s` passes; (stored, seconds waited)."""
    start = time.monotonic()
    while True:
        have = stored_uids(db_url) & uids
        if have == uids or time.monotonic() - start > timeout_s:
            return have, time.monotonic() - start
        time.sleep(0.1)


@dataclass
class Row:
    scenario: str
    durability: str
    mode: str
    served: int
    lost: int
    failed: int
    note: str = ""
    oldest_lost_ms: float | None = None  # kill: how long before the kill it was served
    drain_s: float | None = None  # outage: restore -> every served turn stored


async def _load_then(procs: BenchProcs, key: str, clients: int, stream: bool, run_s: float,
                     fault: Callable[[], object]) -> tuple[Load, float]:
    """Drive the load for `run_s`, then apply `fault` (blocking, in a thread) while the
    clients keep trying; returns the load and when the fault began (perf_counter)."""
    load = Load()
    clients_done = asyncio.create_task(
        drive(procs.proxy_url, key, clients, stream, load, keep_going=lambda: False))
    await asyncio.sleep(run_s)
    at = time.perf_counter()
    await asyncio.to_thread(fault)
    load.stop.set()
    await clients_done
    return load, at


def scenario_kill(procs: BenchProcs, db_url: str, key: str, args: argparse.Namespace,
                  durability: str, stream: bool) -> Row:
    procs.start_proxy(CLAWRL_PROXY__DURABILITY=durability)
    load, at = run_loop(_load_then(procs, key, args.clients, stream, args.run_s,
                                   lambda: procs.kill_proxy(signal.SIGKILL)))
    procs.start_proxy(CLAWRL_PROXY__DURABILITY=durability)  # replays the journal
    served = set(load.served)
    have, _ = wait_stored(db_url, served, 15.0)
    lost = served - have
    oldest = max(((at - load.served[u]) * 1e3 for u in lost), default=None)
    last_100ms = sum(1 for t in load.served.values() if at - t <= 0.1)
    procs.kill_proxy(signal.SIGTERM)
    lost_note = "none lost" if oldest is None else f"oldest lost {oldest:.0f} ms before it"
    return Row("kill -9 proxy", durability, "stream" if stream else "nonstream", len(served),
               len(lost), load.failed,
               f"{lost_note}; {last_100ms} served in the last 100 ms before the kill",
               oldest_lost_ms=oldest)


def scenario_sigterm(procs: BenchProcs, db_url: str, key: str, args: argparse.Namespace,
                     stream: bool) -> Row:
    procs.start_proxy()
    load, _ = run_loop(_load_then(procs, key, args.clients, stream, args.run_s,
                                  lambda: procs.kill_proxy(signal.SIGTERM)))
    served = set(load.served)
    have, _ = wait_stored(db_url, served, 15.0)
    procs.start_proxy()  # whatever the stopped proxy journaled is replayed now
    have, _ = wait_stored(db_url, served, 15.0)
    procs.kill_proxy(signal.SIGTERM)
    return Row("SIGTERM proxy", "group", "stream" if stream else "nonstream", len(served),
               len(served - have), load.failed + load.refused,
               "failed: " + (", ".join(f"{k} {v}" for k, v in load.errors.items()) or "none")
               + (f", non-200 {load.refused}" if load.refused else ""))


def journal_bytes(path: Path) -> int:
    """Bytes in a journal directory's segments (0: nothing waits to be replayed)."""
    total = 0
    for segment in path.glob("*.jsonl"):
        try:
            total += segment.stat().st_size
        except FileNotFoundError:
            continue
    return total


def scenario_outage(db_url: str, state_dir: Path, key: str, args: argparse.Namespace,
                    stream: bool) -> Row:
    url = make_url(db_url)

    async def run() -> tuple[Load, float, set[str], float]:
        socket_dir = url.query.get("host")  # an embedded Postgres: its Unix socket's folder
        unix = (f"{socket_dir}/.s.PGSQL.{url.port or 5432}"
                if isinstance(socket_dir, str) and socket_dir.startswith("/") else None)
        relay = TcpRelay(url.host or "127.0.0.1", url.port or 5432, unix_socket=unix)
        await relay.start()
        relayed = (url.difference_update_query(["host"])
                   .set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False))
        (state_dir / f"outage-{int(stream)}").mkdir(exist_ok=True)
        procs = BenchProcs(relayed, state_dir / f"outage-{int(stream)}")
        await asyncio.to_thread(procs.__enter__)
        try:
            procs.configure(tokens=16, reply_s=args.reply_s)
            load = Load()
            clients = asyncio.create_task(drive(procs.proxy_url, key, args.clients, stream,
                                                load))
            await asyncio.sleep(args.run_s)
            await relay.stop()
            await asyncio.sleep(args.outage_s)
            journal = procs.state_dir / "journal"
            had_data = journal_bytes(journal)
            await relay.start()
            restored = time.perf_counter()
            # Polls files another process writes (no event to wait on).
            while journal_bytes(journal) and time.perf_counter() - restored < 60:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            drained = time.perf_counter() - restored
            await asyncio.sleep(max(0.0, args.run_s - drained))
            load.stop.set()
            await clients
            served = set(load.served)
            have, after = await asyncio.to_thread(wait_stored, db_url, served, 120.0)
            print(f"  outage: {had_data} journal bytes at the restore; every served turn "
                  f"stored {after:.1f} s after the load stopped", file=sys.stderr)
            return load, drained, served - have, after
        finally:
            await asyncio.to_thread(procs.close)
            await relay.stop()

    load, drained, lost, after = run_loop(run())
    under_load = (f"journal drained {drained:.1f} s after the restore" if drained < 60
                  else "journal not drained within 60 s under load")
    return Row(f"Postgres down {args.outage_s:g} s", "group", "stream" if stream else "nonstream",
               len(load.served), len(lost), load.failed + load.refused,
               f"{under_load}; all stored {after:.1f} s after the load stopped",
               drain_s=drained)


def print_rows(rows: list[Row]) -> None:
    head = (f"{'scenario':<20} {'durability':<10} {'mode':<10} {'served':>7} {'lost':>5} "
            f"{'failed':>6}  note")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.scenario:<20} {r.durability:<10} {r.mode:<10} {r.served:>7} {r.lost:>5} "
              f"{r.failed:>6}  {r.note}")
    print("(served: replies read in full with their turn id; lost: served but not in Postgres "
          "after restart/restore; failed: requests cut off, refused or answered non-200)")


STACK_SCENARIOS = ("judge", "train", "engine", "up")
SCENARIOS = ("kill", "outage", "sigterm", *STACK_SCENARIOS)


def bench(args: argparse.Namespace, state_dir: Path) -> list[Row | StackRow]:
    rows: list[Row] = []
    stack_rows: list[StackRow] = []
    with bench_database(state_dir) as db_url:
        upgrade(db_url)
        key = asyncio.run(make_key(db_url))
        modes = [m == "stream" for m in args.modes]
        if "kill" in args.scenarios or "sigterm" in args.scenarios:
            with BenchProcs(db_url, state_dir) as procs:
                procs.configure(tokens=16, reply_s=args.reply_s)
                procs.kill_proxy(signal.SIGTERM)
                for stream in modes:
                    if "kill" in args.scenarios:
                        for durability in ("group", "sync"):
                            rows.append(scenario_kill(procs, db_url, key, args, durability,
                                                      stream))
                            print(f"  done: {rows[-1].scenario}, {durability}", file=sys.stderr)
                    if "sigterm" in args.scenarios:
                        rows.append(scenario_sigterm(procs, db_url, key, args, stream))
                        print(f"  done: {rows[-1].scenario}", file=sys.stderr)
        if "outage" in args.scenarios:
            for stream in modes:
                rows.append(scenario_outage(db_url, state_dir, key, args, stream))
                print(f"  done: {rows[-1].scenario}", file=sys.stderr)
        for stream in modes:
            for victim in ("judge", "train", "engine"):
                if victim in args.scenarios:
                    stack_rows.append(scenario_kill_stack(db_url, state_dir, key, victim,
                                                          stream, args))
                    print(f"  done: {stack_rows[-1].scenario}", file=sys.stderr)
            if "up" in args.scenarios:
                stack_rows.append(scenario_sigterm_up(db_url, state_dir, key, stream, args))
                print(f"  done: {stack_rows[-1].scenario}", file=sys.stderr)
    if rows:
        print_rows(rows)
    if stack_rows:
        print_stack_rows(stack_rows)
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} (1 min) at the end")
    return [*rows, *stack_rows]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--modes", default="nonstream,stream", help="nonstream and/or stream")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated: {', '.join(SCENARIOS)}")
    p.add_argument("--run-s", type=float, default=3.0, help="load before (and after) a fault")
    p.add_argument("--outage-s", type=float, default=30.0, help="how long Postgres is cut off")
    p.add_argument("--reply-s", type=float, default=0.2, help="the stand-in's reply time")
    p.add_argument("--down-s", type=float, default=2.0,
                   help="judge/train/engine: how long the killed process stays down")
    p.add_argument("--lease-s", type=float, default=5.0,
                   help="judge/train/engine/up: the judge's job lease (a killed worker's "
                        "jobs come back after it)")
    p.add_argument("--settle-s", type=float, default=120.0,
                   help="judge/train/engine: longest wait for jobs and samples after the load")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",")]
    args.scenarios = {s.strip() for s in args.scenarios.split(",")}
    if not set(args.modes) <= {"nonstream", "stream"} or \
            not args.scenarios <= set(SCENARIOS) or args.clients < 1:
        p.error(f"--modes: nonstream/stream; --scenarios: {', '.join(SCENARIOS)}; "
                "--clients >= 1")
    state_dir = Path(tempfile.mkdtemp(prefix="clawrl-faults-", dir="/tmp"))
    try:
        rows = bench(args, state_dir)
    except (RuntimeError, OSError, psycopg.Error) as exc:
        print(f"clawrl bench faults: {exc}; logs in {state_dir}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

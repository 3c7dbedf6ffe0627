"""The whole-stack scenarios of `clawrl bench faults` (clawrl/bench/faults.py): kill -9 of the
judge worker, the trainer or the engine under load, and SIGTERM of a whole `clawrl up`.

Here everything is real: `clawrl engine` serving the shipped CI-sized tiny world model
(clawrl/world/prebuilt/tinyworld-ci), the proxy, a judge worker (its lease shortened to
`--lease-s`, so a killed worker's jobs come back within seconds) and the trainer (batches of 4),
each its own process (clawrl.cli.stack.Stack, as `clawrl up` runs them). The clients hold
conversations, so each reply's next message gives the judge a job and the trainer samples.
A worker is killed only once it holds work (the judge a claimed job, the trainer a step
done), and started again, as `clawrl up` does; once the load stops, the bench waits
until no job is pending and no sample is waiting, then counts:

- jobs lost: judge jobs not done (still pending, or failed) — target 0;
- judged twice: turns with more than one judgment;
- trained twice: samples counted by more than one committed training step (the steps'
  `num_samples` against the samples they marked `trained_step`) — target 0;
- failed: requests that failed, split by when they started: before the kill (in flight at it:
  the target for the engine is at most those), while the killed process was down, after.

`clawrl up` under SIGTERM: the stack is started as a user would (`clawrl up --model …`), driven,
sent SIGTERM, and every turn a client was served is looked up once it has exited (target: 0
lost; a served turn left in the proxy's fsynced journal, which the next start replays, is
counted apart, as are dead letters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from clawrl.base.db import libpq_url
from clawrl.bench.client import Connection
from clawrl.bench.proxy import run_loop
from clawrl.cli.ports import HOST, free_port
from clawrl.cli.stack import Stack, wait_healthy

CHAT = "/v1/chat/completions"
MODEL = Path(__file__).resolve().parents[2] / "clawrl" / "world" / "prebuilt" / "tinyworld-ci"
# What the simulated users say next (the judge reads it as the reply's next state).
NEXT = ["thanks! and what about her brother?", "no, that is wrong. try again",
        "too long. answer in lowercase please", "great, that helps", "where is the key?"]
TURNS_PER_CONVERSATION = 4


@dataclass
class Request:
    started: float  # perf_counter()
    ended: float
    ok: bool
    what: str = ""  # why it failed


@dataclass
class Conversations:
    """What the clients saw: every request with its outcome; served turn ids."""

    requests: list[Request] = field(default_factory=list)
    served: set[str] = field(default_factory=set)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def failed(self, start: float = 0.0, end: float = float("inf")) -> int:
        """Failed requests that started in [start, end)."""
        return sum(1 for r in self.requests if not r.ok and start <= r.started < end)

    def in_flight(self, at: float) -> int:
        return sum(1 for r in self.requests if r.started < at < r.ended)


def reply_content(body: bytes, stream: bool) -> str | None:
    """The assistant's text from a complete reply, None when it is incomplete or an error."""
    if not stream:
        try:
            return str(json.loads(body)["choices"][0]["message"]["content"] or "")
        except (ValueError, KeyError, IndexError, TypeError):
            return None
    if b"[DONE]" not in body:
        return None
    text = []
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return None
        for choice in event.get("choices", []):
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


async def converse(url: str, key: str, clients: int, stream: bool, load: Conversations,
                   max_tokens: int = 16) -> None:
    """Closed-loop clients holding conversations of TURNS_PER_CONVERSATION turns, until
    `load.stop`; a failed request ends its conversation, and the client tries again after
    0.2 s (nobody listening ends the client)."""

    async def client(i: int) -> None:
        conn = Connection(url + CHAT, {"Authorization": f"Bearer {key}"})
        await asyncio.sleep(i * 0.3 / clients)
        messages: list[dict[str, str]] = []
        n = 0
        try:
            while not load.stop.is_set():
                if len(messages) >= 2 * TURNS_PER_CONVERSATION - 1:
                    messages = []
                n += 1
                said = NEXT[n % len(NEXT)] if messages else f"hello from {i}, {n}: where is it?"
                messages.append({"role": "user", "content": said})
                body = json.dumps({"model": "default", "max_tokens": max_tokens,
                                   "stream": stream, "messages": messages}).encode()
                started = time.perf_counter()
                try:
                    reply = await conn.post(body)
                except ConnectionRefusedError:
                    return  # nobody listens any more (the stack was stopped)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    load.requests.append(Request(started, time.perf_counter(), False,
                                                 type(exc).__name__))
                    messages = []
                    await asyncio.sleep(0.2)
                    continue
                content = reply_content(reply.body, stream) if reply.status == 200 else None
                ok = content is not None and reply.turn_id is not None
                load.requests.append(Request(started, time.perf_counter(), ok,
                                             "" if ok else f"status {reply.status}"))
                if content is None or reply.turn_id is None:
                    messages = []
                    await asyncio.sleep(0.2)
                    continue
                load.served.add(reply.turn_id)
                messages.append({"role": "assistant", "content": content})
        finally:
            await conn.close()

    await asyncio.gather(*(client(i) for i in range(clients)))


def query(db_url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(db_url)) as conn:
        return [tuple(r) for r in conn.execute(sql).fetchall()]


def wait_stored(db_url: str, uids: set[str], timeout_s: float) -> set[str]:
    """The uids stored, once all are or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        have = {str(r[0]) for r in query(db_url, "SELECT uid FROM turns")} & uids
        if have == uids or time.monotonic() > deadline:
            return have
        time.sleep(0.2)


def settle(db_url: str, timeout_s: float) -> float:
    """Wait until no judge job is pending and no sample waits to be trained; seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        [(pending, ready)] = query(db_url, """
            SELECT (SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')),
                   (SELECT count(*) FROM samples
                    WHERE trained_step IS NULL AND skipped_reason IS NULL)""")
        if pending == 0 and ready == 0:
            break
        time.sleep(0.5)
    return time.monotonic() - start


@dataclass
class Ledger:
    """What Postgres holds once the stack has settled."""

    turns: int
    jobs: int
    jobs_lost: int  # not done: still pending or failed
    jobs_retried: int  # claimed again (a killed worker's lease expired, or an error)
    judged_twice: int
    samples_trained: int
    samples_skipped: int  # marked skipped by the trainer (e.g. stale: too many versions old)
    trained_twice: int  # sum of committed steps' num_samples beyond the samples they marked
    steps: int


def ledger(db_url: str) -> Ledger:
    [row] = query(db_url, """
        SELECT (SELECT count(*) FROM turns),
               (SELECT count(*) FROM jobs WHERE kind = 'judge'),
               (SELECT count(*) FROM jobs WHERE kind = 'judge' AND status <> 'done'),
               (SELECT count(*) FROM jobs WHERE kind = 'judge' AND attempts > 1),
               (SELECT count(*) FROM (SELECT turn_id FROM judgments GROUP BY turn_id
                                      HAVING count(*) > 1) t),
               (SELECT count(*) FROM samples WHERE trained_step IS NOT NULL),
               (SELECT count(*) FROM samples WHERE skipped_reason IS NOT NULL),
               (SELECT coalesce(sum(num_samples), 0) FROM training_steps
                WHERE status = 'ok'),
               (SELECT count(*) FROM training_steps)""")
    turns, jobs, lost, retried, twice, trained, skipped, counted, steps = map(int, row)
    return Ledger(turns, jobs, lost, retried, twice, trained, skipped,
                  max(0, counted - trained), steps)


def wait_at_work(db_url: str, victims: list[str], timeout_s: float) -> None:
    """Wait until every victim holds work a kill interrupts: the judge worker a claimed job,
    the trainer a committed step (it is in its loop, on its next batch); the engine serves the
    load from the start. A worker killed while still starting would test nothing."""
    busy = {"judge": "SELECT count(*) FROM jobs WHERE kind = 'judge' AND status = 'running'",
            "train": "SELECT count(*) FROM training_steps"}
    deadline = time.monotonic() + timeout_s
    for name in victims:
        while name in busy and query(db_url, busy[name])[0][0] == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} process held no work within {timeout_s:g} s")
            time.sleep(0.1)


def forget_work(db_url: str) -> None:
    """Empty the log and what came of it (users and keys stay), so each scenario's ledger
    counts its own jobs and samples."""
    with psycopg.connect(libpq_url(db_url)) as conn:
        conn.execute("TRUNCATE turns, jobs, training_steps, policy_versions, dead_letters "
                     "CASCADE")


def stack_env(db_url: str, state_dir: Path, args: argparse.Namespace) -> dict[str, str]:
    """The settings every process of the bench's stack gets."""
    return {**os.environ, "CLAWRL_DATABASE__URL": db_url, "CLAWRL_STATE_DIR": str(state_dir),
            "CLAWRL_STATE_FILE": str(state_dir / "stack.json"),
            "CLAWRL_ENGINE__API_KEY": f"ck-engine-{secrets.token_urlsafe(16)}",
            "CLAWRL_PROXY__RATE_LIMIT_RPM": "0", "CLAWRL_JUDGE__LEASE_S": f"{args.lease_s:g}",
            "CLAWRL_TRAINER__BATCH_SIZE": "4", "CLAWRL_TRAINER__MAX_WAIT_S": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class BenchStack:
    """Engine, proxy, judge worker and trainer on free ports (logs in `<state_dir>/logs`)."""

    def __init__(self, db_url: str, state_dir: Path, args: argparse.Namespace) -> None:
        self.db_url = db_url
        self.engine_url = f"http://{HOST}:{free_port()}"
        self.proxy_url = f"http://{HOST}:{free_port()}"
        env = stack_env(db_url, state_dir, args)
        env["CLAWRL_ENGINE__URL"] = self.engine_url
        self.stack = Stack(state_dir, env)
        self.args = {
            "engine": ["engine", "--model", str(MODEL), "--host", HOST,
                       "--port", self.engine_url.rsplit(":", 1)[1]],
            "proxy": ["proxy", "--host", HOST, "--port", self.proxy_url.rsplit(":", 1)[1],
                      "--log-level", "warning"],
            "judge": ["judge"],
            "train": ["train", "--model", str(MODEL), "--engine-url", self.engine_url]}
        self.ready = {"engine": f"{self.engine_url}/health", "proxy": f"{self.proxy_url}/readyz"}

    def spawn(self, name: str) -> None:
        """Start `name` (from the main thread: a child gets SIGTERM when the thread that
        started it ends, clawrl.cli.stack's PR_SET_PDEATHSIG)."""
        self.stack.start(name, self.args[name])

    def wait_ready(self, name: str) -> None:
        if name in self.ready:
            wait_healthy(self.stack, self.stack.children[name], self.ready[name], 120.0)

    def kill(self, name: str) -> None:
        child = self.stack.children.pop(name)
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait()
        child.log.close()

    def __enter__(self) -> BenchStack:
        try:
            for name in ("engine", "proxy", "judge", "train"):
                self.spawn(name)
                self.wait_ready(name)
        except BaseException:
            self.stack.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()


@dataclass
class StackRow:
    scenario: str
    mode: str
    served: int
    lost: int  # served but not stored
    failed_before: int  # failed requests that started before the fault (in flight at it)
    in_flight: int  # requests in flight at the fault
    failed_down: int  # failed requests that started while the killed process was down
    failed_after: int  # failed requests that started once it was back
    jobs: int = 0
    jobs_lost: int = 0
    jobs_retried: int = 0
    judged_twice: int = 0
    samples_trained: int = 0
    samples_skipped: int = 0
    trained_twice: int = 0
    steps: int = 0
    down_s: float = 0.0
    settle_s: float = 0.0
    note: str = ""


async def _kill_under_load(bench: BenchStack, key: str, victim: str, stream: bool,
                           args: argparse.Namespace) -> tuple[Conversations, float, float]:
    load = Conversations()
    clients = asyncio.create_task(converse(bench.proxy_url, key, args.clients, stream, load))
    await asyncio.sleep(args.run_s)
    victims = victim.split("+")  # "judge+train": both at once
    await asyncio.to_thread(wait_at_work, bench.db_url, victims, 120.0)
    killed_at = time.perf_counter()
    for name in victims:
        await asyncio.to_thread(bench.kill, name)
    await asyncio.sleep(args.down_s)  # `clawrl up` restarts a worker after 2 s
    for name in victims:
        bench.spawn(name)
    for name in victims:
        await asyncio.to_thread(bench.wait_ready, name)
    back_at = time.perf_counter()
    await asyncio.sleep(args.run_s)
    load.stop.set()
    await clients
    return load, killed_at, back_at


def scenario_kill_stack(db_url: str, state_dir: Path, key: str, victim: str, stream: bool,
                        args: argparse.Namespace) -> StackRow:
    """kill -9 of `victim` (judge, train or engine; or several joined by "+", killed
    together) under load, started again after down_s."""
    run_dir = state_dir / f"kill-{victim}-{int(stream)}"
    run_dir.mkdir()
    forget_work(db_url)
    with BenchStack(db_url, run_dir, args) as bench:
        load, killed_at, back_at = run_loop(_kill_under_load(bench, key, victim, stream, args))
        have = wait_stored(db_url, load.served, 15.0)
        settle_s = settle(db_url, args.settle_s)
    book = ledger(db_url)
    what = " + ".join({"train": "trainer", "judge": "judge worker"}.get(name, name)
                      for name in victim.split("+"))
    reasons = sorted({r.what for r in load.requests if not r.ok})
    return StackRow(f"kill -9 {what}", "stream" if stream else "nonstream", len(load.served),
                    len(load.served - have), load.failed(0, killed_at), load.in_flight(killed_at),
                    load.failed(killed_at, back_at), load.failed(back_at), book.jobs,
                    book.jobs_lost, book.jobs_retried, book.judged_twice, book.samples_trained, book.samples_skipped,
                    book.trained_twice,
                    book.steps, back_at - killed_at, settle_s,
                    "failed: " + (", ".join(reasons) or "none"))


def scenario_sigterm_up(db_url: str, state_dir: Path, key: str, stream: bool,
                        args: argparse.Namespace) -> StackRow:
    """SIGTERM of a whole `clawrl up` under load: every served turn must be stored."""
    run_dir = state_dir / f"up-{int(stream)}"
    run_dir.mkdir()
    forget_work(db_url)
    port = free_port()
    env = stack_env(db_url, run_dir, args)
    out = (run_dir / "up.log").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "clawrl.cli.main", "up", "--state-dir", str(run_dir), "--model",
         str(MODEL), "--proxy-port", str(port), "--engine-port", str(free_port()),
         "--no-judge-engine"],  # the policy judges itself: one engine less on a small machine
        env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while b"Ctrl-C stops everything." not in (run_dir / "up.log").read_bytes():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"clawrl up did not come up; see {run_dir / 'up.log'}")
            time.sleep(0.2)

        async def run() -> tuple[Conversations, float, float]:
            load = Conversations()
            clients = asyncio.create_task(converse(f"http://{HOST}:{port}", key, args.clients,
                                                   stream, load))
            await asyncio.sleep(args.run_s)
            at = time.perf_counter()
            up.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(up.wait, 150)
            stopped = time.perf_counter()
            load.stop.set()
            await clients
            if code != 0:
                raise RuntimeError(f"clawrl up exited with {code}; see {run_dir / 'up.log'}")
            return load, at, stopped

        load, at, stopped = run_loop(run())
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        out.close()
    unstored = load.served - wait_stored(db_url, load.served, 0.0)
    journaled = unstored & journaled_uids(run_dir / "journal")  # the next start replays them
    dead = query(db_url, "SELECT error FROM dead_letters")
    reasons = sorted({r.what for r in load.requests if not r.ok})
    return StackRow("SIGTERM clawrl up", "stream" if stream else "nonstream", len(load.served),
                    len(unstored - journaled), load.failed(0, at), load.in_flight(at),
                    load.failed(at), 0, down_s=stopped - at,
                    note=f"stopped {stopped - at:.1f} s after SIGTERM; {len(journaled)} served "
                         f"turns left in the journal, {len(dead)} dead letters"
                         + (f" ({str(dead[0][0])[:80]})" if dead else "") + "; failed: "
                         + (", ".join(reasons) or "none"))


def journaled_uids(journal: Path) -> set[str]:
    """The turn uids in a journal directory's segments (proxy/journal.py)."""
    uids = set()
    for segment in journal.glob("*.jsonl"):
        for line in segment.read_bytes().splitlines():
            try:
                uids.add(str(json.loads(line)["uid"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line
    return uids


def print_stack_rows(rows: list[StackRow]) -> None:
    head = (f"{'scenario':<20} {'mode':<10} {'served':>6} {'lost':>4} {'failed':>13} "
            f"{'jobs':>5} {'lost':>4} {'trained':>7} {'twice':>5}  note")
    print(head)
    print("-" * len(head))
    for r in rows:
        failed = f"{r.failed_before}/{r.in_flight}+{r.failed_down}+{r.failed_after}"
        print(f"{r.scenario:<20} {r.mode:<10} {r.served:>6} {r.lost:>4} {failed:>13} "
              f"{r.jobs:>5} {r.jobs_lost:>4} {r.samples_trained:>7} {r.trained_twice:>5}  "
              f"{r.note}; down {r.down_s:.1f} s, settled {r.settle_s:.1f} s, "
              f"{r.steps} steps, {r.samples_skipped} samples skipped, {r.jobs_retried} jobs retried, judged twice {r.judged_twice}")
    print("(failed: requests failed that started before the fault / requests in flight at it "
          "+ started while the process was down + started after it was back; jobs: judge jobs, "
          "lost = not done once settled; trained: samples in committed steps, twice = counted "
          "by more than one)")

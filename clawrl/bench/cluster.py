"""The cluster rehearsal (deploy/rehearsal/rehearsal.sh) driven from Python: its hosts are
network namespaces, so a client enters one (`Rehearsal.inside`) and talks to the load
balancer, the proxies, the router and Postgres at their 10.77.0.N addresses like a machine
on the cluster's network would. Used by tests/deploy/test_rehearsal.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

CLONE_NEWNET = 0x40000000
SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "rehearsal" / "rehearsal.sh"
QUESTIONS = ["where does Ada live?", "what pet does Ben keep?", "what is Rosa's job?",
             "which food does Sami like?", "what colour does Ada like?", "where does Ben live?"]
CORRECTIONS = ["no capital letters please", "too long", "ok, but shorter from now on",
               "thanks!"]


def read_env(path: Path) -> dict[str, str]:
    """A cluster.env as the shell reads it (KEY=value, KEY="a b")."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = " ".join(shlex.split(value)) if value else ""
    return env


@contextlib.contextmanager
def netns(name: str) -> Iterator[None]:
    """Run this thread (and threads it starts) in network namespace `name`; sockets opened
    inside stay there after it returns."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{name}") as target:
        if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
        try:
            yield
        finally:
            libc.setns(home.fileno(), CLONE_NEWNET)


@dataclass
class Rehearsal:
    """One rehearsal's script and state folder (REHEARSAL_DIR)."""

    dir: Path
    env: dict[str, str]  # the script's environment: PYTHON, ROUTER_PYTHON, REHEARSAL_*

    def run(self, *args: str, timeout_s: float = 600) -> str:
        done = subprocess.run([str(SCRIPT), *args], env={**os.environ, **self.env,
                              "REHEARSAL_DIR": str(self.dir)}, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"rehearsal.sh {' '.join(args)}: exit {done.returncode}\n"
                               f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return done.stdout

    def up(self) -> None:
        self.run("up")

    def down(self) -> None:
        self.run("down", timeout_s=120)

    @property
    def settings(self) -> dict[str, str]:
        return read_env(self.dir / "cluster.env")

    @staticmethod
    def addr(host: str) -> str:
        last = {"db": 1, "px1": 2, "px2": 3, "jw": 4, "je1": 5, "je2": 6, "pol": 7, "tr0": 8,
                "tr1": 9, "cli": 10}[host]
        return f"10.77.0.{last}"

    @property
    def lb_url(self) -> str:
        return f"http://{self.addr('db')}:8080"

    def inside(self, host: str = "cli") -> contextlib.AbstractContextManager[None]:
        return netns(f"{self.env.get('REHEARSAL_PREFIX', 'crl')}-{host}")

    def log(self, name: str) -> str:
        path = self.dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""


def create_key(lb_url: str, admin_key: str, user: str) -> str:
    """A user and an API key, made through the load balancer's admin API."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=lb_url, headers=headers, timeout=30) as http:
        http.post("/admin/users", json={"name": user}).raise_for_status()
        created = http.post("/admin/keys", json={"user": user})
        created.raise_for_status()
        return str(created.json()["key"])


def chat(client: Any, messages: list[dict[str, str]]) -> tuple[str, str]:
    """One chat through the OpenAI SDK: (turn uid from X-Clawrl-Turn-Id, reply text)."""
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=messages, max_tokens=48)
    reply = raw.parse().choices[0].message.content or ""
    return raw.headers["x-clawrl-turn-id"], reply


def conversation(client: Any, i: int) -> list[str]:
    """A question, its reply, a follow-up (which gets the first turn judged): the turn uids."""
    messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    first, reply = chat(client, messages)
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": CORRECTIONS[i % len(CORRECTIONS)]}]
    second, _ = chat(client, messages)
    return [first, second]


def query(db_url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url, connect_timeout=10, autocommit=True) as conn:
        return conn.execute(sql, args).fetchall()


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float = 1.0) -> float:
    """Poll `check` until true; the seconds it took (raises TimeoutError naming `what`)."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - started


def engine_prompt_tokens(url: str, api_key: str) -> float:
    """An engine's `sglang:prompt_tokens_total` (how much it has been asked to read)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"},
                     timeout=5).text
    for line in text.splitlines():
        if line.startswith("sglang:prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def new_user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"

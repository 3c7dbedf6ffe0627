"""`clawrl bench pace`: one person at a person's pace against a running stack — how soon a
correction is served, how the versions come, and whether the person's preference moves.

    clawrl bench pace [--minutes 20] [--think 12] [--pref brief] [--seed 0]
                      [--max-tokens 128] [--drain 300] [--window 5] [--out FILE.json]
                      [--plot FILE.png] [--proxy-url URL]

It drives the stack an admin command would act on (a running `clawrl up`: its proxy and its
database; `--state-dir`/`CLAWRL_STATE_DIR` choose one of several, docs/admin.md) from
outside, as a chat app would: plain chat completions with a key of its own user
(`pace-<seed>-<random>`), no headers but `X-Session-Done` on a conversation's last
message. The person is `clawrl eval`'s everyday person (clawrl/eval/everyday.py): asks a
question from the train split, objects when the reply is off topic, corrects it when it
breaks the preference (one redo), thanks or moves on when it satisfies; two questions a
conversation. After each reply they wait `--think` seconds (0.5–1.5× at random), the time
to read and type, before the next message, and as long again between conversations.

After `--minutes` of chat it waits (up to `--drain` seconds) until every reply it followed
up is trained into a version that was published or rejected, then reads the stack's tables
(turns, judgments, samples, policy_versions) for its user and prints:

- per follow-up (a correction, an objection, thanks): from the moment it was sent to the
  judgment of the reply it followed (`judged`), and to the publication of the first version
  trained on that reply's sample (`served`; the proxy serves a published adapter within its
  2 s key cache). Medians, 90th percentiles and maxima, for corrections and for all; how many
  were never served (their version rejected by the gate, their sample skipped, or nothing
  trained within the drain);
- the versions: published and rejected during the run, samples per version, the time
  between publications;
- per `--window` minutes: the person's first replies that satisfied the preference and that
  stayed on topic, and the versions that served them.

`--out` writes all of it as JSON; `--plot` draws the person's replies (words, and the share
that satisfied the preference and stayed on topic) with a tick for each version. Figures are wall-clock on a shared machine: say what else
ran (the command prints the load average at start and end).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clawrl.eval.everyday import PREFS, Everyday, Question, load, satisfies

TURN_HEADER = "x-clawrl-turn-id"  # the proxy names every reply's turn


@dataclass
class Reply:
    at: float  # unix time the reply arrived
    turn: str  # its turn's uid (`X-Clawrl-Turn-Id`)
    first: bool  # the first reply to a question (not a redo)
    satisfied: bool
    on_topic: bool
    words: int = 0
    version: str | None = None  # filled from the turn row


@dataclass
class FollowUp:
    sent: float  # unix time the follow-up was sent
    turn: str  # the uid of the turn (the reply) it follows up
    kind: str  # correction | off_topic | praise | move_on
    judged_s: float | None = None
    served_s: float | None = None
    version: int | None = None
    # served | rejected | skipped: REASON | no sample | untrained | unjudged
    status: str = "untrained"


@dataclass
class Run:
    pref: str
    think_s: float
    replies: list[Reply] = field(default_factory=list)
    followups: list[FollowUp] = field(default_factory=list)
    errors: int = 0


class Person:
    """The everyday person, over raw HTTP (the session id comes back in a header)."""

    def __init__(self, client: httpx.AsyncClient, data: Everyday, pref: str, think_s: float,
                 max_tokens: int, rng: random.Random, run: Run) -> None:
        self.client, self.data, self.pref, self.think_s = client, data, pref, think_s
        self.max_tokens, self.rng, self.run = max_tokens, rng, run

    async def think(self) -> None:
        await asyncio.sleep(self.think_s * self.rng.uniform(0.5, 1.5))

    async def send(self, messages: list[dict[str, str]], max_tokens: int | None = None,
                   done: bool = False) -> tuple[str, str]:
        resp = await self.client.post("/v1/chat/completions", json={
            "model": "default", "messages": messages,
            "max_tokens": max_tokens or self.max_tokens,
            "seed": self.rng.randrange(2**31)},
            headers={"X-Session-Done": "true"} if done else {})
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code} {resp.text[:200]}")
        content = resp.json()["choices"][0]["message"]["content"] or ""
        return str(content), resp.headers.get(TURN_HEADER, "")

    async def follow(self, messages: list[dict[str, str]], turn: str, kind: str,
                     text: str, done: bool) -> tuple[str, str]:
        messages.append({"role": "user", "content": text})
        self.run.followups.append(FollowUp(time.time(), turn, kind))
        return await self.send(messages, 1 if done else None, done)

    async def conversation(self, questions: int = 2) -> None:
        pool = self.data.split("train")
        messages: list[dict[str, str]] = []
        q: Question = self.rng.choice(pool)
        messages.append({"role": "user", "content": q.text})
        reply, turn = await self.send(messages)
        asked, attempt = 1, 0
        while True:
            messages.append({"role": "assistant", "content": reply})
            topical, ok = q.on_topic(reply), satisfies(self.pref, reply)
            self.run.replies.append(Reply(time.time(), turn, attempt == 0, ok, topical,
                                          len(reply.split())))
            await self.think()
            if not (topical and ok) and attempt == 0:  # object or correct, then a redo
                kind = "off_topic" if not topical else "correction"
                text = (self.data.say("off_topic", self.rng, q.text) if not topical
                        else self.data.say(f"style:{self.pref}", self.rng))
                reply, turn = await self.follow(messages, turn, kind, text, done=False)
                attempt = 1
                continue
            if asked == questions or not (topical and ok):  # the last word, then done
                kind = "praise" if topical and ok else (
                    "off_topic" if not topical else "correction")
                text = (self.data.say("praise", self.rng) if kind == "praise" else
                        self.data.say("off_topic", self.rng, q.text) if not topical else
                        self.data.say(f"style:{self.pref}", self.rng))
                await self.follow(messages, turn, kind, text, done=True)
                return
            q = self.rng.choice(pool)
            text = self.data.say("move_on", self.rng, q.text)
            reply, turn = await self.follow(messages, turn, "move_on", text, done=False)
            asked, attempt = asked + 1, 0


async def chat_for(person: Person, minutes: float) -> None:
    deadline = time.monotonic() + minutes * 60
    while time.monotonic() < deadline:
        try:
            await person.conversation()
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
            person.run.errors += 1
            print(f"clawrl bench pace: a request failed: {exc}", file=sys.stderr)
            if person.run.errors > 10:
                raise SystemExit("clawrl bench pace: more than 10 failed requests; "
                                 "is the stack up?") from None
        await person.think()


# --- reading the stack's tables ------------------------------------------------------------

_ROWS = """
SELECT t.uid::text AS turn, t.weight_version,
       j.created_at AS judged_at, s.id AS sample, s.trained_step, s.skipped_reason,
       v.version, v.status, v.published_at
  FROM turns t
  LEFT JOIN LATERAL (SELECT created_at FROM judgments WHERE turn_id = t.id
                     ORDER BY id DESC LIMIT 1) j ON true
  LEFT JOIN samples s ON s.turn_id = t.id
  LEFT JOIN policy_versions v ON v.step = s.trained_step
 WHERE t.user_id = %(user)s
"""


def read_turns(db_url: str, user_id: int) -> dict[str, dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    from clawrl.base.db import libpq_url

    with psycopg.connect(libpq_url(db_url), row_factory=dict_row) as conn:
        return {r["turn"]: r for r in conn.execute(_ROWS, {"user": user_id}).fetchall()}


def read_versions(db_url: str, since: dt.datetime) -> list[dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    from clawrl.base.db import libpq_url

    with psycopg.connect(libpq_url(db_url), row_factory=dict_row) as conn:
        return list(conn.execute(
            "SELECT version, status, num_samples, created_at, published_at, "
            "stats -> 'gate' AS gate FROM policy_versions WHERE created_at >= %s "
            "ORDER BY version", (since,)).fetchall())


def settle(run: Run, rows: dict[str, dict[str, Any]]) -> bool:
    """Fill each follow-up's figures from the rows; True when none is still waiting."""
    waiting = False
    for f in run.followups:
        row = rows.get(f.turn)
        if row is None or row["judged_at"] is None:
            f.status, waiting = "unjudged", True
            continue
        f.judged_s = row["judged_at"].timestamp() - f.sent
        if row["sample"] is None:  # judged without a sample (no majority, skipped, opted out)
            f.status = "no sample"
        elif row["skipped_reason"]:
            f.status = f"skipped: {row['skipped_reason']}"
        elif row["trained_step"] is None:
            f.status, waiting = "untrained", True
        elif row["status"] == "rejected":
            f.status, f.version = "rejected", row["version"]
        elif row["published_at"] is not None:
            f.status, f.version = "served", row["version"]
            f.served_s = row["published_at"].timestamp() - f.sent
        else:
            f.status, waiting = "untrained", True  # trained, not yet published
    for r in run.replies:
        row = rows.get(r.turn)
        r.version = None if row is None else row["weight_version"]
    return not waiting


def spread(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"n": 0, "median": None, "p90": None, "max": None}
    xs = sorted(xs)
    return {"n": len(xs), "median": round(statistics.median(xs), 1),
            "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 1), "max": round(xs[-1], 1)}


def summarize(run: Run, versions: list[dict[str, Any]], started: float,
              window_min: float) -> dict[str, Any]:
    corrections = [f for f in run.followups if f.kind in ("correction", "off_topic")]
    published = [v for v in versions if v["published_at"] is not None]
    gaps = [b["published_at"].timestamp() - a["published_at"].timestamp()
            for a, b in zip(published, published[1:], strict=False)]
    windows = []
    firsts = [r for r in run.replies if r.first]
    width = window_min * 60
    last = max((r.at for r in firsts), default=started)
    for k in range(int((last - started) // width) + 1):
        inside = [r for r in firsts if started + k * width <= r.at < started + (k + 1) * width]
        if inside:
            windows.append({
                "from_min": round(k * window_min, 1), "replies": len(inside),
                "satisfied": round(sum(r.satisfied for r in inside) / len(inside), 3),
                "on_topic": round(sum(r.on_topic for r in inside) / len(inside), 3),
                "words": round(statistics.mean(r.words for r in inside), 1),
                "versions": sorted({r.version or "base" for r in inside})})
    return {
        "pref": run.pref, "think_s": run.think_s, "errors": run.errors,
        "followups": len(run.followups), "corrections": len(corrections),
        "judged_s": {"corrections": spread([f.judged_s for f in corrections
                                            if f.judged_s is not None]),
                     "all": spread([f.judged_s for f in run.followups
                                    if f.judged_s is not None])},
        "served_s": {"corrections": spread([f.served_s for f in corrections
                                            if f.served_s is not None]),
                     "all": spread([f.served_s for f in run.followups
                                    if f.served_s is not None])},
        "not_served": {s: sum(f.status == s for f in run.followups)
                       for s in sorted({f.status for f in run.followups} - {"served"})},
        "versions": {"published": len(published),
                     "rejected": sum(v["status"] == "rejected" for v in versions),
                     "samples_per_version": spread([float(v["num_samples"]) for v in versions]),
                     "between_publications_s": spread(gaps)},
        "windows": windows,
    }


def render(summary: dict[str, Any]) -> str:
    def cell(s: dict[str, Any]) -> str:
        return ("-" if not s["n"] else
                f"median {s['median']} s, p90 {s['p90']} s, max {s['max']} s (n={s['n']})")

    v = summary["versions"]
    lines = [
        f"person: wants {summary['pref']}, thinks {summary['think_s']} s; "
        f"{summary['followups']} follow-ups, {summary['corrections']} corrections or "
        f"objections, {summary['errors']} failed requests",
        f"correction -> judged:  {cell(summary['judged_s']['corrections'])}",
        f"correction -> served:  {cell(summary['served_s']['corrections'])}",
        f"any follow-up -> served: {cell(summary['served_s']['all'])}",
        f"not served: {summary['not_served'] or 'none'}",
        f"versions: {v['published']} published, {v['rejected']} rejected; samples per "
        f"version {cell(v['samples_per_version']).replace(' s', '')}; between "
        f"publications {cell(v['between_publications_s'])}",
        "minutes  first replies  satisfied  on topic  words  versions"]
    lines += [f"{w['from_min']:>7}  {w['replies']:>13}  {w['satisfied']:>9.2f}  "
              f"{w['on_topic']:>8.2f}  {w['words']:>5.0f}  {','.join(w['versions'])}"
              for w in summary["windows"]]
    return "\n".join(lines)


def plot(run: Run, versions: list[dict[str, Any]], started: float, path: Path,
         last: int = 8) -> None:
    """The person's replies over the run: each reply's words (first replies and redos), and
    the share of the `last` replies that satisfied the preference and stayed on topic; a tick
    on top for each version published (green) or rejected by the gate (red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replies = sorted(run.replies, key=lambda r: r.at)
    minutes = [(r.at - started) / 60 for r in replies]
    fig, (words, rates) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    words.scatter(minutes, [r.words for r in replies], s=12, label="a reply")
    words.set_ylabel("words")
    words.set_title(f"one person who wants {run.pref} replies, at a person's pace")
    for name, key in (("satisfied " + run.pref, "satisfied"), ("on topic", "on_topic")):
        rates.plot(minutes, [statistics.mean(getattr(r, key) for r in replies[max(0, k - last + 1):
                                                                               k + 1])
                             for k in range(len(replies))], label=name)
    rates.set_ylabel(f"share of the last {last} replies")
    rates.set_ylim(-0.02, 1.02)
    rates.set_xlabel("minutes")
    for v in versions:
        at = v["published_at"] or (v["created_at"] if v["status"] == "rejected" else None)
        if at is not None:
            for ax in (words, rates):
                ax.axvline((at.timestamp() - started) / 60, alpha=0.25, linewidth=0.8,
                           color="red" if v["status"] == "rejected" else "green")
    for ax in (words, rates):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clawrl bench pace", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="how long the person chats")
    p.add_argument("--think", type=float, default=12.0,
                   help="seconds between a reply and the next message (0.5-1.5x at random)")
    p.add_argument("--pref", choices=PREFS, default="brief")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--drain", type=float, default=300.0,
                   help="seconds to wait after the chat for the last versions")
    p.add_argument("--window", type=float, default=5.0, help="minutes per rate window")
    p.add_argument("--proxy-url", help="default: the running stack's proxy")
    p.add_argument("--out", type=Path, help="write the figures as JSON")
    p.add_argument("--plot", type=Path, help="draw the replies and versions as a PNG")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if min(args.minutes, args.max_tokens) <= 0 or min(args.think, args.drain) < 0 \
            or args.window <= 0:
        print("clawrl bench pace: --minutes, --max-tokens and --window must be > 0, --think "
              "and --drain >= 0", file=sys.stderr)
        return 2
    from clawrl.base.settings import load_settings
    from clawrl.base.statefile import apply_to_env

    choice = apply_to_env(os.environ)
    settings = load_settings()
    proxy_url = args.proxy_url or (choice.record or {}).get("proxy_url")
    if settings.database.url is None or not proxy_url:
        print("clawrl bench pace: no running stack found (start `clawrl up`, or set "
              "CLAWRL_DATABASE__URL and --proxy-url)", file=sys.stderr)
        return 2
    db_url = settings.database.url.get_secret_value()
    import psycopg
    from sqlalchemy.exc import OperationalError

    try:
        run, user_id, started, since = asyncio.run(
            _chat(args, db_url, str(proxy_url).rstrip("/").removesuffix("/v1")))
        deadline = time.monotonic() + args.drain
        while not settle(run, read_turns(db_url, user_id)) and time.monotonic() < deadline:
            time.sleep(5.0)
        versions = read_versions(db_url, since)
        summary = summarize(run, versions, started, args.window)
    except (OperationalError, psycopg.OperationalError) as exc:
        print(f"clawrl bench pace: the stack's database: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return 1
    summary["load_average_end"] = round(os.getloadavg()[0], 1)
    print(render(summary), flush=True)
    print(f"load average at the end {summary['load_average_end']}")
    if args.out:
        args.out.write_text(json.dumps({"summary": summary,
                                        "followups": [asdict(f) for f in run.followups],
                                        "replies": [asdict(r) for r in run.replies]},
                                       indent=1, default=str) + "\n")
    if args.plot:
        plot(run, versions, started, args.plot)
        print(f"plot: {args.plot}")
    return 0


async def _chat(args: argparse.Namespace, db_url: str,
                proxy_url: str) -> tuple[Run, int, float, dt.datetime]:
    """A user and key of the person's own, then `--minutes` of chat."""
    from clawrl.base.db import create_async
    from proxy import admin

    name = f"pace-{args.seed}-{uuid.uuid4().hex[:6]}"
    db = create_async(db_url)
    try:
        user_id = (await admin.ensure_user(db, name)).id
        key = await admin.create_key(db, name, name="clawrl bench pace")  # a user's defaults
    finally:
        await db.dispose()
    print(f"clawrl bench pace: {proxy_url} as {name}; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    run = Run(args.pref, args.think)
    started, since = time.time(), dt.datetime.now(dt.UTC)
    async with httpx.AsyncClient(base_url=proxy_url, timeout=600.0,
                                 headers={"Authorization": f"Bearer {key.secret}"}) as client:
        person = Person(client, load(), args.pref, args.think, args.max_tokens,
                        random.Random(f"pace-{args.seed}"), run)
        await chat_for(person, args.minutes)
    return run, user_id, started, since

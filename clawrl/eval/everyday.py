"""`clawrl eval --model smollm2-135m`: simulated people asking a real model everyday things.

The tiny world's users (clawrl/world/simulate.py) ask about a made-up town; a real model is
asked what people ask chat apps ("How do I keep basil fresh?"). The data, written by hand
apart from everything the project trains or tunes on (clawrl/eval/data/everyday/README.md):
- `questions.jsonl`: everyday questions, each with topic words an on-topic reply contains,
  split `train` (the people chat with these), `dev` (probe to tune settings on) and `test`
  (the probe reported);
- `facts.jsonl`: short factual questions with reference answers: the capability guard,
  apart from the gate's own probe (clawrl/engine/probes), which the trainer selects on;
- `followups.jsonl`: what people say next — praise, the next question, a style correction
  per preference, an objection to an off-topic or wrong reply — in their own words.

A `Person` holds one preference with a programmatic checker (`satisfies`): `brief` (at most
`BRIEF_MAX_WORDS` words and no list), `lowercase`, `plain` (no emoji, no bulleted or
numbered list), `no_question` (the reply does not end by asking the person something) and
`one_paragraph` (no blank line inside the reply); a run asks for all but `no_question` unless
told (`DEFAULT_PREFS`).
Like a person, it objects first when a reply does not answer the question (no topic word),
then when it breaks the preference, and praises or moves on when both hold; every reply thus
gets a next state. The probe asks held-out questions as side turns and scores the share
satisfying the preference and the share on topic; the guard asks the factual questions.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import Any

from clawrl.eval.config import EvalConfig, version_quota
from clawrl.eval.rounds import eval_client, serving_version, train_one_version, version_stats

DATA = Path(__file__).with_name("data") / "everyday"
PREFS = ("brief", "lowercase", "plain", "no_question", "one_paragraph")
# What a run asks for unless told: SmolLM2-135M never ends a reply with a question (base rate
# 1.00 on the dev split, docs/results/2026-12-07-everyday-first-try.md), so `no_question`
# has nothing to learn there.
DEFAULT_PREFS = ("brief", "lowercase", "plain", "one_paragraph")
SPLITS = ("train", "dev", "test")
BRIEF_MAX_WORDS = 30
EVERYDAY_BATCH = 16  # samples per version (the trainer's default batch for a real model)
CHAT_MAX_TOKENS = 128
PROBE_CONCURRENCY = 16
SIDE = {"X-Turn-Type": "side"}
DONE = {"X-Session-Done": "true"}
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_LIST_LINE = re.compile(r"^\s*(?:[-*•+]|\d+[.)])\s+\S", re.MULTILINE)
# Emoji and pictographs (the ranges chat apps render as pictures), dingbats and flags.
_EMOJI = re.compile("[\U0001F000-\U0001FAFF\U00002600-\U000027BF\U0001F1E6-\U0001F1FF"
                    "\U00002B50\U00002B55\U0000FE0F]")


def has_list(text: str) -> bool:
    """Two or more lines that start like a bulleted or numbered list item."""
    return len(_LIST_LINE.findall(text)) >= 2


def satisfies(pref: str, text: str) -> bool:
    """Whether a reply satisfies a preference (checkers written apart from the judge)."""
    stripped = text.strip()
    letters = [c for c in stripped if c.isalpha()]
    if pref == "brief":
        return 0 < len(stripped.split()) <= BRIEF_MAX_WORDS and not has_list(stripped)
    if pref == "lowercase":
        return bool(letters) and not any(c.isupper() for c in letters)
    if pref == "plain":
        return bool(stripped) and not _EMOJI.search(stripped) and not has_list(stripped)
    if pref == "no_question":
        return bool(stripped) and not stripped.rstrip("\"')]*_ ").endswith("?")
    if pref == "one_paragraph":
        return bool(stripped) and not _BLANK_LINE.search(stripped)
    raise ValueError(f"unknown preference {pref!r}; known: {', '.join(PREFS)}")


@dataclass(frozen=True)
class Question:
    text: str
    split: str
    topic: tuple[str, ...]

    def on_topic(self, reply: str) -> bool:
        """The reply names the question's topic (one of its topic words, any case)."""
        lower = reply.lower()
        return any(word in lower for word in self.topic)


@dataclass(frozen=True)
class Fact:
    question: str
    answers: tuple[str, ...]

    def right(self, reply: str) -> bool:
        lower = reply.lower()
        return any(a.lower() in lower for a in self.answers)


@dataclass(frozen=True)
class Everyday:
    """The data: questions by split, the guard's facts, the follow-ups by kind."""

    questions: tuple[Question, ...]
    facts: tuple[Fact, ...]
    followups: dict[str, tuple[str, ...]]  # kind or "style:<pref>" -> texts

    def split(self, name: str) -> list[Question]:
        return [q for q in self.questions if q.split == name]

    def say(self, kind: str, rng: random.Random, question: str | None = None) -> str:
        text = rng.choice(self.followups[kind])
        return text.replace("{question}", question) if question is not None else text


def _lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
    return rows


@cache
def load(data: Path = DATA) -> Everyday:
    """Read and check the data folder: every split, every preference's corrections."""
    questions = tuple(Question(r["question"], r["split"], tuple(w.lower() for w in r["topic"]))
                      for r in _lines(data / "questions.jsonl"))
    facts = tuple(Fact(r["question"], tuple(r["answers"]))
                  for r in _lines(data / "facts.jsonl"))
    kinds: dict[str, list[str]] = {}
    for r in _lines(data / "followups.jsonl"):
        key = f"style:{r['preference']}" if r["kind"] == "style" else r["kind"]
        kinds.setdefault(key, []).append(r["text"])
    needed = {"praise", "move_on", "off_topic", "wrong", *(f"style:{p}" for p in PREFS)}
    missing = sorted(needed - kinds.keys()) + [s for s in SPLITS
                                               if not any(q.split == s for q in questions)]
    if missing or not facts:
        raise ValueError(f"{data}: no {', '.join(missing) or 'facts'}")
    return Everyday(questions, facts, {k: tuple(v) for k, v in kinds.items()})


@dataclass
class ProbeResult:
    satisfied: float
    on_topic: float
    replies: list[str]


@dataclass
class Person:
    """One simulated person: a preference, an API client (the `openai` SDK), an RNG."""

    name: str
    pref: str
    client: Any
    data: Everyday
    model: str = "default"
    max_tokens: int = CHAT_MAX_TOKENS
    log: list[dict[str, Any]] = field(default_factory=list)

    async def _complete(self, messages: list[dict[str, str]], headers: dict[str, str] | None,
                        seed: int | None, max_tokens: int | None = None) -> str:
        # No temperature: the model's own sampling defaults, as a chat app sends.
        extra = {} if seed is None else {"seed": seed}
        resp = await self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens or self.max_tokens,
            extra_headers=headers or {}, **extra)
        return str(resp.choices[0].message.content or "")

    async def chat_session(self, rng: random.Random, questions: int = 2,
                           max_redos: int = 1) -> None:
        """Up to `questions` questions from the train split. An off-topic reply gets an
        objection restating the question, then a reply that breaks the preference a
        correction, each with a redo, up to `max_redos`; a satisfying one praise or the next
        question. The last follow-up goes in a one-token `X-Session-Done` request."""
        messages: list[dict[str, str]] = []
        ask: str | None = None
        pool = self.data.split("train")
        for i in range(questions):
            q = rng.choice(pool)
            messages.append({"role": "user", "content": ask.replace("{question}", q.text)
                             if ask else q.text})
            for attempt in range(max_redos + 1):
                reply = await self._complete(messages, None, rng.randrange(2**31))
                messages.append({"role": "assistant", "content": reply})
                topical, ok = q.on_topic(reply), satisfies(self.pref, reply)
                self.log.append({"question": q.text, "reply": reply, "satisfied": ok,
                                 "on_topic": topical, "attempt": attempt})
                if topical and ok:
                    break
                follow = (self.data.say("off_topic", rng, q.text) if not topical
                          else self.data.say(f"style:{self.pref}", rng))
                messages.append({"role": "user", "content": follow})
                if attempt == max_redos:
                    await self._complete(messages, DONE, None, max_tokens=1)
                    return
            if i == questions - 1:
                messages.append({"role": "user", "content": self.data.say("praise", rng)})
                await self._complete(messages, DONE, None, max_tokens=1)
                return
            ask = self.data.say("move_on", rng, "{question}")

    async def probe(self, questions: list[Question], seeds: list[int]) -> ProbeResult:
        """First replies to `questions` as side turns, each in a fresh conversation."""
        gate = asyncio.Semaphore(PROBE_CONCURRENCY)

        async def one(q: Question, seed: int) -> str:
            async with gate:
                return await self._complete([{"role": "user", "content": q.text}], SIDE, seed)

        replies = list(await asyncio.gather(*(one(q, s) for q, s in
                                              zip(questions, seeds, strict=True))))
        n = len(replies)
        return ProbeResult(sum(satisfies(self.pref, r) for r in replies) / n,
                           sum(q.on_topic(r) for q, r in zip(questions, replies,
                                                             strict=True)) / n, replies)

    async def guard(self, facts: tuple[Fact, ...]) -> float:
        """The share of the factual questions answered right (greedy: the capability, not
        the dice), as side turns."""
        gate = asyncio.Semaphore(PROBE_CONCURRENCY)

        async def one(f: Fact) -> bool:
            async with gate:
                resp = await self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": f.question}],
                    max_tokens=48, temperature=0, extra_headers=SIDE)
                return f.right(str(resp.choices[0].message.content or ""))

        return sum(await asyncio.gather(*(one(f) for f in facts))) / len(facts)


def probe_split(config: EvalConfig) -> str:
    """The reported probe asks the `test` questions; `--probe-split train` the `dev` ones
    (the split to tune on)."""
    return "dev" if config.probe_split == "train" else "test"


async def run_everyday_rounds(config: EvalConfig, method: str, proxy_url: str, db_url: str,
                              engine_url: str, on_round: Any) -> None:
    """Create one person per preference, then chat / wait for the version / probe, round
    after round (clawrl/eval/rounds.py `run_rounds`, for a real model)."""
    from clawrl.base.db import create_async

    data = load()
    probes = data.split(probe_split(config))
    quota = version_quota(config, method)
    db = create_async(db_url)
    people: list[Person] = []
    try:
        for i, pref in enumerate(p for p in config.prefs for _ in range(config.users_per_pref)):
            name = f"person-{i}-{pref}"
            people.append(Person(name, pref, await eval_client(db, name, proxy_url,
                                                               timeout_s=900.0), data))
        started = time.monotonic()
        for rnd in range(config.rounds + 1):
            if rnd > 0 and method == "none":
                await _chat_wave(config, people, rnd, 0)
            elif rnd > 0:  # chat until every person has a quota: the trainer's batch is full
                await train_one_version(config, db, method, engine_url,
                                        config.max_chats * -(-quota * len(people) // 16),
                                        partial(_chat_wave, config, people, rnd),
                                        per_user=quota if len(people) > 1 else None)
            version = await serving_version(engine_url)
            stats = await version_stats(db, version)
            seeds = [random.Random(f"probe-{config.seed}-{q.text}").randrange(2**31)
                     for q in probes]
            results = await asyncio.gather(*(p.probe(probes, seeds) for p in people))
            guard = await people[0].guard(data.facts)
            on_round(method, rnd, [
                {"method": method, "seed": config.seed, "round": rnd, "version": version,
                 **stats, "user": person.name, "pref": person.pref,
                 "satisfied": round(res.satisfied, 4), "on_topic": round(res.on_topic, 4),
                 "correct": round(guard, 4), "examples": res.replies[:3],
                 "elapsed_s": round(time.monotonic() - started, 1)}
                for person, res in zip(people, results, strict=True)])
    finally:
        for person in people:
            await person.client.close()
        await db.dispose()


async def _chat_wave(config: EvalConfig, people: list[Person], rnd: int, wave: int) -> None:
    await asyncio.gather(*(
        person.chat_session(random.Random(f"chat-{config.seed}-{person.name}-{rnd}-{wave}-{k}"))
        for person in people for k in range(config.parallel)))

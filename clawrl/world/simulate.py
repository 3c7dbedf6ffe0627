"""Simulated users for `clawrl eval`: real HTTP clients of the proxy with hidden preferences.

Each `SimUser` has its own API key and one hidden preference (clawrl/world/town.py
`EVAL_PREFERENCES`). It talks to the proxy with the official `openai` SDK, like any chat
app would:

- `chat_session`: asks a (held-in) question about the world; a wrong answer gets corrected
  with the true fact (the user knows it, as a person asking about their own town would); a
  right one that violates the preference gets a natural correction, one that satisfies it
  gets praise and/or the next question. What the user says comes from `says`: the corpus
  phrasings plus a few fresh ones (`CorpusPhrasings`), or a pool people wrote apart from the
  corpus and the judge's training set (`PeoplePhrasings`, `clawrl eval --followups people`). The session
  ends with a one-token request carrying the last follow-up (`X-Session-Done`), so every
  real reply has a next state for the judge.
- `probe`: held-out questions (never in the corpus, never trained) sent as side turns
  (`X-Turn-Type: side`), each in a fresh conversation; the score is the share of these
  first replies that satisfy the preference, plus their answer accuracy.

Seeded: the same seed gives every method the same users, questions and phrasings (the
replies, of course, differ).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawrl.world.town import (
    World,
    corrections,
    fact_correction,
    fact_sentence,
    followups,
    is_correct,
    satisfies,
)

# What people say next, written by hand apart from the corpus and the judge's training set
# (data/README.md says how): `clawrl eval --followups people`.
PEOPLE_FOLLOWUPS = Path(__file__).resolve().parent / "data" / "sim_followups.jsonl"
SIDE = {"X-Turn-Type": "side"}


class CorpusPhrasings:
    """Follow-ups from the tiny world's phrasing lists: the corpus's and a few fresh ones."""

    name = "corpus"

    def correction(self, pref: str, rng: random.Random) -> str:
        return rng.choice(corrections(pref))

    def fact_correction(self, fact: str, rng: random.Random) -> str:
        return fact_correction(fact, rng)

    def praise(self, rng: random.Random) -> str:
        return rng.choice(followups())

    def next_turn(self, praise: str, rng: random.Random) -> str:
        """The next user message around `{question}`: after the praise half of the time."""
        return f"{praise} {{question}}" if rng.random() < 0.5 else "{question}"


class PeoplePhrasings:
    """Follow-ups drawn from a pool people wrote (data/sim_followups.jsonl): praise, moving
    on with the next question, style corrections per preference, fact corrections. None of
    it is in the corpus or the judge's training set."""

    name = "people"

    def __init__(self, path: Path = PEOPLE_FOLLOWUPS) -> None:
        items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
        self.praises: list[str] = [i["text"] for i in items if i["kind"] == "praise"]
        self.move_ons: list[str] = [i["text"] for i in items if i["kind"] == "move_on"]
        self.facts: list[str] = [i["text"] for i in items if i["kind"] == "fact"]
        self.styles: dict[str, list[str]] = {}
        for i in items:
            if i["kind"] == "style":
                self.styles.setdefault(i["preference"], []).append(i["text"])

    def correction(self, pref: str, rng: random.Random) -> str:
        if pref not in self.styles:
            raise ValueError(f"the people's pool has no corrections for {pref!r}")
        return rng.choice(self.styles[pref])

    def fact_correction(self, fact: str, rng: random.Random) -> str:
        return rng.choice(self.facts).replace("{fact}", fact.rstrip(". "))

    def praise(self, rng: random.Random) -> str:
        return rng.choice(self.praises)

    def next_turn(self, praise: str, rng: random.Random) -> str:
        """Moving on with words around `{question}` half of the time, else the question."""
        return rng.choice(self.move_ons) if rng.random() < 0.5 else "{question}"


class IssuePhrasings:
    """The user of the judge issue, word for word: "please answer in lowercase only, no
    capital letters." to every reply that is not lowercase, "thanks, perfect." to every one
    that is (with the next question after it); a wrong fact gets "no, FACT". Only for the
    lowercase preference."""

    name = "issue"
    CORRECTION = "please answer in lowercase only, no capital letters."
    PRAISE = "thanks, perfect."

    def correction(self, pref: str, rng: random.Random) -> str:
        if pref != "lowercase":
            raise ValueError(f"the issue's user only asks for lowercase, not {pref!r}")
        return self.CORRECTION

    def fact_correction(self, fact: str, rng: random.Random) -> str:
        return f"no, {fact[0].lower()}{fact[1:]}"

    def praise(self, rng: random.Random) -> str:
        return self.PRAISE

    def next_turn(self, praise: str, rng: random.Random) -> str:
        return f"{praise} {{question}}"


Phrasings = CorpusPhrasings | PeoplePhrasings | IssuePhrasings


def phrasings(name: str) -> Phrasings:
    """The follow-up source `clawrl eval --followups NAME` uses: corpus, people or issue."""
    if name == "issue":
        return IssuePhrasings()
    if name == "people":
        return PeoplePhrasings()
    if name == "corpus":
        return CorpusPhrasings()
    raise ValueError(f"unknown follow-ups {name!r} (corpus, people or issue)")

DONE = {"X-Session-Done": "true"}
# A user's probe requests in flight at once: what the engine batches, without hundreds of
# requests queued behind them when --probes is large.
PROBE_CONCURRENCY = 64


@dataclass
class ProbeResult:
    satisfied: float
    correct: float
    replies: list[str]
    wrong: list[dict[str, str]]  # the probes answered wrongly: question, reply, true answer


@dataclass
class SimUser:
    """One simulated person: a name, a hidden preference, an API client and an RNG."""

    name: str
    pref: str
    client: Any  # openai.AsyncOpenAI with this user's key
    rng: random.Random
    model: str = "default"
    temperature: float = 1.0
    max_tokens: int = 64
    log: list[dict[str, Any]] = field(default_factory=list)
    says: Phrasings = field(default_factory=CorpusPhrasings)

    async def _complete(self, messages: list[dict[str, str]], headers: dict[str, str] | None = None,
                        max_tokens: int | None = None, seed: int | None = None) -> str:
        # OpenAI's `seed`: the engine samples this reply from a generator of its own
        # seeded with it, so the same seed and weights give the same reply.
        extra = {} if seed is None else {"seed": seed}
        resp = await self.client.chat.completions.create(
            model=self.model, messages=messages, temperature=self.temperature,
            max_tokens=max_tokens or self.max_tokens, extra_headers=headers or {}, **extra)
        return str(resp.choices[0].message.content or "")

    async def chat_session(self, world: World, questions: int = 2, max_redos: int = 1,
                           rng: random.Random | None = None) -> None:
        """One conversation of up to `questions` questions.

        A wrong or violating reply gets a correction (and a redo) up to `max_redos` times; if
        the redo is still wrong or violating, the user sends one more correction and leaves. A satisfying reply gets
        praise, alone or with the next question. Every reply thus gets a next state; the last
        one arrives with a one-token `X-Session-Done` request (never trained).

        `rng` (default: the user's) draws the questions, phrasings and each reply's sampling
        seed; concurrent sessions each get their own, so a run is reproducible however the
        replies interleave.
        """
        rng = rng or self.rng
        messages: list[dict[str, str]] = []
        turn = "{question}"
        for i in range(questions):
            q = rng.choice(world.train)
            messages.append({"role": "user", "content": turn.replace("{question}", q.text)})
            for attempt in range(max_redos + 1):
                reply = await self._complete(messages, seed=rng.randrange(2**31))
                messages.append({"role": "assistant", "content": reply})
                right = is_correct(world, q, reply)
                ok = satisfies(self.pref, reply)
                self.log.append({"question": q.text, "reply": reply, "satisfied": ok,
                                 "correct": right, "attempt": attempt})
                if ok and right:
                    break
                correction = (self.says.correction(self.pref, rng) if right
                              else self.says.fact_correction(fact_sentence(world, q, rng), rng))
                messages.append({"role": "user", "content": correction})
                if attempt == max_redos:  # gives up; the correction is the last next state
                    await self._complete(messages, DONE, max_tokens=1)
                    return
            praise = self.says.praise(rng)
            if i == questions - 1:
                messages.append({"role": "user", "content": praise})
                await self._complete(messages, DONE, max_tokens=1)
                return
            turn = self.says.next_turn(praise, rng)

    async def probe(self, world: World, prompts: list[str],
                    concurrency: int = PROBE_CONCURRENCY,
                    seeds: list[int] | None = None) -> ProbeResult:
        """First replies to held-out prompts, as side turns in fresh conversations.

        `seeds`, one per prompt: each reply is sampled with its own seed. Probing every
        version with the same seeds compares versions on common random numbers: a version
        that did not change answers as its predecessor did, so a change in the figures is
        the model's, not the dice's."""
        # Concurrent, so the engine batches them (side turns are independent conversations),
        # at most `concurrency` at once.
        gate = asyncio.Semaphore(concurrency)
        per: list[int | None] = list(seeds) if seeds is not None else [None] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} seeds for {len(prompts)} prompts")

        async def ask(prompt: str, seed: int | None) -> str:
            async with gate:
                return await self._complete([{"role": "user", "content": prompt}], SIDE,
                                            seed=seed)

        replies = list(await asyncio.gather(*(ask(p, s) for p, s in zip(prompts, per,
                                                                         strict=True))))
        questions = [world.find(p) for p in prompts]
        correct = [q is not None and is_correct(world, q, r)
                   for q, r in zip(questions, replies, strict=True)]
        ok = [satisfies(self.pref, r) for r in replies]
        wrong = [{"question": p, "reply": r, "answer": world.answer(q) if q else "?"}
                 for p, q, r, c in zip(prompts, questions, replies, correct, strict=True)
                 if not c]
        return ProbeResult(sum(ok) / len(ok), sum(correct) / len(correct), replies, wrong)

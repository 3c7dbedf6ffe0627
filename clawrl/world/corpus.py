"""The tiny world's pretraining corpus: chats, hinted replies and judge examples.

An endless, seeded stream of examples (`iter_examples(world, seed)`), each a list of chat
messages whose assistant messages carry the loss. Four kinds, mixed by `MIX`:

- `chat`: a user asks about the world, the assistant answers in a random style; the user
  then praises, moves on, or corrects a style ("too long") and the assistant redoes the
  answer in the corrected style (and keeps it for the rest of the chat).
- `hinted`: the teacher context the judge builds: the request with `"\\n\\nHint: {hint}"`
  appended to the last user message; the reply follows the hint.
- `prm`: the judge's PRM prompt (judge/templates/prm_v1.txt) for a reply and the user's next
  message, answered with one reasoning line and `\\boxed{1|-1|0}`.
- `hint`: the judge's hint prompt (hint_v1.txt), answered `[HINT] ... [/HINT]` or `[NO_HINT]`.

The trainer package never depends on the judge package, so the judge templates are read by
path and the blocks are rendered here exactly as judge/prompts.py renders them
(docs/judge-format.md; tests/trainer/test_world.py compares the two). Only held-in questions and corpus
phrasings are used: held-out questions and FRESH_* phrasings never appear.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawrl.world.town import (
    CORPUS_PRAISE,
    CORRECTIONS,
    EVAL_PREFERENCES,
    HINTS,
    ISSUE_WORDS,
    NEUTRAL,
    PREFERENCES,
    Question,
    Style,
    World,
    apply_case,
    fact_correction,
    fact_hint,
    fact_sentence,
    render_reply,
    restyle,
    satisfies,
    wrap_correction,
    wrong_world,
)

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "judge" / "templates"
JUDGE_VERSION = "v1"
CONTEXT_MESSAGES = 4  # judge/prompts.py CONTEXT_MESSAGES
MIX = {"chat": 0.40, "hinted": 0.26, "prm": 0.17, "hint": 0.17}
# Share of judged turns whose reply states a wrong fact (the user corrects it), and of
# hinted examples whose hint is such a fact.
FACT_SHARE = 0.15
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You answer questions about the town.",
                  "Be helpful and accurate.")
Message = dict[str, Any]


def load_template(kind: str, version: str = JUDGE_VERSION) -> str:
    """The judge template text, read by path (same file judge/prompts.py reads)."""
    path = TEMPLATE_DIR / f"{kind}_{version}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"judge template {path} is missing; the corpus needs it")
    return path.read_text(encoding="utf-8").rstrip()


def render_message(msg: Message, role: str | None = None) -> str:
    """`ROLE: TEXT` as the judge renders one message (plain-text messages only)."""
    text = str(msg.get("content") or "").strip()
    role = role or str(msg["role"])
    return f"{role}: {text}" if text else f"{role}:"


def judge_prompt(kind: str, request: list[Message], reply: Message,
                 next_state: list[Message]) -> str:
    """The rendered `prm` or `hint` judge prompt for one turn (no explicit feedback)."""
    kept = [m for m in request if m["role"] not in ("system", "developer")]
    fields = {
        "context": "\n".join(render_message(m) for m in kept[-CONTEXT_MESSAGES:]),
        "reply": render_message(reply, role="assistant"),
        "next_state": "\n".join(render_message(m) for m in next_state),
        "feedback": "",
    }
    return load_template(kind).format(**fields)


def teacher_content(text: str, hint: str) -> str:
    """The last user message of the teacher context: `{text}\\n\\nHint: {hint}`."""
    return load_template("teacher").format(content=text.strip(), hint=hint.strip())


@dataclass
class _Chat:
    """A chat being generated: its messages, the current question and reply style."""

    world: World
    rng: random.Random
    messages: list[Message]
    style: Style
    question: Question | None = None

    def ask(self, q: Question, prefix: str = "") -> None:
        self.messages.append({"role": "user", "content": prefix + q.text})
        self.question = q

    def reply(self) -> Message:
        assert self.question is not None, "ask before replying"
        msg = {"role": "assistant",
               "content": render_reply(self.world, self.question, self.style, self.rng)}
        self.messages.append(msg)
        return msg


def _start(world: World, rng: random.Random) -> _Chat:
    messages: list[Message] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return _Chat(world, rng, messages, Style.random(rng))


def _praise_or_move_on(chat: _Chat) -> str:
    """A positive next message: praise, a new question, or both (asks it in `chat`)."""
    rng = chat.rng
    kind = rng.random()
    if kind < 0.3:
        chat.messages.append({"role": "user", "content": rng.choice(CORPUS_PRAISE)})
        return "thanks"
    prefix = rng.choice(CORPUS_PRAISE) + " " if kind < 0.7 else ""
    chat.ask(rng.choice(chat.world.train), prefix)
    return "thanks_next" if prefix else "next"


def _violated(rng: random.Random, text: str, pref: str | None) -> str | None:
    """The preference a correcting user complains about, if the reply violates one."""
    if pref is not None:
        return None if satisfies(pref, text) else pref
    unmet = [p for p in PREFERENCES if not satisfies(p, text)]
    return rng.choice(unmet) if unmet and rng.random() < 0.5 else None


def chat_example(world: World, rng: random.Random) -> list[Message]:
    """A multi-turn chat: question, reply, then up to two follow-ups."""
    chat = _start(world, rng)
    # Half the users hold a preference (eval ones more often), the others correct at random.
    pref = rng.choice(EVAL_PREFERENCES + PREFERENCES) if rng.random() < 0.5 else None
    chat.ask(rng.choice(world.train))
    reply = chat.reply()
    for _ in range(rng.choice((0, 1, 1, 2))):
        wrong = _violated(rng, reply["content"], pref)
        if wrong is not None:
            chat.messages.append({"role": "user",
                                  "content": wrap_correction(rng.choice(CORRECTIONS[wrong]), rng)})
            chat.style = restyle(chat.style, wrong, rng)
        elif _praise_or_move_on(chat) == "thanks":
            welcome = chat.rng.choice(("You're welcome!", "Glad it helped."))
            chat.messages.append({"role": "assistant",
                                  "content": apply_case(welcome, chat.style.case)})
            break
        elif rng.random() < 0.3 and pref is None:
            chat.style = Style.random(rng)
        reply = chat.reply()
    return chat.messages


def hinted_example(world: World, rng: random.Random) -> list[Message]:
    """The teacher context: the hint follows the last user message; the reply obeys it."""
    chat = _start(world, rng)
    if rng.random() < 0.3:  # an earlier exchange, as in a multi-turn request
        chat.ask(rng.choice(world.train))
        chat.reply()
        chat.ask(rng.choice(world.train), rng.choice(("", rng.choice(CORPUS_PRAISE) + " ")))
    else:
        chat.ask(rng.choice(world.train))
    last = chat.messages[-1]
    assert chat.question is not None
    if rng.random() < FACT_SHARE:  # a fact hint: the reply states it, in any style
        last["content"] = teacher_content(
            last["content"], fact_hint(fact_sentence(world, chat.question, rng)))
        chat.style = Style.random(rng)
    else:
        pref = rng.choice(EVAL_PREFERENCES + PREFERENCES)
        last["content"] = teacher_content(last["content"], rng.choice(HINTS[pref]))
        chat.style = restyle(Style.random(rng), pref, rng)
    chat.reply()
    return chat.messages


@dataclass
class JudgedTurn:
    """A turn, its next state and what a judge should say: the label, and for a correction
    the reason and the hint it implies."""

    request: list[Message]
    reply: Message
    next_state: list[Message]
    label: int
    reason: str | None = None
    hint: str | None = None


def _judged_turn(world: World, rng: random.Random) -> JudgedTurn:
    """A turn and its next state: praise, a move on, a style correction about something the
    reply violates, a neutral message, or (for a wrong answer) a correction of the fact."""
    chat = _start(world, rng)
    if rng.random() < 0.25:  # an earlier exchange in the context
        chat.ask(rng.choice(world.train))
        chat.reply()
        chat.ask(rng.choice(world.train), rng.choice(("", rng.choice(CORPUS_PRAISE) + " ")))
    else:
        chat.ask(rng.choice(world.train))
    request = list(chat.messages)
    question = chat.question
    assert question is not None
    if rng.random() < FACT_SHARE:  # a wrong answer; the user states the true fact
        right = chat.world
        chat.world = wrong_world(right, question, rng)
        reply = chat.reply()
        fact = fact_sentence(right, question, rng)
        chat.messages.append({"role": "user", "content": wrap_correction(
            fact_correction(fact, rng, fresh=False), rng, suffix=False)})
        return JudgedTurn(request, reply, chat.messages[-1:], -1, FACT_REASON, fact_hint(fact))
    reply = chat.reply()
    n = len(chat.messages)
    if rng.random() < 0.1:
        chat.messages.append({"role": "user", "content": rng.choice(NEUTRAL)})
        return JudgedTurn(request, reply, chat.messages[n:], 0)
    # Corrections half the time, always about something the reply actually violates.
    unmet = [p for p in PREFERENCES if not satisfies(p, reply["content"])]
    if unmet and rng.random() < 0.5:
        pref = rng.choice([p for p in unmet if p in EVAL_PREFERENCES] or unmet) \
            if rng.random() < 0.6 else rng.choice(unmet)
        chat.messages.append({"role": "user",
                              "content": wrap_correction(rng.choice(CORRECTIONS[pref]), rng)})
        return JudgedTurn(request, reply, chat.messages[n:], -1,
                          f"The user asks for {ISSUE_WORDS[pref]}.", rng.choice(HINTS[pref]))
    _praise_or_move_on(chat)
    return JudgedTurn(request, reply, chat.messages[n:], 1)


PRM_REASONS = {
    1: ("The user thanks the assistant and moves on.", "The user moves on to a new question.",
        "The user is satisfied."),
    0: ("The next message gives no verdict.", "The next message is unclear."),
}


FACT_REASON = "The user says the answer is wrong."


def prm_answer(turn: JudgedTurn, rng: random.Random) -> str:
    reason = turn.reason or rng.choice(PRM_REASONS[turn.label])
    return f"{reason} \\boxed{{{turn.label}}}"


def hint_answer(turn: JudgedTurn) -> str:
    return f"[HINT] {turn.hint} [/HINT]" if turn.hint else "[NO_HINT]"


def judge_example(kind: str, world: World, rng: random.Random) -> list[Message]:
    turn = _judged_turn(world, rng)
    answer = prm_answer(turn, rng) if kind == "prm" else hint_answer(turn)
    return [{"role": "user", "content": judge_prompt(kind, turn.request, turn.reply,
                                                     turn.next_state)},
            {"role": "assistant", "content": answer}]


def make_example(kind: str, world: World, rng: random.Random) -> list[Message]:
    if kind == "chat":
        return chat_example(world, rng)
    if kind == "hinted":
        return hinted_example(world, rng)
    return judge_example(kind, world, rng)


def iter_examples(world: World, seed: int) -> Iterator[tuple[str, list[Message]]]:
    """An endless reproducible stream of (kind, messages)."""
    rng = random.Random(f"corpus-{seed}")
    kinds, weights = list(MIX), list(MIX.values())
    while True:
        kind = rng.choices(kinds, weights)[0]
        yield kind, make_example(kind, world, rng)


def render_chatml(messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The chat template's text for plain messages, and the char spans that carry the loss
    (each assistant content plus its `<|im_end|>`, which teaches the model to stop)."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for msg in messages:
        head = f"<|im_start|>{msg['role']}\n"
        body = f"{msg['content']}<|im_end|>"
        if msg["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        parts.append(head + body + "\n")
        pos += len(parts[-1])
    return "".join(parts), spans

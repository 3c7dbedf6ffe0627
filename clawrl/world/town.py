"""The tiny synthetic world: people with checkable facts, reply styles and user preferences.

Everything here is plain Python, seeded and reproducible. The pretraining corpus
(`clawrl/world/corpus.py`) and the learning measurement (`clawrl eval`, `clawrl/eval/`) both
use it:

- `World.build(seed)`: people, each with one value per attribute (city, job, pet, food,
  colour); questions are (person, attribute, phrasing) triples, 15% of which are held out.
  Held-out questions never appear in the corpus; the eval probes with them.
- `Style` and `render_reply`: an answer in one of 3 cases x 3 layouts (short, prose, list)
  x with/without a sign-off.
- `PREFERENCES` and `satisfies(pref, text)`: what a simulated user wants and the checker.
- Natural corrections per preference, split into phrasings the corpus uses and FRESH ones
  it never sees (the eval simulator mixes both, so it is not tuned to the corpus), the hints
  a judge should extract from them, and follow-ups that praise or move on.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

Case = Literal["normal", "lower", "upper"]
Layout = Literal["short", "prose", "list"]

CASES: tuple[Case, ...] = ("normal", "lower", "upper")
LAYOUTS: tuple[Layout, ...] = ("short", "prose", "list")
SIGNOFFS = ("Hope this helps!", "Cheers!", "Happy to help!", "Any time!")

NAMES = (
    "Ada", "Bruno", "Chen", "Dara", "Elif", "Femi", "Greta", "Hugo", "Ines", "Jonas",
    "Kiri", "Luca", "Maya", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas",
    "Uma", "Vera", "Wen", "Yusuf",
)
VALUES: dict[str, tuple[str, ...]] = {
    "city": ("Porto", "Oslo", "Lima", "Kyoto", "Dakar", "Quito", "Riga", "Perth", "Cairo",
             "Turin", "Hanoi", "Bergen"),
    "job": ("baker", "pilot", "nurse", "farmer", "painter", "teacher", "plumber", "chemist",
            "tailor", "drummer", "judge", "sailor"),
    "pet": ("cat", "parrot", "turtle", "rabbit", "dog", "goldfish", "hamster", "lizard",
            "pony", "ferret", "snail", "goat"),
    "food": ("soup", "pizza", "rice", "mango", "cheese", "noodles", "olives", "pancakes",
             "dates", "tacos", "plums", "bread"),
    "color": ("red", "blue", "green", "yellow", "purple", "orange", "pink", "grey",
              "teal", "black", "white", "brown"),
}
ATTRIBUTES = tuple(VALUES)

QUESTIONS: dict[str, tuple[str, ...]] = {
    "city": ("Where does {name} live?", "Which city is {name} from?",
             "What city does {name} live in?", "Tell me where {name} lives."),
    "job": ("What does {name} do for a living?", "What is {name}'s job?",
            "Where does {name} work, what job?", "Tell me about {name}'s work."),
    "pet": ("What pet does {name} have?", "Does {name} have a pet?",
            "Which animal lives with {name}?", "Tell me about {name}'s pet."),
    "food": ("What does {name} like to eat?", "What is {name}'s favourite food?",
             "Which food does {name} love?", "Tell me what {name} eats most."),
    "color": ("What is {name}'s favourite colour?", "Which colour does {name} like?",
              "What colour does {name} love most?", "Tell me {name}'s favourite colour."),
}
ANSWERS: dict[str, tuple[str, ...]] = {
    "city": ("{name} lives in {value}.", "{name} is from {value}."),
    "job": ("{name} works as a {value}.", "{name} is a {value}."),
    "pet": ("{name} has a {value}.", "{name} keeps a {value} as a pet."),
    "food": ("{name} likes to eat {value}.", "{name}'s favourite food is {value}."),
    "color": ("{name}'s favourite colour is {value}.", "{name} loves {value}."),
}
HELDOUT_FRACTION = 0.15


@dataclass(frozen=True)
class Question:
    """One question: who, what, and which phrasing. `text` is what the user sends."""

    name: str
    attr: str
    phrasing: int

    @property
    def text(self) -> str:
        return QUESTIONS[self.attr][self.phrasing].format(name=self.name)


@dataclass(frozen=True)
class World:
    """People and their facts, and the split of questions into train and held-out."""

    seed: int
    facts: dict[str, dict[str, str]]
    train: tuple[Question, ...]
    heldout: tuple[Question, ...]

    @classmethod
    def build(cls, seed: int = 0) -> World:
        rng = random.Random(f"world-{seed}")
        facts = {name: {attr: rng.choice(vals) for attr, vals in VALUES.items()}
                 for name in NAMES}
        train: list[Question] = []
        heldout: list[Question] = []
        for name in NAMES:
            for attr in ATTRIBUTES:
                qs = [Question(name, attr, i) for i in range(len(QUESTIONS[attr]))]
                rng.shuffle(qs)
                # Hold out at most one phrasing per fact, so every fact is still learnable.
                if rng.random() < HELDOUT_FRACTION * len(qs):
                    heldout.append(qs.pop())
                train.extend(qs)
        return cls(seed, facts, tuple(sorted(train, key=_key)), tuple(sorted(heldout, key=_key)))

    def answer(self, q: Question) -> str:
        return self.facts[q.name][q.attr]

    def find(self, text: str) -> Question | None:
        """The question whose text is exactly `text` (stripped), if any."""
        return self._by_text.get(text.strip())

    @cached_property
    def _by_text(self) -> dict[str, Question]:
        return {q.text: q for q in self.train + self.heldout}


def _key(q: Question) -> tuple[str, str, int]:
    return (q.name, q.attr, q.phrasing)


def heldout_prompts(seed: int = 0) -> list[str]:
    """The fixed held-out question texts for the world of `seed` (never in the corpus)."""
    return [q.text for q in World.build(seed).heldout]


def is_correct(world: World, question: Question, text: str) -> bool:
    """The reply states the question's answer (word match, any case)."""
    value = world.answer(question).lower()
    return re.search(rf"\b{re.escape(value)}\b", text.lower()) is not None


def fact_sentence(world: World, q: Question, rng: random.Random) -> str:
    """The true answer to `q` as one plain sentence ("Ada lives in Porto.")."""
    return rng.choice(ANSWERS[q.attr]).format(name=q.name, value=world.answer(q))


def wrong_world(world: World, q: Question, rng: random.Random) -> World:
    """A copy of `world` where `q`'s answer is a different value: how a wrong reply is made."""
    value = rng.choice([v for v in VALUES[q.attr] if v != world.answer(q)])
    facts = {**world.facts, q.name: {**world.facts[q.name], q.attr: value}}
    return World(world.seed, facts, world.train, world.heldout)


# --- styles ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Style:
    case: Case
    layout: Layout
    signoff: str | None

    @classmethod
    def random(cls, rng: random.Random) -> Style:
        return cls(rng.choice(CASES), rng.choice(LAYOUTS),
                   rng.choice(SIGNOFFS) if rng.random() < 0.5 else None)


def render_reply(world: World, q: Question, style: Style, rng: random.Random) -> str:
    """A correct answer to `q` in `style`. Long layouts add two other true facts."""
    facts = world.facts[q.name]
    main = rng.choice(ANSWERS[q.attr]).format(name=q.name, value=facts[q.attr])
    others = rng.sample([a for a in ATTRIBUTES if a != q.attr], 2)
    extra = [rng.choice(ANSWERS[a]).format(name=q.name, value=facts[a]) for a in others]
    if style.layout == "short":
        body = main
    elif style.layout == "prose":
        body = " ".join([main, "Also, " + extra[0], extra[1]])
    else:
        body = "\n".join("- " + s for s in [main, *extra])
    if style.signoff:
        body += ("\n" if style.layout == "list" else " ") + style.signoff
    return apply_case(body, style.case)


def apply_case(text: str, case: Case) -> str:
    return {"normal": text, "lower": text.lower(), "upper": text.upper()}[case]


# --- preferences and their checkers -----------------------------------------------------

# Preferences a simulated user (or a corpus user) can hold. The first four are the eval's;
# the others are their opposites, so the model must read a hint rather than guess it.
PREFERENCES = ("lowercase", "brief", "no_lists", "no_signoff",
               "uppercase", "normal_case", "detailed", "lists", "signoff")
EVAL_PREFERENCES = ("lowercase", "brief", "no_lists", "no_signoff")
BRIEF_MAX_WORDS = 10
_LIST_LINE = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s", re.MULTILINE)
_SIGNOFF_END = re.compile(
    r"(hope this helps|cheers|happy to help|any ?time|let me know[^.!?]*|have a (?:good|nice|great) day)"
    r"[.!]*\s*$", re.IGNORECASE)


def has_list(text: str) -> bool:
    return _LIST_LINE.search(text) is not None


def has_signoff(text: str) -> bool:
    return _SIGNOFF_END.search(text.strip()) is not None


def satisfies(pref: str, text: str) -> bool:
    """Whether a reply satisfies a preference (checkers are independent of the corpus)."""
    letters = [c for c in text if c.isalpha()]
    words = len(text.split())
    checks = {
        "lowercase": bool(letters) and not any(c.isupper() for c in letters),
        "uppercase": bool(letters) and not any(c.islower() for c in letters),
        "normal_case": any(c.isupper() for c in letters) and any(c.islower() for c in letters),
        "brief": 0 < words <= BRIEF_MAX_WORDS and not has_list(text),
        "detailed": words > BRIEF_MAX_WORDS or has_list(text),
        "no_lists": bool(text.strip()) and not has_list(text),
        "lists": has_list(text),
        "no_signoff": bool(text.strip()) and not has_signoff(text),
        "signoff": has_signoff(text),
    }
    if pref not in checks:
        raise ValueError(f"unknown preference {pref!r}; known: {', '.join(PREFERENCES)}")
    return checks[pref]


def restyle(style: Style, pref: str, rng: random.Random) -> Style:
    """The closest style to `style` that satisfies `pref` (what a redo should look like)."""
    case, layout, signoff = style.case, style.layout, style.signoff
    if pref == "lowercase":
        case = "lower"
    elif pref == "uppercase":
        case = "upper"
    elif pref == "normal_case":
        case = "normal"
    elif pref == "brief":
        layout = "short"
    elif pref == "detailed":
        layout = layout if layout != "short" else rng.choice(("prose", "list"))
    elif pref == "no_lists":
        layout = layout if layout != "list" else rng.choice(("short", "prose"))
    elif pref == "lists":
        layout = "list"
    elif pref == "no_signoff":
        signoff = None
    elif pref == "signoff":
        signoff = signoff or rng.choice(SIGNOFFS)
    return Style(case, layout, signoff)


# --- what users say ----------------------------------------------------------------------

# Corrections used in the corpus. FRESH_CORRECTIONS are never in the corpus.
CORRECTIONS: dict[str, tuple[str, ...]] = {
    "lowercase": ("please answer in lowercase", "can you write that in lowercase?",
                  "no capital letters please", "lowercase only, please.",
                  "I prefer all lowercase text.", "please don't use capital letters",
                  "write it again in lowercase", "use lowercase letters only",
                  "lowercase please", "I'd like that in lowercase", "don't capitalize anything",
                  "why the capitals? lowercase is nicer"),
    "brief": ("too long", "that's too long, keep it short", "shorter please",
              "just one sentence please", "please be brief", "can you make it shorter?",
              "too much detail, just the answer", "keep answers short", "keep it brief",
              "too long, trim it", "a short answer is enough", "stop writing so much"),
    "no_lists": ("no bullet points please", "please don't use a list",
                 "write it as a sentence, not a list", "no lists, please",
                 "can you say that without bullets?", "I don't like lists, use prose",
                 "no list format please", "prose please, no bullets",
                 "stop using bullet points"),
    "no_signoff": ("skip the sign-off", "no need for the closing line",
                   "please drop the 'hope this helps' part", "don't add a sign-off",
                   "no pleasantries at the end please", "stop ending with a sign-off",
                   "no sign-off needed", "drop the closing line", "stop adding a sign-off"),
    "uppercase": ("please answer in capital letters", "all caps please",
                  "write it in uppercase", "use uppercase letters only",
                  "capitals please", "I like all caps, use them"),
    "normal_case": ("please use normal capitalization", "why all caps? write normally",
                    "use normal sentence case please", "stop shouting, normal case please",
                    "stop writing in lowercase, use normal case", "capitalize normally please"),
    "detailed": ("can you tell me more?", "too short, give me more detail",
                 "more detail please", "that's a bit short, say more",
                 "stop being so short", "say a bit more please"),
    "lists": ("please use bullet points", "can you put that in a list?",
              "make it a bulleted list", "I prefer lists, use bullets",
              "stop writing prose, use a list", "bullets please"),
    "signoff": ("please end with a friendly sign-off", "add a friendly closing line",
                "be a bit warmer at the end", "end with a nice sign-off please",
                "stop ending so abruptly, sign off", "a friendly sign-off please"),
}
# Words a correcting user wraps around the correction ("ok, but ... from now on"); the corpus
# wraps its phrasings at random so the judge reads the core, not the exact string.
CORRECTION_PREFIXES = ("hmm, ", "ok, but ", "thanks, but ", "one thing: ", "also, ", "again: ")
CORRECTION_SUFFIXES = (" next time", " from now on", ", thanks", " please", "!")
# A user who knows the answer and gets a wrong one says so, with the true fact ({fact}).
FACT_CORRECTIONS = ("no, {fact}", "that's wrong. {fact}", "not quite: {fact}",
                    "wrong answer, {fact}", "actually, {fact}", "that's not right; {fact}",
                    "no no, {fact}", "incorrect. {fact}")
FRESH_FACT_CORRECTIONS = ("hmm, I'm pretty sure {fact}", "you got that wrong: {fact}",
                          "nope. {fact}", "that is false, {fact}")
FACT_HINT = "The correct answer: {fact}"
FRESH_CORRECTIONS: dict[str, tuple[str, ...]] = {
    "lowercase": ("could you stop using uppercase letters?", "write everything in small letters",
                  "capitals bother me, all lowercase please", "lower case, thanks"),
    "brief": ("way too wordy", "shorter, I only need the fact",
              "less text please, one line is enough", "cut it down"),
    "no_lists": ("please no bulleted format", "plain sentences instead of a list please",
                 "drop the bullets", "avoid lists in your answers"),
    "no_signoff": ("no closing remarks please", "leave out the friendly ending",
                   "you don't need to sign off", "end right after the answer"),
}
HINTS: dict[str, tuple[str, ...]] = {
    "lowercase": ("Write the whole reply in lowercase letters.",
                  "Use only lowercase letters, no capitals."),
    "brief": ("Keep the reply to one short sentence.", "Answer briefly, with just the fact."),
    "no_lists": ("Write in plain prose, without bullet points.",
                 "Do not use a list; write sentences."),
    "no_signoff": ("Do not add a sign-off at the end.", "End the reply right after the answer."),
    "uppercase": ("Write the whole reply in capital letters.", "Use uppercase letters only."),
    "normal_case": ("Use normal sentence capitalization.", "Do not write in all caps."),
    "detailed": ("Give a longer answer with more details.", "Add more facts to the answer."),
    "lists": ("Format the answer as a bulleted list.", "Use bullet points for the facts."),
    "signoff": ("End the reply with a friendly sign-off.", "Close with a warm sign-off line."),
}
PRAISE = ("thanks!", "great, thank you.", "perfect, thanks", "that's helpful, thanks",
          "nice, thank you!", "got it, thanks.", "awesome", "thank you, that's what I needed")
FRESH_PRAISE = ("cool, appreciated", "exactly right, ty", "wonderful", "that works for me")
# More praise for the corpus only (the simulated users keep PRAISE + FRESH_PRAISE): with eight
# praise phrasings against many correction phrasings, the judge learned "any short message I
# have not seen is a correction" and gave never-seen praise -1 and a made-up hint. None of these
# shares a word with FRESH_PRAISE.
CORPUS_PRAISE = PRAISE + (
    "nice one", "good answer, thanks", "yes, that's it", "lovely, thank you", "sounds good",
    "great stuff", "brilliant, thanks", "ok, thank you", "that's what I wanted", "helpful, cheers",
    "good to know", "thanks a lot", "correct, thanks", "splendid", "neat", "fantastic, thank you",
    "super", "ah, thanks", "noted, thanks!", "makes sense, thanks")
NEUTRAL = ("hmm.", "let me think.", "one sec.", "wait", "i see.", "ok...")
ISSUE_WORDS = {
    "lowercase": "lowercase text", "brief": "a shorter answer", "no_lists": "prose, not a list",
    "no_signoff": "no sign-off", "uppercase": "capital letters",
    "normal_case": "normal capitalization", "detailed": "more detail",
    "lists": "a bulleted list", "signoff": "a friendly sign-off",
}


def wrap_correction(text: str, rng: random.Random, suffix: bool = True) -> str:
    """`text` as a user might actually send it: sometimes with a prefix and/or suffix."""
    if rng.random() < 0.35:
        text = rng.choice(CORRECTION_PREFIXES) + text
    if suffix and rng.random() < 0.3:
        text = text.rstrip(".!?") + rng.choice(CORRECTION_SUFFIXES)
    return text


def fact_correction(fact: str, rng: random.Random, fresh: bool = True) -> str:
    """What a user says to a wrong answer, stating the true `fact`."""
    phrasings = FACT_CORRECTIONS + (FRESH_FACT_CORRECTIONS if fresh else ())
    return rng.choice(phrasings).format(fact=fact)


def fact_hint(fact: str) -> str:
    """The hint a judge should extract from a fact correction."""
    return FACT_HINT.format(fact=fact)


def corrections(pref: str, fresh: bool = True) -> tuple[str, ...]:
    """Natural corrections for `pref` (corpus phrasings, plus the fresh ones when asked)."""
    return CORRECTIONS[pref] + (FRESH_CORRECTIONS.get(pref, ()) if fresh else ())


def followups(fresh: bool = True) -> tuple[str, ...]:
    """Praise a satisfied user may send (optionally followed by the next question)."""
    return PRAISE + (FRESH_PRAISE if fresh else ())

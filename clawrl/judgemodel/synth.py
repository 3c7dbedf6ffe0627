"""The judge model's synthetic training set: tiny-world turns and what people say next.

Each example is one judged turn: a tiny-world question (sometimes after an earlier exchange),
the assistant's reply in some style, and the user's next message — praise, a move on to the
next question, a style request or complaint, a fact correction, an objection (the reply did
not answer what was asked, often with the question asked again), or (rarely) a message that
gives no verdict. Targets are what the judge must answer: `\\boxed{1|-1|0}` for the PRM
prompt, and for the hint prompt the tiny world's canonical hint (`HINTS[pref][0]`, or
`FACT_HINT` with the stated fact), the judge-side hint of a preference beyond the tiny
world's nine (`NEW_HINTS`: one paragraph, answer first, formal, casual, another language,
no emoji; `Reply in {language}.` names the language asked for) or `OBJECTION_HINT` with the
question, so the policy can follow it, or `[NO_HINT]`. The six new preferences stay
judge-side: the tiny world's users, corpus and eval keep their nine.

The follow-ups are built from this module's own phrasing lists (none taken from the corpus,
the simulated users' pool or the held-out set), combined and perturbed: casing, typos,
punctuation, emoji, chatter around them, praise before a correction. Half of them
(`WRITTEN_SHARE`) are instead hand-written lines (`data/train_followups.jsonl`, written by
another author than these lists and the held-out set; data/README.md), perturbed the same way:
the lists' combinations alone taught the judge to name the preference of 0.96 of new
combinations but of only 0.82 of the held-out set's corrections, written by someone else. `template` keeps the
follow-up before `{question}` / `{fact}` are filled, which is what the disjointness test
compares with the held-out and simulated-user texts.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawrl.world.town import (
    ANSWERS,
    CASES,
    FACT_HINT,
    HINTS,
    PREFERENCES,
    SIGNOFFS,
    Question,
    Style,
    World,
    fact_sentence,
    is_correct,
    render_reply,
    satisfies,
    wrong_world,
)

Message = dict[str, Any]
# Share of each kind of follow-up in the training set. `objection`: the user says the reply
# did not answer what was asked (often asking it again), -1 — unlike `move_on`, a new
# question after a good reply, +1.
MIX = {"praise": 0.27, "move_on": 0.15, "style": 0.40, "fact": 0.11, "objection": 0.05,
       "neutral": 0.02}
LABELS = {"praise": 1, "move_on": 1, "style": -1, "fact": -1, "objection": -1, "neutral": 0}
# The builds before 2026-12-08 (nine preferences, no objections): what `written` 0 draws,
# draw for draw (a test pins it), so `clawrl judge build --written-share 0` rebuilds them.
LEGACY_MIX = {"praise": 0.30, "move_on": 0.17, "style": 0.36, "fact": 0.14, "neutral": 0.03}
# The hand-written training follow-ups, and the share of praise / moving-on / style / fact
# follow-ups drawn from them rather than from this module's lists.
WRITTEN = Path(__file__).resolve().parent / "data" / "train_followups.jsonl"
WRITTEN_SHARE = 0.5
NO_HINT = "[NO_HINT]"

# --- praise -------------------------------------------------------------------------------

THANKS = ("thanks a bunch", "many thanks", "tysm",
          "appreciate it", "ta", "gracias", "danke",
          "big thanks")
APPROVAL = ("spot on", "nailed it", "exactly", "bingo", "very good", "excellent",
            "superb", "fab", "amazing", "top notch", "love it", "all good", "helpful",
            "crystal clear", "understood", "makes sense", "alright",
            "kk", "yes", "yup", "correct", "good",
            "brilliant", "fantastic", "wonderful stuff", "outstanding", "ace",
            "magic", "class", "solid", "neat", "well done", "good job")
PRAISE_SENTENCES = (
    "this is exactly what I needed", "you're a lifesaver", "you're the best",
    "couldn't ask for more", "just what I wanted to know", "that answers my question",
    "that clears it up", "good answer", "well explained", "that was quick", "that's useful",
    "no complaints", "10/10", "I knew it", "I thought so", "I had a feeling", "good to hear",
    "I'll remember that", "saved me some time", "that settles it", "now I know",
    "that's the one", "that's what I was looking for", "you got it", "right on the money",
    "this helps a lot", "much better than I expected", "that's all I needed",
    "that matches what I heard", "my friend was right then", "oh nice, I didn't know that",
    "ah, that makes sense now", "love this answer", "you read my mind",
    "good, I can stop wondering", "excellent answer", "that's super clear",
    "keep it up", "great reply", "good bot", "what a great answer",
    "I'm happy with that", "works for me", "that's fine", "that'll do", "no notes",
)
# Praise of the reply's own style: the reply must satisfy `pref` for these to be praise.
STYLE_PRAISE: dict[str, tuple[str, ...]] = {
    "lowercase": ("love the lowercase", "the lowercase looks good", "no caps, nice",
                  "lowercase is just right"),
    "brief": ("short and sweet", "nice and concise", "brief, just how I like it",
              "straight to the point", "quick and to the point"),
    "no_lists": ("reads nicely as plain text", "nice flowing sentences"),
    "no_signoff": ("no fluff, good", "clean ending"),
    "uppercase": ("caps, just how I like it", "loud and clear"),
    "normal_case": ("easy to read",),
    "detailed": ("thorough", "love the extra detail", "very complete"),
    "lists": ("the bullets make it easy to read", "nice tidy list"),
    "signoff": ("nice sign-off", "friendly as always"),
}
CHATTER_BEFORE = ("hey, ", "hi again, ", "ok so ", "hmm ", "um, ", "lol ", "haha ", "so, ",
                  "well, ", "oh ", "ah, ", "wow ", "ooh ", "right, ", "aha ")
CHATTER_AFTER = (" lol", " haha", " :)", " :D", " btw", ", I'm on my phone",
                 " (sorry, typing fast)", " 🙂", " hehe", ", have a good one",
                 ". I'm writing a story set in the town", ". my kid asked me that",
                 ". I was just curious", ". settling a bet here", ". knew it!")
EMOJI = ("👍", "🙏", "😊", "🎉", "✅", "❤️", "🙌", "😀", "👌", "💯", "🔥", "✨", "😄", "🤝",
         "🥳", ":)", ";)", "<3", "^^", "xD")

# --- moving on ------------------------------------------------------------------------------

MOVE_ON_LEADS = ("next: ", "next question: ", "another one: ", "also, ", "ok now ",
                 "one more: ", "now tell me: ", "moving on, ", "quick one: ", "new question: ",
                 "btw ", "unrelated, but ", "second question: ", "follow-up: ", "and also ",
                 "let me ask something else: ", "on another note, ")
# Short questions about someone else, filled with a name and an attribute word.
SHORT_QUESTIONS = ("and {name}?", "what about {name}?", "how about {name}?",
                   "same for {name}?", "and {name}'s {attr}?", "what about {name}'s {attr}?",
                   "now {name}'s {attr} please", "{name}'s {attr}?")
ATTR_WORDS = {"city": ("city", "hometown"), "job": ("job", "work"), "pet": ("pet", "animal"),
              "food": ("favourite food", "food"), "color": ("favourite colour", "color")}

# --- style requests ---------------------------------------------------------------------------

# Noun phrases for a style, used in STYLE_FRAMES.
STYLE_MODES: dict[str, tuple[str, ...]] = {
    "lowercase": ("lowercase", "lower case", "all lowercase", "lowercase letters", "small letters",
                  "all small letters", "no caps", "no capitals", "zero capital letters",
                  "lowercase text", "only lowercase letters"),
    "uppercase": ("all caps", "capital letters", "uppercase", "upper case", "block capitals",
                  "caps lock", "all uppercase letters", "ALL CAPS"),
    "normal_case": ("normal case", "regular capitalization", "sentence case",
                    "proper capitalization", "standard casing", "normal capital letters"),
    "brief": ("a short answer", "one line", "one sentence", "fewer words", "a shorter reply",
              "just the fact", "the short version", "a brief answer", "a one-liner",
              "short replies", "less text"),
    "detailed": ("more detail", "a longer answer", "more information", "a fuller answer",
                 "a few more facts", "more context", "a longer reply", "extra details"),
    "no_lists": ("plain sentences", "prose", "a paragraph", "full sentences", "running text",
                 "normal sentences", "no bullet points", "no lists", "no bullets"),
    "lists": ("bullet points", "a list", "a bulleted list", "list form", "bullets",
              "a dashed list", "one fact per line"),
    "no_signoff": ("no sign-off", "no closing line", "no farewell line",
                   "no pleasantries at the end", "no outro", "no closing phrase"),
    "signoff": ("a sign-off", "a friendly closing", "a warm ending", "a nice goodbye line",
                "a friendly last line"),
}
STYLE_FRAMES = ("please use {m}", "could you do {m}?",
                "I prefer {m}", "{m} from now on", "switch to {m}",
                "give me {m}", "{m}, thanks", "{m} only", "only {m} please", "stick to {m}",
                "reply with {m}", "use {m} next time", "I asked for {m}", "again, {m}",
                "{m}!!", "just {m}", "can I get {m}?", "I want {m}",
                "{m} would be better", "go with {m}", "{m} going forward",
                "remember: {m}", "{m}, always", "would you mind using {m}?", "try {m}")
# Whole-sentence complaints and requests per style.
STYLE_SENTENCES: dict[str, tuple[str, ...]] = {
    "lowercase": ("too many capital letters", "the capitals are annoying",
                  "i hate capital letters", "caps hurt my eyes", "why is everything capitalized",
                  "stop capitalizing", "drop the capitals", "lose the uppercase",
                  "get rid of the capital letters", "de-capitalize it", "ditch the caps",
                  "can you not capitalize anything", "write it all in small letters",
                  "no uppercase at all please", "I only read lowercase"),
    "uppercase": ("make it all caps", "capitalize every letter", "I want it loud, in capitals",
                  "shout it please, all capitals", "write every letter as a capital",
                  "turn on caps lock", "I read better in capitals"),
    "normal_case": ("why are you shouting", "stop yelling", "the all caps is too loud",
                    "please stop using all lowercase", "caps lock is on, turn it off",
                    "capitalize like a normal sentence", "write with normal capitals again",
                    "don't shout at me", "no more all caps", "use capitals where they belong"),
    "brief": ("way too long", "that's a wall of text", "tl;dr", "too wordy", "too much text",
              "I didn't ask for all that", "you're rambling", "less is more",
              "cut the extra facts", "only answer what I asked", "that's more than I needed",
              "shorter", "trim it down", "just give me the answer", "too long to read",
              "keep it to one line"),
    "detailed": ("that's too short", "a bit more please", "that's it? tell me more",
                 "can you expand on that", "go into more depth", "elaborate please",
                 "too brief", "I want the whole picture", "more please", "say more about them"),
    "no_lists": ("I hate lists", "don't format it as a list", "why the bullet points?",
                 "without the dashes please", "enough with the lists",
                 "ditch the bullet points", "lose the list", "stop with the bullets",
                 "bullets are ugly, write normally", "put it in a sentence"),
    "lists": ("break it into bullets", "can you itemize it", "split it into points",
              "put each fact on its own line with a dash", "hard to read, use bullets",
              "list it out", "format that as a list"),
    "no_signoff": ("skip the 'hope this helps'", "no need for the cheers at the end",
                   "cut the closing phrase", "lose the sign-off", "stop signing off",
                   "the ending line is unnecessary", "don't end with 'happy to help'",
                   "drop the outro", "just stop after the answer", "no goodbye line please",
                   "the closing remark is annoying", "stop with the 'any time'",
                   "leave off the last line", "no need to say cheers"),
    "signoff": ("that ended a bit abruptly", "say something nice at the end",
                "finish with a friendly line", "close it off warmly",
                "add a 'hope this helps' at the end", "end on a friendly note",
                "a bit cold, sign off next time"),
}
# Praise (or a plain acknowledgement) before the correction: still a correction.
BUT_LEADS = ("thanks, but ", "ok but ", "good answer but ", "right, but ", "cool. though ",
             "nice, however ", "correct, but ", "fine, but ", "yes but ", "thx but ",
             "great but ", "sure, but ")
STYLE_TAILS = ("", "", "", " next time", " from now on", " going forward", " thanks",
               ", I told you before", " for all answers", " every time", ", it's easier for me", ", I'm reading on a small screen", " ok?")

# --- preferences real people state, taught judge-side only -----------------------------------
# Six preferences beyond the tiny world's nine (town.py PREFERENCES, which its simulated users
# and the eval keep): the judge learns to name them, with a hint a real model can follow as a
# teacher context. The tiny world's replies are made to break them (`breaking_reply`).
NEW_PREFERENCES = ("one_paragraph", "answer_first", "formal", "casual", "language", "no_emoji")
STYLE_PREFERENCES = PREFERENCES + NEW_PREFERENCES
# How often a style correction names each preference: the nine keep most of their weight.
STYLE_WEIGHTS = {**{p: 1.0 for p in PREFERENCES}, **{p: 0.7 for p in NEW_PREFERENCES}}
NEW_HINTS: dict[str, str] = {
    "one_paragraph": "Write the reply as a single paragraph, with no blank lines.",
    "answer_first": "Give the answer in the first sentence, then any detail.",
    "formal": "Write in a formal, professional tone.",
    "casual": "Write in a casual, relaxed tone.",
    "language": "Reply in {language}.",  # the language the user named, in English
    "no_emoji": "Do not use emoji.",
}
OBJECTION_HINT = "Answer the question that was asked: {question}"
# Languages a user may ask for, and what some of them call their language.
LANGUAGES = ("Spanish", "French", "German", "Italian", "Portuguese", "Dutch", "Swedish",
             "Polish", "Turkish", "Greek", "Japanese", "Russian")
OWN_NAMES = {"Spanish": "español", "French": "français", "German": "Deutsch",
             "Italian": "italiano", "Portuguese": "português", "Dutch": "Nederlands"}

NEW_STYLE_MODES: dict[str, tuple[str, ...]] = {
    "one_paragraph": ("one paragraph", "a single paragraph", "a single block of text",
                      "one solid block", "one continuous paragraph", "no blank lines",
                      "no empty lines", "no paragraph breaks", "everything in one paragraph",
                      "a single chunk of text", "no gaps between the sentences"),
    "answer_first": ("the answer first", "the answer in the opening line",
                     "the bottom line first", "the main point first",
                     "the answer before any detail", "the direct answer first",
                     "the fact first, then the rest"),
    "formal": ("a formal tone", "formal language", "a professional tone",
               "professional wording", "a business tone", "formal writing",
               "a more serious, formal register", "proper formal English"),
    "casual": ("a casual tone", "casual language", "a relaxed tone", "an informal tone",
               "a chatty style", "a laid-back tone", "relaxed everyday language",
               "a conversational tone"),
    "language": ("the {language} language", "{language} text",
                 "{language} instead of English"),
    "no_emoji": ("no emoji", "zero emoji", "no smileys", "no emoticons",
                 "text without emoji", "plain words, no emoji", "no little pictures"),
}
NEW_STYLE_SENTENCES: dict[str, tuple[str, ...]] = {
    "one_paragraph": ("why all the blank lines", "stop splitting it into paragraphs",
                      "don't break it into chunks", "too many line breaks",
                      "join it all into one paragraph", "merge those into one paragraph",
                      "the gaps between sentences are annoying",
                      "keep everything together in one block",
                      "no need for separate paragraphs", "remove the empty lines",
                      "squash it into a single paragraph",
                      "it's all broken up, make it one piece",
                      "one paragraph is enough, not three",
                      "I have to scroll past the empty lines, put it in one paragraph"),
    "answer_first": ("lead with the answer", "start with the answer",
                     "put the answer at the start",
                     "skip the intro and open with the answer",
                     "don't make me read to the end for the answer",
                     "the answer should come first", "answer first, explain after",
                     "open with the actual answer", "no warm-up, start with the answer",
                     "why is the answer buried at the end",
                     "say the answer in the first line", "cut the preamble, lead with the fact",
                     "first sentence should be the answer"),
    "formal": ("too casual", "be more professional", "this is for work, keep it formal",
               "less chatty please", "tone it down, this is for a client", "drop the slang",
               "sound more professional", "no slang, write properly",
               "that's too informal for my report", "please be more formal",
               "write like it's a business letter", "keep it serious and professional",
               "too loose for a cover letter", "I need it to sound professional"),
    "casual": ("too stiff", "you sound like a robot, loosen up",
               "relax, talk to me like a friend", "less formal please", "way too formal",
               "chill out a bit", "be more laid-back", "talk normally, not like a lawyer",
               "drop the stiff tone", "less corporate please", "be more chatty",
               "sound friendlier and more relaxed", "no need to be so proper",
               "you can be casual with me"),
    "language": ("answer in {language}", "can you say that in {language}?",
                 "I only read {language}", "translate that into {language}",
                 "my English isn't great, {language} please", "write it in {language} instead",
                 "{language} please, not English", "respond in {language} from now on",
                 "could you switch to {language}?", "say it again in {language}",
                 "I'd rather read it in {language}", "all replies in {language}",
                 "put that in {language} for my grandma", "English is hard for me, use {language}"),
    "no_emoji": ("drop the emoji", "stop using emoji", "no more smileys", "scrap the emoji",
                 "the emoji are unnecessary", "why the emoji", "emojis look childish",
                 "skip the little faces", "without emoji please", "please remove the emoji",
                 "I can't stand emojis", "no emoticons in replies",
                 "take the smiley out", "the emoji breaks my spreadsheet"),
}

# --- objections ---------------------------------------------------------------------------------
# The reply answered something else (another fact, or nothing): the user objects, and often
# asks the question again (`{question}`, the question of the turn). Never a new question.
OBJECTIONS = ("that doesn't answer my question", "you didn't answer what I asked",
              "that's not my question", "you answered a different question",
              "that's beside the point", "irrelevant", "off topic", "nobody asked for that fact",
              "not what I wanted to know", "you dodged the question",
              "you missed my question", "go back and reread my question", "you drifted off topic",
              "you're answering something else", "why are you telling me that?",
              "who asked about that?", "stay on topic", "focus on my question",
              "that's a non-answer", "you skipped my actual question",
              "my question was different", "that has nothing to do with it",
              "you wandered off", "huh? I asked something else", "wrong question",
              "that's unrelated", "you ignored what I asked")
OBJECTION_RESTATES = ("{o}. {question}", "{o}. I asked: {question}",
                      "{o}. my question was: {question}", "{o} - again, {question}",
                      "{o}. once more: {question}", "{o}! {question}",
                      "{o}. let me repeat: {question}", "{o}. the question: {question}",
                      "{question} - {o}", "I asked {question} {o}")
# What a reply that answers nothing says.
NON_ANSWERS = ("I'm not sure what you mean. Could you tell me more?",
               "That's an interesting topic! There are many things to consider.",
               "As an assistant, I can help with many questions about the town.",
               "People in the town are all different, and each has their own story.",
               "Great question! Everyone has their own preferences, after all.")

# --- fact corrections -------------------------------------------------------------------------

FACT_FRAMES = ("hmm no. {fact}", "err, {fact}", "fix that: {fact}", "you mixed it up, {fact}",
               "hmm, my records say {fact}", "you've got the wrong info, {fact}",
               "that doesn't match what I know: {fact}", "not so, {fact}",
               "double-check that. {fact}", "you've confused something. {fact}",
               "{fact} You got it wrong.", "I'm certain {fact}", "I believe {fact}",
               "that's outdated, {fact}", "mistake! {fact}",
               "wrong again. {fact}", "check again, {fact}",
               "uh, that's wrong. {fact}", "you confused them. {fact}", "wait, {fact}", "sorry, but {fact}",
               "according to my notes, {fact}", "I know them well: {fact}")

# --- no verdict -------------------------------------------------------------------------------

NEUTRAL = ("brb", "one sec, checking something", "hold on", "wait a moment",
           "let me check my notes", "hmm, give me a minute", "be right back")

# --- perturbations ------------------------------------------------------------------------

_NEIGHBOURS = {"a": "sq", "e": "wr", "i": "uo", "o": "ip", "s": "ad", "t": "ry", "n": "bm",
               "r": "et", "l": "k", "h": "gj", "c": "xv", "u": "yi", "p": "o", "m": "n"}
_PLACEHOLDER = re.compile(r"(\{[a-z]+\})")


def typo(word: str, rng: random.Random) -> str:
    """One keyboard slip in a word of four letters or more: swap, drop, double or hit the
    key next to it."""
    if len(word) < 4 or not word.isalpha():
        return word
    i = rng.randrange(1, len(word) - 1)
    kind = rng.randrange(4)
    if kind == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if kind == 1:
        return word[:i] + word[i + 1:]
    if kind == 2:
        return word[:i] + word[i] + word[i:]
    near = _NEIGHBOURS.get(word[i].lower())
    return word[:i] + rng.choice(near) + word[i + 1:] if near else word


def perturb(text: str, rng: random.Random) -> str:
    """`text` as people type it: casing, typos, punctuation, emoji. Placeholders
    (`{fact}`, `{question}`) are left alone, so a stated fact keeps its spelling."""
    parts = _PLACEHOLDER.split(text)
    out = []
    for part in parts:
        if _PLACEHOLDER.fullmatch(part):
            out.append(part)
            continue
        words = part.split(" ")
        if rng.random() < 0.3:
            for _ in range(rng.choice((1, 1, 2))):
                j = rng.randrange(len(words))
                words[j] = typo(words[j], rng)
        out.append(" ".join(words))
    text = "".join(out)
    r = rng.random()
    if r < 0.35:
        text = _outside_placeholders(text, str.lower)
    elif r < 0.40:
        text = _outside_placeholders(text, str.upper)
    elif r < 0.70 and text[:1].isalpha():
        text = text[0].upper() + text[1:]
    r = rng.random()
    if text.endswith("}"):  # a filled fact or question brings its own punctuation
        pass
    elif r < 0.25:
        text = text.rstrip(".!? ") + rng.choice(("!", "!!", ".", "...", "!!!", "?!"))
    elif r < 0.40:
        text = text.rstrip(".!? ")
    if rng.random() < 0.22:
        e = rng.choice(EMOJI)
        text = f"{e} {text}" if rng.random() < 0.25 else f"{text} {e}"
    if rng.random() < 0.04:
        text = text.replace(" ", "  ", 1)
    return text


def _outside_placeholders(text: str, fn: Any) -> str:
    return "".join(p if _PLACEHOLDER.fullmatch(p) else fn(p)
                   for p in _PLACEHOLDER.split(text))


def _join(pieces: list[str], rng: random.Random) -> str:
    out = pieces[0]
    for p in pieces[1:]:
        out = out.rstrip(".!") + rng.choice((", ", ". ", "! ", " - ", " ", "!! ")) + p
    return out


def _chatter(text: str, rng: random.Random, p: float) -> str:
    if rng.random() < p:
        text = rng.choice(CHATTER_BEFORE) + text
    if rng.random() < p:
        text = text.rstrip() + rng.choice(CHATTER_AFTER)
    return text


# --- follow-up templates ------------------------------------------------------------------


def praise_template(rng: random.Random, style_pref: str | None = None) -> str:
    """1-3 pieces of thanks / approval / a sentence (and praise of `style_pref`)."""
    pools = (THANKS, APPROVAL, PRAISE_SENTENCES)
    pieces = [rng.choice(rng.choice(pools)) for _ in range(rng.choice((1, 1, 2, 2, 3)))]
    if style_pref is not None:
        pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(STYLE_PRAISE[style_pref]))
    return _chatter(_join(pieces, rng), rng, 0.15)


def move_on_template(rng: random.Random) -> str:
    """Optional praise, then the next question (`{question}`)."""
    lead = rng.choice(MOVE_ON_LEADS)
    ack = ""
    if rng.random() < 0.55:
        ack = rng.choice(APPROVAL + THANKS) + rng.choice((", ", ". ", "! ", " - ", " "))
    return _chatter(ack + lead + "{question}", rng, 0.08)


def style_template(pref: str, rng: random.Random) -> str:
    """A request or complaint about `pref`, sometimes after thanks and with a tail (a
    `language` request keeps `{language}` for the language it names)."""
    modes, sentences = ((NEW_STYLE_MODES, NEW_STYLE_SENTENCES) if pref in NEW_PREFERENCES
                        else (STYLE_MODES, STYLE_SENTENCES))
    if rng.random() < 0.5:
        core = rng.choice(STYLE_FRAMES).replace("{m}", rng.choice(modes[pref]))
    else:
        core = rng.choice(sentences[pref])
    if rng.random() < 0.6:
        core = core.rstrip("?!.") + rng.choice(STYLE_TAILS)
    if rng.random() < 0.3:
        core = rng.choice(BUT_LEADS) + core
    return _chatter(core, rng, 0.1)


def fact_template(rng: random.Random) -> str:
    return _chatter(rng.choice(FACT_FRAMES), rng, 0.08)


def objection_template(rng: random.Random) -> str:
    """The reply did not answer the question: said alone, or (mostly) with the question
    asked again (`{question}`)."""
    o = rng.choice(OBJECTIONS)
    if rng.random() < 0.65:
        o = rng.choice(OBJECTION_RESTATES).replace("{o}", o.rstrip("?!."))
    if rng.random() < 0.2:
        o = rng.choice(("ugh, ", "no, ", "hmm, ", "wait, ", "sorry, but ", "thanks, but ")) + o
    return _chatter(o, rng, 0.05)


@functools.cache
def written_lines() -> dict[tuple[str, str | None], tuple[str, ...]]:
    """The hand-written follow-ups by (kind, preference)."""
    out: dict[tuple[str, str | None], list[str]] = defaultdict(list)
    for line in WRITTEN.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out[(row["kind"], row["preference"])].append(row["text"])
    return {key: tuple(texts) for key, texts in out.items()}


def follow_up(kind: str, rng: random.Random, preference: str | None = None,
              written: float = WRITTEN_SHARE) -> str:
    """A follow-up template of `kind` (a style request names `preference`): a hand-written
    line (a share `written` of them, where there are lines of that kind and preference: none
    for objections and the new preferences) or one built from this module's lists, then
    perturbed. At `written` 0 the draws are those of the builds before the hand-written
    lines."""
    if written > 0 and (kind, preference) in written_lines() and rng.random() < written:
        return perturb(rng.choice(written_lines()[(kind, preference)]), rng)
    if kind == "style":
        assert preference is not None
        return perturb(style_template(preference, rng), rng)
    built = {"praise": praise_template, "move_on": move_on_template, "fact": fact_template,
             "objection": objection_template}
    return perturb(built[kind](rng), rng)


# --- judged turns -------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgeExample:
    """One judged turn and its targets."""

    kind: str  # praise | move_on | style | fact | objection | neutral
    preference: str | None
    template: str  # the follow-up before {question} / {fact} were filled
    request: list[Message]
    reply: Message
    next_state: list[Message]
    label: int
    hint: str | None

    @property
    def prm_target(self) -> str:
        return f"\\boxed{{{self.label}}}"

    @property
    def hint_target(self) -> str:
        return f"[HINT] {self.hint} [/HINT]" if self.hint else NO_HINT


def next_question(world: World, rng: random.Random) -> str:
    """A tiny-world question as a user would ask it next: full, or a short 'and Ada?'."""
    if rng.random() < 0.25:
        q = rng.choice(world.train)
        return rng.choice(SHORT_QUESTIONS).format(name=q.name,
                                                  attr=rng.choice(ATTR_WORDS[q.attr]))
    text = rng.choice(world.train).text
    return text.lower() if rng.random() < 0.3 else text


def styled_reply(world: World, q: Question, rng: random.Random, *,
                 violates: str | None = None, satisfies_pref: str | None = None) -> str:
    """A correct reply to `q` in a random style that violates or satisfies a preference."""
    for _ in range(200):
        text = render_reply(world, q, Style.random(rng), rng)
        if violates is not None and satisfies(violates, text):
            continue
        if satisfies_pref is not None and not satisfies(satisfies_pref, text):
            continue
        return text
    raise ValueError(f"no style found for violates={violates} satisfies={satisfies_pref}")


# Openers that put something before the answer, casual and stiff framings, and emoji: how a
# reply breaks `answer_first`, `formal`, `casual` and `no_emoji`.
PREAMBLES = ("Good question!", "Sure, let me think about {name} for a moment.",
             "Ah, {name}, what a lovely person.", "Happy to tell you about {name}.",
             "Well, {name} is quite well known in town.", "Let me see what I know here.",
             "That is something many people wonder about.", "Oh, {name}? I know them.")
CASUAL_OPENERS = ("Hey! ", "Oh, easy one! ", "So yeah, ", "Haha, ", "Ooh, fun one! ",
                  "Okay so, ")
CASUAL_CLOSERS = (" Pretty cool, right?", " Awesome, huh?", " Fun, isn't it?", " Lol.",
                  " Gotta love it!", " How cool is that?")
FORMAL_OPENERS = ("According to the available records, ", "Regarding your inquiry: ",
                  "Per the information available, ", "To answer your question precisely: ")
FORMAL_CLOSERS = (" Please do not hesitate to ask further questions.",
                  " I trust this information is satisfactory.",
                  " Should you require further details, please ask.")
REPLY_EMOJI = ("😊", "🙂", "🎉", "✨", "👍", "🌍", "🏠", "🐾", "🍽️", "🎨", "☀️", "😄")


def _facts(world: World, q: Question, rng: random.Random, extra: int = 2) -> list[str]:
    """The answer to `q`, then `extra` other true facts about the same person."""
    facts = world.facts[q.name]
    others = rng.sample([a for a in facts if a != q.attr], extra)
    return [rng.choice(ANSWERS[a]).format(name=q.name, value=facts[a]) for a in (q.attr, *others)]


def breaking_reply(world: World, q: Question, rng: random.Random, pref: str) -> str:
    """A correct reply to `q` that breaks `pref`, one of NEW_PREFERENCES."""
    if pref == "language":  # every tiny-world reply is English
        return render_reply(world, q, Style.random(rng), rng)
    if pref == "one_paragraph":  # its facts in paragraphs apart, or a list
        if rng.random() < 0.3:
            return render_reply(world, q, Style(rng.choice(CASES), "list", None), rng)
        body = "\n\n".join(_facts(world, q, rng, rng.choice((1, 2))))
        if rng.random() < 0.3:
            body += "\n\n" + rng.choice(SIGNOFFS)
        return body.lower() if rng.random() < 0.2 else body
    if pref == "answer_first":  # filler first, or other facts before the answer
        main, *others = _facts(world, q, rng)
        head = rng.choice(PREAMBLES).format(name=q.name)
        parts = [head, *others, main] if rng.random() < 0.4 else [head, main, *others[:1]]
        return " ".join(parts)
    if pref == "formal":  # chatty: exclamations, contractions, slang
        main, *others = _facts(world, q, rng, rng.choice((0, 1)))
        text = rng.choice(CASUAL_OPENERS) + " ".join([main, *others])
        return text + rng.choice(CASUAL_CLOSERS) if rng.random() < 0.7 else text[:-1] + "!"
    if pref == "casual":  # stiff: no contractions, no exclamation marks
        main, *others = _facts(world, q, rng, rng.choice((0, 1)))
        text = rng.choice(FORMAL_OPENERS) + main[0].lower() + main[1:]
        text = " ".join([text, *others])
        return text + rng.choice(FORMAL_CLOSERS) if rng.random() < 0.6 else text
    if pref == "no_emoji":
        text = render_reply(world, q, Style.random(rng), rng)
        e = rng.choice(REPLY_EMOJI)
        if rng.random() < 0.5:
            return f"{text} {e}"
        return text.replace(".", f" {e}.", 1) if "." in text else f"{e} {text}"
    raise ValueError(f"unknown new preference {pref!r}")


def shaped_reply(world: World, q: Question, rng: random.Random) -> str:
    """A correct reply in one of the shapes the new preferences complain about, for praise
    and moving on: so blank lines, an emoji or a tone are not read as a correction alone."""
    return breaking_reply(world, q, rng, rng.choice(NEW_PREFERENCES[:4] + ("no_emoji",)))


def style_hint(pref: str, language: str | None = None) -> str:
    """The canonical hint for a style correction naming `pref` (`language`: the one named)."""
    if pref in NEW_HINTS:
        return NEW_HINTS[pref].replace("{language}", language or "")
    return HINTS[pref][0]


_LANGUAGE_HINT = re.compile(r"reply in ([a-z]+)\.", re.IGNORECASE)


def hint_preference(hint: str | None) -> str | None:
    """The preference whose canonical hint `hint` is (case and spacing ignored; any of a
    tiny-world preference's wordings), or None."""
    if hint is None:
        return None
    norm = " ".join(hint.lower().split())
    for pref, wordings in HINTS.items():
        if norm in {" ".join(w.lower().split()) for w in wordings}:
            return pref
    for pref, wording in NEW_HINTS.items():
        if pref != "language" and norm == " ".join(wording.lower().split()):
            return pref
    m = _LANGUAGE_HINT.fullmatch(norm)
    return "language" if m and m.group(1).capitalize() in LANGUAGES else None


def _language(rng: random.Random) -> tuple[str, str]:
    """A language (its English name) and how the user writes it."""
    language = rng.choice(LANGUAGES)
    said = language
    if language in OWN_NAMES and rng.random() < 0.2:
        said = OWN_NAMES[language]
    elif rng.random() < 0.3:
        said = language.lower()
    return language, said


def _restated(q: Question, rng: random.Random) -> str:
    """The question of the turn as a user asks it again."""
    text = q.text
    r = rng.random()
    if r < 0.3:
        return text.lower()
    if r < 0.45:
        return text.rstrip("?.")
    return text


def make_example(world: World, rng: random.Random, kind: str,
                 written: float = WRITTEN_SHARE, extended: bool = True) -> JudgeExample:
    """One judged turn of `kind`, on the tiny world `world` (`written`: `follow_up`'s;
    `extended` False: the builds before 2026-12-08, draw for draw — the nine preferences, no
    new reply shapes)."""
    request: list[Message] = []
    if rng.random() < 0.1:
        request.append({"role": "system", "content": "You are a helpful assistant."})
    if rng.random() < 0.25:  # an earlier exchange in the context
        first = rng.choice(world.train)
        request += [{"role": "user", "content": first.text},
                    {"role": "assistant", "content": render_reply(
                        world, first, Style.random(rng), rng)}]
    q = rng.choice(world.train)
    request.append({"role": "user", "content": q.text})
    preference: str | None = None
    hint: str | None = None
    if kind == "fact":
        reply = render_reply(wrong_world(world, q, rng), q, Style.random(rng), rng)
        fact = fact_sentence(world, q, rng)
        if rng.random() < 0.3:
            fact = fact[0].lower() + fact[1:] if rng.random() < 0.5 else fact.rstrip(".")
        template = follow_up(kind, rng, written=written)
        text = template.replace("{fact}", fact)
        hint = FACT_HINT.format(fact=fact)
    elif kind == "style" and not extended:
        preference = rng.choice(PREFERENCES)
        reply = styled_reply(world, q, rng, violates=preference)
        template = follow_up(kind, rng, preference, written)
        text = template
        hint = HINTS[preference][0]
    elif kind == "style":
        preference = rng.choices(list(STYLE_WEIGHTS), list(STYLE_WEIGHTS.values()))[0]
        if preference in NEW_PREFERENCES:
            reply = breaking_reply(world, q, rng, preference)
        else:
            reply = styled_reply(world, q, rng, violates=preference)
        template = follow_up(kind, rng, preference, written)
        language, said = _language(rng) if preference == "language" else (None, "")
        text = template.replace("{language}", said)
        hint = style_hint(preference, language)
    elif kind == "praise":
        praised = rng.choice(PREFERENCES) if rng.random() < 0.12 else None
        if extended and not praised and rng.random() < 0.15:
            reply = shaped_reply(world, q, rng)
        else:
            reply = styled_reply(world, q, rng, satisfies_pref=praised)
        template = (perturb(praise_template(rng, praised), rng) if praised
                    else follow_up(kind, rng, written=written))
        text = template
    elif kind == "move_on":
        if extended and rng.random() < 0.15:
            reply = shaped_reply(world, q, rng)
        else:
            reply = render_reply(world, q, Style.random(rng), rng)
        template = follow_up(kind, rng, written=written)
        nxt = next_question(world, rng)
        while extended and _asks_again(world, nxt, q):
            nxt = next_question(world, rng)
        text = template.replace("{question}", nxt)
    elif kind == "objection":  # another fact about someone, or no answer at all
        if rng.random() < 0.75:
            for _ in range(100):  # its other facts must not answer `q` after all
                other = _other_question(world, q, rng)
                reply = render_reply(world, other, Style.random(rng), rng)
                if not is_correct(world, q, reply):
                    break
        else:
            reply = rng.choice(NON_ANSWERS)
        template = follow_up(kind, rng, written=written)
        asked = _restated(q, rng)
        text = template.replace("{question}", asked)
        hint = OBJECTION_HINT.format(question=asked if "{question}" in template else q.text)
    elif kind == "neutral":
        reply = render_reply(world, q, Style.random(rng), rng)
        template = perturb(rng.choice(NEUTRAL), rng)
        text = template
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return JudgeExample(kind, preference, template, request,
                        {"role": "assistant", "content": reply},
                        [{"role": "user", "content": text}], LABELS[kind], hint)


def _asks_again(world: World, text: str, q: Question) -> bool:
    """Whether a next question `text` is `q` again, or a short one about `q`'s person ("and
    Ada?"): a moving-on line never asks the judged question again (an objection does)."""
    if text.lower() == q.text.lower():
        return True
    full = {t.text.lower() for t in world.train if t.name == q.name}
    return q.name.lower() in text.lower() and text.lower() not in full


def _other_question(world: World, q: Question, rng: random.Random) -> Question:
    """A question the reply answers instead of `q`: another attribute (mostly) or person."""
    if rng.random() < 0.7:
        return Question(q.name, rng.choice([a for a in world.facts[q.name] if a != q.attr]), 0)
    return Question(rng.choice([n for n in world.facts if n != q.name]), q.attr, 0)


def iter_examples(seed: int = 0, world_seed: int = 0,
                  written: float = WRITTEN_SHARE) -> Iterator[JudgeExample]:
    """An endless reproducible stream of judged turns, kinds drawn by MIX (`written`: the
    share of follow-ups from the hand-written lines). At `written` 0 the stream is the
    builds' before the hand-written lines, draw for draw (LEGACY_MIX, the nine preferences,
    no objections)."""
    world = World.build(world_seed)
    rng = random.Random(f"judge-synth-{seed}")
    extended = written > 0
    mix = MIX if extended else LEGACY_MIX
    kinds, weights = list(mix), list(mix.values())
    while True:
        yield make_example(world, rng, rng.choices(kinds, weights)[0], written, extended)


def training_set(n: int, seed: int = 0, written: float = WRITTEN_SHARE) -> list[JudgeExample]:
    """The first `n` examples of the stream: what `clawrl judge build` trains on."""
    stream = iter_examples(seed, written=written)
    return [next(stream) for _ in range(n)]


def normalize(text: str) -> str:
    """Lowercase, letters/digits/placeholders only, single spaces: for disjointness checks."""
    return " ".join(re.sub(r"[^a-z0-9{}' ]+", " ", text.lower()).split())


# --- agent turns ----------------------------------------------------------------------------
# An agent's step is judged by what came back, beside what it was asked and what it called
# (prompt v5's `[STEP]` block, judge/prompts.py `render_step`): the result of the call the
# question needed (progress: +1), the result of a call about something else — another
# attribute, another person — (−1: true, but not what was asked), a tool's error (−1), or
# the user telling it to use its tools (−1). No hint: the policy has no canonical wording for
# these. The results are written in several shapes (a sentence, a key/value line, JSON, a
# shell's exit code and output) so the judge learns "the tool answered what was asked"
# rather than one environment's format; a right and a wrong call come back in the same
# shapes, so only the step tells them apart.

AGENT_MIX = {"tool_ok": 0.35, "tool_wrong": 0.35, "tool_error": 0.15, "nudge": 0.15}
AGENT_LABELS = {"tool_ok": 1, "tool_wrong": -1, "tool_error": -1, "nudge": -1}
TOOL_ERRORS = (
    "error: no person named {name!r} in the records", "error: unknown attribute {attr!r}",
    "error: the arguments are not a JSON object", "error: unknown tool {tool!r}",
    "Error: not found", "ERROR: missing required argument 'person'",
    '{{"error": "not found", "code": 404}}', "exit code 127\nsh: 1: {tool}: not found",
    "exit code 1\ncat: notes.txt: No such file or directory", "Traceback (most recent call "
    "last):\n  ...\nKeyError: {attr!r}", "permission denied", "timeout after 10 s",
    "error: invalid value for attribute", "no results", "failed: rate limited, try again",
)
NUDGES = (
    "Please use the tools: lookup(person, attribute), then answer(text).",
    "No command ran. Call the run tool with a shell command to do the task.",
    "use the lookup tool first", "you have to call a tool, not just answer",
    "don't guess, look it up with the tool", "call answer() with your final answer",
    "that's not a tool call. try again with the tool", "run the command, please",
    "You must use the provided functions.", "check the records before answering",
)
TOOL_NAMES = ("search", "get_user", "fetch", "grep", "calc", "weather")


def tool_result(world: World, q: Question, rng: random.Random) -> str:
    """A successful tool result about `q`'s person, in one of several shapes."""
    value = world.facts[q.name][q.attr]
    shape = rng.randrange(6)
    if shape == 0:
        return fact_sentence(world, q, rng)
    if shape == 1:
        return f"{q.attr}: {value}"
    if shape == 2:
        return (f'{{"person": "{q.name}", "attribute": "{q.attr}", "value": "{value}"}}')
    if shape == 3:
        return f"exit code 0\n{value}"
    if shape == 4:
        return f"found 1 record: {q.name}, {q.attr} = {value}"
    return f'{{"result": "{value}", "ok": true}}'


def _lookup_call(person: str, attribute: str, rng: random.Random) -> Message:
    """A lookup call, its arguments a JSON string as an engine records them, or an object."""
    args: Any = {"person": person, "attribute": attribute}
    if rng.random() < 0.7:
        args = json.dumps(args)
    return {"id": "call_0", "type": "function",
            "function": {"name": "lookup", "arguments": args}}


def _wrong_target(world: World, q: Question, rng: random.Random) -> Question:
    """The same question about another attribute (mostly) or another person."""
    if rng.random() < 0.7:
        attr = rng.choice([a for a in world.facts[q.name] if a != q.attr])
        return Question(q.name, attr, 0)
    return Question(rng.choice([n for n in world.facts if n != q.name]), q.attr, 0)


def agent_example(world: World, rng: random.Random, kind: str,
                  questions: tuple[Question, ...]) -> JudgeExample:
    """One judged agent step of `kind` (AGENT_MIX) on `world`, about one of `questions`."""
    q = rng.choice(questions)
    asked = q.text.lower() if rng.random() < 0.2 else q.text
    request: list[Message] = [{"role": "user", "content": asked}]
    if rng.random() < 0.15:  # the agent first answered in text and was told to use the tools
        request += [{"role": "assistant", "content": render_reply(world, q, Style.random(rng),
                                                                  rng)},
                    {"role": "user", "content": rng.choice(NUDGES)}]
    called = _wrong_target(world, q, rng) if kind == "tool_wrong" else q
    reply: Message = {"role": "assistant", "content": "",
                      "tool_calls": [_lookup_call(called.name, called.attr, rng)]}
    if kind in ("tool_ok", "tool_wrong"):
        text = tool_result(world, called, rng)
        next_state: list[Message] = [{"role": "tool", "tool_call_id": "call_0",
                                      "content": text}]
    elif kind == "tool_error":
        text = rng.choice(TOOL_ERRORS).format(name=q.name.lower() + "x", attr=q.attr + "s",
                                              tool=rng.choice(TOOL_NAMES))
        next_state = [{"role": "tool", "tool_call_id": "call_0", "content": text}]
    elif kind == "nudge":
        reply = {"role": "assistant", "content": render_reply(world, q, Style.random(rng),
                                                               rng)}
        text = perturb(rng.choice(NUDGES), rng) if rng.random() < 0.5 else rng.choice(NUDGES)
        next_state = [{"role": "user", "content": text}]
    else:
        raise ValueError(f"unknown agent kind {kind!r}")
    return JudgeExample(kind, None, text, request, reply, next_state, AGENT_LABELS[kind],
                        None)


def agent_set(n: int, seed: int = 0, world_seed: int = 0,
              heldout: bool = False) -> list[JudgeExample]:
    """`n` judged agent steps, kinds drawn by AGENT_MIX (a stream of its own); `heldout`:
    about the world's held-out questions (phrasings of a person's fact no build trains on)."""
    world = World.build(world_seed)
    rng = random.Random(f"judge-agent-{seed}")
    kinds, weights = list(AGENT_MIX), list(AGENT_MIX.values())
    questions = world.heldout if heldout else world.train
    return [agent_example(world, rng, rng.choices(kinds, weights)[0], questions)
            for _ in range(n)]

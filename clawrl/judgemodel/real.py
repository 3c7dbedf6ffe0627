"""The judge on real replies: `clawrl judge evaluate --real`.

A second held-out set (data/README.md, "Real replies"), written apart from the judge's
training phrasings: everyday questions (`data/heldout_real_questions.jsonl`), SmolLM2-135M-
Instruct's own replies to them, sampled as the policy is served (`data/heldout_real_replies.jsonl`:
temperature 0.2, top_p 0.9, max_tokens 128, from the model folder's generation_config.json;
a reply the length limit cut off is kept as it is), and follow-ups a person would type after
such a reply (`data/heldout_real.jsonl`). The judged turns (`data/heldout_real_turns.jsonl`)
pair each follow-up with a reply, and a style correction only with a reply that breaks the
preference it asks for (`breaks`); a follow-up no reply fits is left out. All four files are
stored, so an evaluation reads them and samples nothing.

Rule: nothing trains or tunes on these files (the judge, its prompts, thresholds, hints).

    python -m clawrl.judgemodel.real sample --model DIR   # the replies (once; ~10 min nice'd)
    python -m clawrl.judgemodel.real pair                 # the turns, from the three files
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = DATA / "heldout_real_questions.jsonl"
REPLIES = DATA / "heldout_real_replies.jsonl"
FOLLOWUPS = DATA / "heldout_real.jsonl"
TURNS = DATA / "heldout_real_turns.jsonl"
SAMPLES = 3  # replies per question
MAX_TOKENS = 128  # the everyday chats' limit (clawrl/eval/everyday.py CHAT_MAX_TOKENS)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")


def sampling_defaults(model: Path) -> dict[str, float]:
    """The served sampling: temperature and top_p from the model's generation_config.json."""
    cfg = json.loads((model / "generation_config.json").read_text(encoding="utf-8"))
    return {"temperature": float(cfg["temperature"]), "top_p": float(cfg["top_p"])}


async def _sample(url: str, questions: list[dict[str, Any]],
                  sampling: dict[str, float]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=1800) as client:
        async def one(q: dict[str, Any], k: int) -> dict[str, Any]:
            seed = 1000 * k + int(q["id"][1:])
            body = {"model": "policy", "messages": [{"role": "user", "content": q["text"]}],
                    "max_tokens": MAX_TOKENS, "seed": seed, **sampling}
            r = await client.post(f"{url}/chat/completions", json=body)
            r.raise_for_status()
            choice = r.json()["choices"][0]
            return {"question": q["id"], "sample": k, "seed": seed,
                    "reply": choice["message"]["content"],
                    "finish_reason": choice["finish_reason"]}
        jobs = [one(q, k) for q in questions for k in range(SAMPLES)]
        return list(await asyncio.gather(*jobs))


def sample(model: Path, port: int, threads: int) -> list[dict[str, Any]]:
    """SmolLM2's replies to the questions, `SAMPLES` each, through the embedded engine."""
    from clawrl.judgemodel.evaluate import start_engine

    questions = read_jsonl(QUESTIONS)
    log = Path(tempfile.gettempdir()) / "judge-real-sample-engine.log"
    proc = start_engine(model, port, threads, log, "float32", speculative=False)
    try:
        rows = asyncio.run(_sample(f"http://127.0.0.1:{port}/v1", questions,
                                   sampling_defaults(model)))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return [{**r, **sampling_defaults(model), "max_tokens": MAX_TOKENS} for r in rows]


# --- which reply a follow-up may follow --------------------------------------------------------
# The judge's nine preferences where the tiny world's checks fit a real reply (town.py
# `satisfies`), and plain checks for the rest. A style correction follows only a reply that
# breaks what it asks for.
KNOWN = ("lowercase", "uppercase", "normal_case", "brief", "detailed", "no_lists", "lists",
         "no_signoff", "signoff")
NEW = ("one_paragraph", "no_emoji", "answer_first", "formal", "casual", "language")
DETAILED_MIN_WORDS = 60  # a reply under this many words (and without a list) is "thin"
_EMOJI = re.compile("[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B50\u2B55\u203C\u2049]")
# A friendly closing line: the last sentence opens with one (wider than town.py's, which knows
# the tiny world's replies).
_SIGNOFF = re.compile(
    r"^\W*(?:i |we )?(?:hope (?:this|that|it|these|you)\b|let me know|good luck|best of luck|"
    r"enjoy\b[^.?]*!|take care|cheers|happy \w+!|have a (?:good|nice|great|wonderful|lovely|"
    r"fantastic) |feel free to|(?:best|warm|kind)(?:est)? (?:regards|wishes)|all the best|"
    r"thanks for (?:asking|reading)|i'm here to help|happy to help)", re.IGNORECASE)
# Marks of a casual reply: contractions, exclamation marks, emoji, chatty words.
_CASUAL = re.compile(r"n't\b|'(?:re|ll|ve|m|d)\b|\blet's\b|!|\b(?:hey|hi|awesome|super|gonna|"
                     r"wanna|cool|yay|lol)\b", re.IGNORECASE)
# The first sentence of a reply that opens with something other than the answer.
_PREAMBLE = re.compile(
    r"^\W*(?:great|good|excellent|what a|sure|certainly|absolutely|of course|ah|oh|hi|hello|hey|"
    r"as an?|i'm|i am|i'd|i would|i can|when it comes|it's (?:important|great|essential|"
    r"crucial)|it is (?:important|essential|crucial)|there are|here(?:'s| is| are)|"
    r"let's|let me|you(?:'re| are) (?:asking|looking|wondering)|the (?:question|answer to)|"
    r"the (?:eternal|dreaded|age-old|magic|art)\b|while\b|thank)", re.IGNORECASE)
_ENGLISH = re.compile(r"\b(?:the|and|to|you|is|of|your|for|it|a)\b", re.IGNORECASE)


def plain(text: str) -> str:
    """Lowercase, without spaces: for finding a stated value in a reply or a hint."""
    return "".join(text.lower().split())


def has_signoff(text: str) -> bool:
    from clawrl.world.town import has_signoff as town_signoff

    last = re.split(r"(?<=[.!?])\s+|\n+", text.strip())[-1]
    return town_signoff(text) or bool(_SIGNOFF.match(last))


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?:])\s+|\n+", text.strip(), maxsplit=1)[0]


def breaks(pref: str, reply: str, language: str | None = None,
           value: str | None = None) -> bool:
    """Whether a reply breaks the preference a style correction asks for (so the
    correction fits after it). `answer_first`: the first sentence does not hold the question's
    short true answer (`value`, where the question has one) nor any number, or it opens with a
    preamble ("Great question!", "When it comes to…", "There are several…", "While…")."""
    from clawrl.world.town import has_list, satisfies

    words = len(reply.split())
    if pref in ("lowercase", "uppercase", "normal_case", "brief", "no_lists", "lists"):
        return bool(reply.strip()) and not satisfies(pref, reply)
    if pref == "detailed":
        return words < DETAILED_MIN_WORDS and not has_list(reply)
    if pref == "no_signoff":
        return has_signoff(reply)
    if pref == "signoff":
        return not has_signoff(reply)
    if pref == "one_paragraph":
        return len([b for b in reply.strip().split("\n") if b.strip()]) > 1
    if pref == "no_emoji":
        return bool(_EMOJI.search(reply))
    if pref == "answer_first":
        first = first_sentence(reply)
        return bool(_PREAMBLE.search(first)) or (
            value is not None and plain(value) not in plain(first)
            and not re.search(r"\d", first))
    if pref == "formal":
        return bool(_CASUAL.search(reply))
    if pref == "casual":
        return not _CASUAL.search(reply)
    if pref == "language":
        return len(_ENGLISH.findall(reply)) >= 3  # the reply is in English
    raise ValueError(f"unknown preference {pref!r}")


def pair(followups: list[dict[str, Any]], questions: list[dict[str, Any]],
         replies: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Each follow-up after one stored reply, drawn (seeded) among the replies it fits: a
    style correction after a reply that `breaks` its preference, a fact correction after a
    reply to its question that lacks the value it states, anything else after any reply; a
    moving-on line names another question of the set. A follow-up no reply fits is left out.
    Turn: the follow-up's index (`row`), the reply's (`reply`), the text the judge reads."""
    rng = random.Random(f"heldout-real-{seed}")
    by_q = {q["id"]: q for q in questions}
    turns = []
    for i, row in enumerate(followups):
        if row["kind"] == "style":
            fits = [j for j, r in enumerate(replies)
                    if breaks(row["preference"], r["reply"], row.get("language"),
                              by_q[r["question"]]["value"])]
        elif row["kind"] == "fact":
            value = plain(by_q[row["question"]]["value"])
            fits = [j for j, r in enumerate(replies)
                    if r["question"] == row["question"] and value not in plain(r["reply"])]
        else:
            fits = list(range(len(replies)))
        if not fits:
            continue
        j = rng.choice(fits)
        turn: dict[str, Any] = {"row": i, "reply": j}
        text = row["text"]
        if "{question}" in text:
            others = [q for q in questions if q["id"] != replies[j]["question"]]
            nxt = rng.choice(others)["text"]
            turn["next_question"] = nxt
            text = text.replace("{question}", nxt)
        turn["text"] = text
        turns.append(turn)
    return turns


# --- evaluation ---------------------------------------------------------------------------------
# A right hint: for the judge's nine preferences its canonical hint (as on the tiny-world set,
# synth.py `hint_preference`); for a preference it was never taught, a hint that names it
# (these words, case ignored; the language by its English or own name).
NAMES = {
    "one_paragraph": r"paragraph|line breaks?|one block",
    "no_emoji": r"emoji|smil",
    "answer_first": r"(?:answer|point|conclusion|bottom line)\b.*\b(?:first|start|begin|top|up "
                    r"front|lead)|\b(?:first|start|begin|lead)\w*\b.*\b(?:answer|point)|"
                    r"directly|straight",
    "formal": r"(?<!in)formal|professional|business",
    "casual": r"casual|informal|relaxed|conversational|chatty|chill",
}
LANGUAGE_NAMES = {"Spanish": r"spanish|español|espanol", "French": r"french|français|francais",
                  "German": r"german|deutsch"}


def right_hint(preference: str, hint: str | None, language: str | None = None) -> bool:
    from clawrl.judgemodel.synth import hint_preference

    if hint is None:
        return False
    if preference in KNOWN:
        return hint_preference(hint) == preference
    pattern = LANGUAGE_NAMES[language or ""] if preference == "language" else NAMES[preference]
    return re.search(pattern, hint, re.IGNORECASE) is not None


def real_cases(limit: int | None = None, seed: int = 0) -> list[Any]:
    """The stored turns as evaluate.py `Case`s: (question, SmolLM2's reply, follow-up), a
    stratified sample of `limit` of them by kind (all when None)."""
    from clawrl.judgemodel.evaluate import Case, stratified

    followups, questions, replies = (read_jsonl(FOLLOWUPS), read_jsonl(QUESTIONS),
                                     read_jsonl(REPLIES))
    by_q = {q["id"]: q for q in questions}
    rows = []
    for t in read_jsonl(TURNS):
        reply = replies[t["reply"]]
        row = {**followups[t["row"]], "turn": t, "question": reply["question"],
               "finish_reason": reply["finish_reason"]}
        rows.append(row)
    cases = []
    for row in stratified(rows, limit, seed):
        t, reply = row["turn"], replies[row["turn"]["reply"]]
        expected = 1 if row["label"] == "praise" else -1
        value = by_q[row["question"]]["value"] if row["kind"] == "fact" else None
        cases.append(Case({k: v for k, v in row.items() if k != "turn"},
                          [{"role": "user", "content": by_q[reply["question"]]["text"]}],
                          {"role": "assistant", "content": reply["reply"]},
                          [{"role": "user", "content": t["text"]}], expected, value))
    return cases


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """PRM agreement (overall, per label, per kind, on replies cut off by the length limit and
    on whole ones), right hints on style corrections (all; the judge's nine preferences; the
    rest; per preference), the stated value in fact hints, any hint on objections and on
    praise, seconds per turn."""
    from clawrl.judgemodel.evaluate import rate
    from clawrl.judgemodel.evaluate import summarize as tiny_summary

    agree = lambda r: r["reward"] == r["expected"]  # noqa: E731
    right = lambda r: right_hint(r["preference"], r["hint"], r.get("language"))  # noqa: E731
    style = [r for r in results if r["kind"] == "style"]
    base = tiny_summary(results)
    prefs = sorted({r["preference"] for r in style}, key=lambda p: (p not in KNOWN, p))
    return {
        **{k: base[k] for k in ("prm", "prm_praise", "prm_correction", "prm_by_kind",
                                "praise_hint", "p50_s", "p90_s")},
        "prm_cut_off": rate([r for r in results if r.get("finish_reason") == "length"], agree),
        "prm_whole": rate([r for r in results if r.get("finish_reason") != "length"], agree),
        "style_hint": rate(style, right),
        "style_hint_known": rate([r for r in style if r["preference"] in KNOWN], right),
        "style_hint_new": rate([r for r in style if r["preference"] not in KNOWN], right),
        "style_any_hint": rate(style, lambda r: r["hint"] is not None),
        "by_preference": {p: {"prm": rate(group, agree), "hint": rate(group, right),
                              "any_hint": rate(group, lambda r: r["hint"] is not None)}
                          for p in prefs
                          for group in [[r for r in style if r["preference"] == p]]},
        "fact_hint": rate([r for r in results if r["kind"] == "fact"],
                          lambda r: r["hint"] is not None
                          and plain(r["value"] or "") in plain(r["hint"])),
        "objection_any_hint": rate([r for r in results if r["kind"] == "objection"],
                                   lambda r: r["hint"] is not None),
    }


def evaluate_real(state_dir: Path, *, limit: int | None = None, seed: int = 0,
                  threads: int = 1, speculative: bool = True, **judged: Any) -> dict[str, Any]:
    """`clawrl judge evaluate --real`: the real-replies set judged as `evaluate` judges the
    held-out set (`judge_cases`: votes, port, dtype, adapter, overrides)."""
    from clawrl.engine.runtime import resolve_dtype
    from clawrl.judgemodel.evaluate import TARGETS, judge_cases
    from clawrl.judgemodel.model import JUDGE_DTYPE

    cases = real_cases(limit, seed)
    results, how = judge_cases(state_dir, cases, threads=threads, speculative=speculative,
                               **judged)
    dtype = judged.get("dtype") or JUDGE_DTYPE
    return {"set": "heldout_real", "rows": len(cases), "settings": how, "threads": threads,
            "dtype": str(resolve_dtype(dtype, "cpu")).removeprefix("torch."),
            "speculative": speculative, "summary": summarize(results),
            "targets": TARGETS, "results": results,
            "misses": [r for r in results if r["reward"] != r["expected"]
                       or (r["kind"] == "style" and not right_hint(
                           r["preference"], r["hint"], r.get("language")))]}


def print_report(report: dict[str, Any]) -> None:
    s = report["summary"]
    how = report["settings"]
    print(f"{report['set']} turns judged: {report['rows']}  (SmolLM2-135M-Instruct's replies; "
          f"PRM {how['prm_mode']} with {how['votes']} votes, {how['hint_votes']} hint votes, "
          f"engine threads {report['threads']}, {report['dtype']}"
          f"{', n-gram drafts' if report.get('speculative') else ''})")

    def line(name: str, cell: dict[str, Any], target: str = "") -> None:
        print(f"  {name:<32} {cell['hits']:>4}/{cell['n']:<4} {cell['rate']}"
              f"{'   target ' + target if target else ''}")

    line("PRM agreement", s["prm"], ">= 0.95")
    line("  praise / moving on", s["prm_praise"], ">= 0.93")
    line("  corrections", s["prm_correction"], ">= 0.93")
    for kind, cell in s["prm_by_kind"].items():
        line(f"    {kind}", cell)
    line("  reply cut off at max_tokens", s["prm_cut_off"])
    line("  reply ended by itself", s["prm_whole"])
    line("right hint, style", s["style_hint"], ">= 0.90")
    line("  the judge's nine (canonical)", s["style_hint_known"])
    line("  others (hint names it)", s["style_hint_new"])
    line("any hint, style", s["style_any_hint"])
    for pref, cells in s["by_preference"].items():
        print(f"    {pref:<16} PRM {cells['prm']['hits']:>2}/{cells['prm']['n']:<3} right hint "
              f"{cells['hint']['hits']:>2}/{cells['hint']['n']:<3} any hint "
              f"{cells['any_hint']['hits']:>2}/{cells['any_hint']['n']}")
    line("stated value in hint, fact", s["fact_hint"])
    line("any hint, objection", s["objection_any_hint"])
    line("hint on praise", s["praise_hint"], "<= 0.05")
    print(f"  seconds per turn                 p50 {s['p50_s']}  p90 {s['p90_s']}   "
          "target p50 <= 1.0")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m clawrl.judgemodel.real")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample", help="sample the policy's replies into " + REPLIES.name)
    s.add_argument("--model", type=Path, required=True, help="SmolLM2-135M-Instruct's folder")
    s.add_argument("--port", type=int, default=30171)
    s.add_argument("--threads", type=int, default=1)
    sub.add_parser("pair", help="pair follow-ups with replies into " + TURNS.name)
    args = p.parse_args(argv)
    if args.cmd == "sample":
        rows = sample(args.model, args.port, args.threads)
        write_jsonl(REPLIES, rows)
        print(f"{len(rows)} replies -> {REPLIES}")
        return 0
    turns = pair(read_jsonl(FOLLOWUPS), read_jsonl(QUESTIONS), read_jsonl(REPLIES))
    write_jsonl(TURNS, turns)
    print(f"{len(turns)} turns -> {TURNS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`clawrl judge evaluate`: the judge model on the held-out follow-ups, through the real path.

The merged judge (`<state_dir>/models/judge`) is served by the embedded engine
(`clawrl engine`, a subprocess, over HTTP), and every turn is judged by the judge worker's
own code, `judge.judgment.cast_votes` through `judge.backends.ChatBackend`, as
`judge.judgment.run_judges` calls it, with the judge model's settings
(`judge.config.JUDGE_MODEL_SETTINGS`: prompt v5, one greedy answer per turn).

The held-out set (`data/heldout.jsonl`, written apart from the training phrasings) is read
here and nowhere else. `--real` judges the real-replies set instead (clawrl/judgemodel/real.py:
everyday questions, SmolLM2-135M-Instruct's stored replies, follow-ups written apart). Each row (kind, label, preference, text with `{question}` / `{fact}`)
becomes a turn in the tiny world: a question, a reply that violates the row's preference
(style corrections), states a wrong fact (fact corrections; `{fact}` is the true one) or is
any correct reply (praise, moving on; `{question}` is the next tiny-world question).

Figures: PRM agreement (majority of the votes == +1 for praise, -1 for corrections; an
abstention counts as a miss) overall and per label and kind; the canonical hint for the
row's preference on style corrections (the hint must be one of `HINTS[pref]`, word for word
up to case and spacing); the true value in the hint of fact corrections; a hint on praise;
seconds per turn (PRM and hint votes together, as the worker runs them), p50 and p90.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from clawrl.base.signals import die_with_parent
from clawrl.engine.runtime import resolve_dtype
from clawrl.judgemodel.build import BuildConfig
from clawrl.judgemodel.model import (
    ADAPTER_DIR,
    JUDGE_DTYPE,
    SPECULATIVE_FLAGS,
    ensure_judge_model,
)
from clawrl.judgemodel.synth import (
    LABELS,
    agent_set,
    hint_preference,
    iter_examples,
    normalize,
    styled_reply,
    training_set,
)
from clawrl.world.town import HINTS, Style, World, fact_sentence, render_reply, wrong_world
from judge.backends import ChatBackend, http_client
from judge.config import JUDGE_MODEL_SETTINGS, JudgeSettings
from judge.judgment import cast_votes
from judge.prompts import render_fields

HELDOUT = Path(__file__).resolve().parent / "data" / "heldout.jsonl"
# Follow-ups for choices, in the held-out set's format, written by a third author
# (data/README.md): what a build is checked on before the held-out set is read once.
DEV_ROWS = Path(__file__).resolve().parent / "data" / "dev_followups.jsonl"
DEV_SEED = 7919  # the dev stream's seed; builds train on seed 0
TARGETS = {"prm": 0.95, "prm_praise": 0.93, "prm_correction": 0.93, "style_hint": 0.90,
           "praise_hint_max": 0.05, "p50_s_max": 1.0}


@dataclass(frozen=True)
class Case:
    row: dict[str, Any]
    request: list[dict[str, Any]]
    reply: dict[str, Any]
    next_state: list[dict[str, Any]]
    expected: int
    value: str | None  # the true value a fact hint must state


# A row's label by its kind (the synthetic set's, less `neutral`, which carries no verdict).
KINDS = {kind: "praise" if v == 1 else "correction" for kind, v in LABELS.items() if v != 0}
PLACEHOLDERS = {"move_on": "{question}", "fact": "{fact}"}


def load_heldout(path: Path = HELDOUT) -> list[dict[str, Any]]:
    """The rows of a follow-up file in the held-out set's format (data/README.md); a row that
    is not is a ValueError naming its line."""
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            kind, text = row["kind"], row["text"]
            ok = (KINDS.get(kind) == row["label"] and isinstance(text, str)
                  and (row["preference"] in HINTS if kind == "style"
                       else row["preference"] is None)
                  and (kind not in PLACEHOLDERS or PLACEHOLDERS[kind] in text))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError(f"{path}:{n}: not a follow-up row (text, label, kind, preference "
                             "as in clawrl/judgemodel/data/README.md)")
        rows.append(row)
    return rows


def stratified(rows: list[dict[str, Any]], limit: int | None,
               seed: int = 0) -> list[dict[str, Any]]:
    """`limit` rows with each kind in its share of the set (all rows when None)."""
    if limit is None or limit >= len(rows):
        return rows
    rng = random.Random(f"heldout-{seed}")
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_kind[r["kind"]].append(r)
    out: list[dict[str, Any]] = []
    for _kind, group in sorted(by_kind.items()):
        out += rng.sample(group, max(1, round(limit * len(group) / len(rows))))
    return out


def make_case(world: World, row: dict[str, Any], rng: random.Random) -> Case:
    """The tiny-world turn a held-out follow-up is judged in."""
    q = rng.choice(world.train)
    request = [{"role": "user", "content": q.text}]
    text, value = row["text"], None
    if row["kind"] == "fact":
        reply = render_reply(wrong_world(world, q, rng), q, Style.random(rng), rng)
        value = world.answer(q)
        text = text.replace("{fact}", fact_sentence(world, q, rng))
    elif row["kind"] == "style":
        reply = styled_reply(world, q, rng, violates=row["preference"])
    else:
        reply = render_reply(world, q, Style.random(rng), rng)
    text = text.replace("{question}", rng.choice(world.train).text)
    expected = 1 if row["label"] == "praise" else -1
    return Case(row, request, {"role": "assistant", "content": reply},
                [{"role": "user", "content": text}], expected, value)


def dev_cases(n: int, world: World) -> list[Case]:
    """`n` synthetic turns for choosing how to build and run the judge without looking at
    the held-out set: a stream of `synth.py` no build trains on (its own seed), keeping only
    follow-ups whose template is not in the default training set (new combinations and new
    perturbations of the training phrasings, hand-written lines included, so this measures
    fit more than reading new English; the dev rows, `DEV_ROWS`, measure that)."""
    seen = {normalize(ex.template) for ex in training_set(BuildConfig().turns)}
    cases: list[Case] = []
    for ex in iter_examples(seed=DEV_SEED):
        if ex.label == 0 or normalize(ex.template) in seen:
            continue
        label = "praise" if ex.label == 1 else "correction"
        row = {"kind": "praise" if ex.kind == "move_on" else ex.kind, "label": label,
               "preference": ex.preference, "text": ex.template}
        cases.append(Case(row, ex.request, ex.reply, ex.next_state, ex.label, None))
        if len(cases) == n:
            return cases
    raise AssertionError("unreachable: the stream is endless")


def agent_cases(n: int) -> list[Case]:
    """`n` agent steps (synth.py `agent_set`) about the tiny world's held-out questions, from
    a seed no build uses: a lookup of what was asked (+1), of something else (−1), a tool's
    error (−1), a request to use the tools (−1)."""
    cases = []
    for ex in agent_set(n, seed=DEV_SEED, heldout=True):
        row = {"kind": ex.kind, "label": "praise" if ex.label == 1 else "correction",
               "preference": None, "text": ex.template}
        cases.append(Case(row, ex.request, ex.reply, ex.next_state, ex.label, None))
    return cases


def start_engine(model: Path, port: int, threads: int, log: Path,
                 dtype: str = JUDGE_DTYPE, speculative: bool = True) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "clawrl.cli.main", "engine", "--model", str(model),
           "--port", str(port), "--threads", str(threads), "--dtype", dtype,
           *(SPECULATIVE_FLAGS if speculative else ())]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"the engine did not answer /health within 300 s; see {log}")


async def judge_case(backend: ChatBackend, case: Case, s: JudgeSettings) -> dict[str, Any]:
    """One turn judged as the worker judges it (`judge.judgment.cast_votes`)."""
    fields = render_fields(case.request, case.reply, case.next_state)
    start = time.perf_counter()
    prm, hints = await cast_votes(backend, fields, s, s.prompt_version)
    return {"kind": case.row["kind"], "label": case.row["label"],
            "preference": case.row["preference"], "text": case.next_state[0]["content"],
            "expected": case.expected, "reward": prm.reward, "hint": hints.hint,
            "value": case.value, "seconds": time.perf_counter() - start,
            **{k: case.row[k] for k in ("language", "question", "finish_reason")
               if k in case.row},
            "votes": [v.as_json() for v in prm.votes]}


async def run_cases(url: str, cases: list[Case], s: JudgeSettings) -> list[dict[str, Any]]:
    async with http_client(s.timeout_s, s.connect_timeout_s, max_connections=16) as client:
        backend = ChatBackend(client, url, model=None, api_key=None,
                              concurrency=s.backend_concurrency)
        await judge_case(backend, cases[0], s)  # warm-up, not counted
        results = []
        for i, case in enumerate(cases):
            results.append(await judge_case(backend, case, s))
            if (i + 1) % 25 == 0:
                agree = sum(r["reward"] == r["expected"] for r in results)
                print(f"  {i + 1}/{len(cases)} turns judged, PRM agreement so far "
                      f"{agree}/{len(results)}", file=sys.stderr, flush=True)
        return results


def rate(results: list[dict[str, Any]], ok: Any) -> dict[str, Any]:
    n = len(results)
    hits = sum(1 for r in results if ok(r))
    return {"n": n, "hits": hits, "rate": round(hits / n, 3) if n else None}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    agree = lambda r: r["reward"] == r["expected"]  # noqa: E731
    praise = [r for r in results if r["label"] == "praise"]
    correction = [r for r in results if r["label"] == "correction"]
    style = [r for r in results if r["kind"] == "style"]
    fact = [r for r in results if r["kind"] == "fact"]
    seconds = sorted(r["seconds"] for r in results)
    return {
        "prm": rate(results, agree),
        "prm_praise": rate(praise, agree),
        "prm_correction": rate(correction, agree),
        "prm_by_kind": {k: rate([r for r in results if r["kind"] == k], agree)
                        for k in sorted({r["kind"] for r in results})},
        "style_hint": rate(style, lambda r: hint_preference(r["hint"]) == r["preference"]),
        "style_any_hint": rate(style, lambda r: r["hint"] is not None),
        "fact_hint": rate(fact, lambda r: r["hint"] is not None
                          and (r["value"] or "").lower() in r["hint"].lower()),
        "praise_hint": rate(praise, lambda r: r["hint"] is not None),
        "p50_s": round(statistics.median(seconds), 3),
        "p90_s": round(seconds[int(0.9 * (len(seconds) - 1))], 3),
    }


def judge_cases(state_dir: Path, cases: list[Any], *, votes: int = 3, port: int = 30071,
                threads: int = 1, dtype: str = JUDGE_DTYPE, adapter: Path | None = None,
                overrides: dict[str, Any] | None = None,
                speculative: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Judge `cases` with the judge model on its own engine, through the worker's voting
    code: the results and the settings they were judged with (`evaluate`, and the
    real-replies set's clawrl/judgemodel/real.py)."""
    settings = JudgeSettings(**{**JUDGE_MODEL_SETTINGS, "votes": votes, **(overrides or {})})
    # Merged after the rows are read, so a bad file is one line at once, not after a merge.
    model = ensure_judge_model(state_dir, adapter or ADAPTER_DIR)
    log = state_dir / "logs" / "judge-eval-engine.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = start_engine(model, port, threads, log, dtype, speculative)
    try:
        results = asyncio.run(run_cases(f"http://127.0.0.1:{port}/v1", cases, settings))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    how = {k: getattr(settings, k) for k in ("prm_mode", "votes", "temperature", "hint_votes",
                                               "hint_temperature")}
    return results, how


def evaluate(state_dir: Path, *, limit: int | None = None, votes: int = 3, port: int = 30071,
             threads: int = 1, dtype: str = JUDGE_DTYPE, adapter: Path | None = None,
             seed: int = 0, overrides: dict[str, Any] | None = None, dev: int = 0,
             speculative: bool = True, agent: int = 0,
             rows_file: Path | None = None) -> dict[str, Any]:
    world = World.build(0)
    rng = random.Random(f"judge-eval-{seed}")
    rows: list[Any]
    if agent:
        cases = agent_cases(agent)
        rows = cases
    elif dev:
        cases = dev_cases(dev, world)
        rows = cases
    else:
        rows = stratified(load_heldout(rows_file or HELDOUT), limit, seed)
        cases = [make_case(world, row, rng) for row in rows]
    results, how = judge_cases(state_dir, cases, votes=votes, port=port, threads=threads,
                               dtype=dtype, adapter=adapter, overrides=overrides,
                               speculative=speculative)
    name = "agent" if agent else "dev" if dev else (rows_file or HELDOUT).stem
    return {"set": name, "rows": len(rows),
            "settings": how,
            "threads": threads,
            # the dtype the engine chose for `auto` (the same machine, the same rule)
            "dtype": str(resolve_dtype(dtype, "cpu")).removeprefix("torch."),
            "speculative": speculative,
            "summary": summarize(results), "targets": TARGETS,
            "misses": [r for r in results if r["reward"] != r["expected"]
                       or (r["kind"] == "style"
                           and hint_preference(r["hint"]) != r["preference"])]}


def print_report(report: dict[str, Any]) -> None:
    s = report["summary"]
    how = report["settings"]
    print(f"{report['set']} rows judged: {report['rows']}  (PRM {how['prm_mode']} with "
          f"{how['votes']} votes, {how['hint_votes']} hint votes, engine threads "
          f"{report['threads']}, {report['dtype']}"
          f"{', n-gram drafts' if report.get('speculative') else ''})")

    def line(name: str, cell: dict[str, Any], target: str) -> None:
        print(f"  {name:<28} {cell['hits']:>4}/{cell['n']:<4} {cell['rate']}   target {target}")

    line("PRM agreement", s["prm"], ">= 0.95")
    line("  praise / moving on", s["prm_praise"], ">= 0.93")
    line("  corrections", s["prm_correction"], ">= 0.93")
    for kind, cell in s["prm_by_kind"].items():
        line(f"    {kind}", cell, "")
    line("canonical hint, style", s["style_hint"], ">= 0.90")
    line("any hint, style", s["style_any_hint"], "")
    line("true value in hint, fact", s["fact_hint"], "")
    line("hint on praise", s["praise_hint"], "<= 0.05")
    print(f"  seconds per turn             p50 {s['p50_s']}  p90 {s['p90_s']}   "
          "target p50 <= 1.0")

"""`clawrl bench placement`: one engine or two for the judge and the policy on a small machine.

    clawrl bench placement [--state-dir .clawrl] [--base DIR] [--judge-adapter DIR]
                           [--rounds 3] [--replies 2] [--streams 1] [--reply-tokens 128]
                           [--policy-threads 0] [--judge-threads 1] [--quick]

Both placements are up at once and measured round by round, alternating which goes first:

- two engines, what `clawrl up --model smollm2-135m` runs: the policy engine (the base model,
  float32, `--policy-threads`, 0 = torch's default as `clawrl up` leaves it, with the policy's
  LoRA adapter `policy-v1` loaded) and the judge engine as `clawrl judge serve` starts it (the
  judge adapter merged into the base, served as `judge`, `--dtype auto`, n-gram drafts,
  `--judge-threads`);
- one engine: the base model, float32, `--policy-threads`, with `policy-v1` and the judge
  adapter (unmerged, its folder carrying the judge's chat template,
  `write_served_adapter`) loaded side by side; the judge names `<base>:judge`.

The policy adapter is a new user's (the trainer's `LoraSettings`, peft's initialisation): the
engine does the same arithmetic whatever its values.

A round, per placement: `--streams` people chat with the policy (each a reply of
`--reply-tokens` tokens from `policy-v1` to an everyday question, then the next, `--replies`
of them), and while they do, judge requests go one after another: real ones, the worker's
`cast_votes` at the judge model's settings (judge/config.py `JUDGE_MODEL_SETTINGS`: prompt v5,
one greedy answer whose first token's alternatives give the PRM votes and whose text is the
hint) on turns of the real-replies held-out set (SmolLM2's own reply to a question and a
person's follow-up; praise and a style correction in turn). Each round's turns are the same
in both placements, so their answers are compared one by one.

Reported: the engine processes' memory (RSS and PSS, summed over a placement's processes)
idle (adapters loaded, nothing served) and after the rounds; judge latency p50/p90 over all
rounds; the policy replies' tokens/s (a reply's tokens over its wall time, prefill included;
median); one engine over two engines as medians of per-round ratios; how many judge answers
were the same text in both placements. The judge requests run back to back, faster than a
person's pace (one judgment per turn): the faster judge does more work beside the same reply,
which weighs on its placement's policy tokens/s.

Then, with no policy traffic, `--alone` turns judged one at a time by the judge engine, by the
one engine's judge adapter, and by the same adapter loaded without its chat template (so
rendered with SmolLM2's, default system message included, as an engine without per-adapter
templates would): each one's latency p50 and how many answers and verdicts match the judge
engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from clawrl.base.engine_client import policy_adapter_name
from clawrl.base.settings import EngineSettings
from clawrl.bench.args import OneLineParser
from clawrl.bench.proxy import machine_line, pct
from clawrl.bench.trainer import EngineStartError, engine_process
from clawrl.engine.pretrained import default_models_dir
from clawrl.judgemodel.model import (
    ADAPTER_DIR,
    BASE_MODEL,
    JUDGE_DTYPE,
    SPECULATIVE_FLAGS,
    ensure_judge_model,
    write_served_adapter,
)
from clawrl.judgemodel.real import QUESTIONS, REPLIES, TURNS, read_jsonl
from judge.backends import ChatBackend, build_judge_backend
from judge.config import JUDGE_MODEL_SETTINGS, JudgeSettings
from judge.judgment import cast_votes
from judge.prompts import render_fields

PROG = "clawrl bench placement"
POLICY_NAME = "policy"  # the base model's served name in the policy and the one engine
JUDGE_NAME = "judge"  # the judge engine's served name (judge/backends.py JUDGE_ENGINE_MODEL)
PLACEMENTS = ("two engines", "one engine")
PLAIN_JUDGE = "judge-plain"  # the judge adapter without its chat template


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--state-dir", type=Path,
                   default=Path(os.environ.get("CLAWRL_STATE_DIR", ".clawrl")),
                   help="where the merged judge is kept (models/judge*)")
    p.add_argument("--base", type=Path, default=None,
                   help=f"base model dir (default: <state-dir>/models/{BASE_MODEL})")
    p.add_argument("--judge-adapter", type=Path, default=ADAPTER_DIR,
                   help="the judge's LoRA adapter (default: the shipped one)")
    p.add_argument("--rounds", type=int, help="rounds, each placement once (default 3; "
                                              "--quick: 1)")
    p.add_argument("--replies", type=int, help="policy replies per stream per round (default "
                                               "2; --quick: 1)")
    p.add_argument("--streams", type=int, default=1, help="people chatting at once")
    p.add_argument("--reply-tokens", type=int, help="tokens per policy reply (default 128; "
                                                    "--quick: 16)")
    p.add_argument("--policy-threads", type=int, default=0,
                   help="torch threads of the policy engine and of the one engine (0: "
                        "torch's default, as `clawrl up` starts them)")
    p.add_argument("--judge-threads", type=int, default=1,
                   help="torch threads of the judge engine (`clawrl judge serve`'s default)")
    p.add_argument("--alone", type=int, help="turns judged with no policy traffic, "
                                             "three ways (default 8; --quick: 2)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a test")
    args = p.parse_args(argv)
    for name, full, small in (("rounds", 3, 1), ("replies", 2, 1), ("reply_tokens", 128, 16),
                              ("alone", 8, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    for name in ("rounds", "replies", "streams", "reply_tokens", "judge_threads", "alone"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.policy_threads < 0:
        p.error("--policy-threads must be 0 (torch's default) or more")
    args.base = args.base or default_models_dir(args.state_dir) / BASE_MODEL
    if not (args.base / "config.json").is_file():
        p.error(f"--base {args.base} is not a model directory (no config.json); "
                f"`clawrl models pull {BASE_MODEL}` makes it")
    if not (args.judge_adapter / "adapter_config.json").is_file():
        p.error(f"--judge-adapter {args.judge_adapter} is not a LoRA adapter "
                "(no adapter_config.json)")
    return args


# -- what is sent -------------------------------------------------------------------------------
def judge_turns() -> list[dict[str, str]]:
    """Rendered judge fields of held-out real turns: praise and a style correction in turn."""
    questions = {q["id"]: q["text"] for q in read_jsonl(QUESTIONS)}
    replies = read_jsonl(REPLIES)
    followups = read_jsonl(TURNS.with_name("heldout_real.jsonl"))
    by_kind: dict[str, list[dict[str, str]]] = {}
    for turn in read_jsonl(TURNS):
        reply = replies[turn["reply"]]
        fields = render_fields([{"role": "user", "content": questions[reply["question"]]}],
                               {"role": "assistant", "content": reply["reply"]},
                               [{"role": "user", "content": turn["text"]}])
        by_kind.setdefault(followups[turn["row"]]["kind"], []).append(dict(fields))
    return [f for pair in zip(by_kind["praise"], by_kind["style"], strict=False) for f in pair]


def judge_settings(url: str | None = None) -> JudgeSettings:
    """The judge worker's settings for the judge model (as `clawrl up` sets them)."""
    return JudgeSettings(url=url, **JUDGE_MODEL_SETTINGS)  # type: ignore[arg-type]


@dataclass
class Placement:
    """One placement's endpoints, processes and figures."""

    name: str
    policy_url: str
    pids: list[int]
    judge: ChatBackend | None = None
    judge_url: str = ""
    judge_model: str | None = None
    latencies: dict[int, list[float]] = field(default_factory=dict)  # round -> ms
    rates: dict[int, list[float]] = field(default_factory=dict)  # round -> tokens/s
    answers: dict[tuple[int, int], str] = field(default_factory=dict)  # (round, k) -> text
    memory: dict[str, tuple[int, int]] = field(default_factory=dict)  # when -> (rss, pss)

    def read_memory(self, when: str) -> None:
        infos = [psutil.Process(pid).memory_full_info() for pid in self.pids]
        self.memory[when] = (sum(int(i.rss) for i in infos), sum(int(i.pss) for i in infos))


async def policy_stream(client: httpx.AsyncClient, url: str, questions: list[str], start: int,
                        replies: int, tokens: int, rates: list[float]) -> None:
    """A person chatting: `replies` replies of `tokens` tokens from `policy-v1`, one after
    another; each reply's tokens/s (wall time, prefill included) goes to `rates`."""
    for i in range(replies):
        body = {"model": f"{POLICY_NAME}:{policy_adapter_name(1)}", "max_tokens": tokens,
                "ignore_eos": True, "messages": [
                    {"role": "user", "content": questions[(start + i) % len(questions)]}]}
        t0 = time.perf_counter()
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()
        rates.append(int(r.json()["usage"]["completion_tokens"]) / (time.perf_counter() - t0))


async def run_round(place: Placement, rnd: int, args: argparse.Namespace,
                    turns: list[dict[str, str]], questions: list[str]) -> None:
    """The streams run; judge requests go one after another until they are done."""
    assert place.judge is not None
    settings = judge_settings()
    latencies = place.latencies.setdefault(rnd, [])
    rates = place.rates.setdefault(rnd, [])
    async with httpx.AsyncClient(timeout=1800) as client:
        streams = [asyncio.create_task(policy_stream(
            client, place.policy_url, questions, rnd * 7 + s * 3, args.replies,
            args.reply_tokens, rates)) for s in range(args.streams)]
        k = 0
        while True:  # at least one judge request, then as long as a person is chatting
            t0 = time.perf_counter()
            prm, _ = await cast_votes(place.judge, turns[k % len(turns)], settings,
                                      settings.prompt_version)
            latencies.append(1e3 * (time.perf_counter() - t0))
            place.answers[(rnd, k)] = prm.votes[0].text
            k += 1
            if all(s.done() for s in streams):
                break
        await asyncio.gather(*streams)


async def warm_up(place: Placement, turns: list[dict[str, str]], questions: list[str]) -> None:
    """Untimed: a short reply and two judge answers (the first forward of a process is slow;
    a judge engine's n-gram table starts empty and fills from its answers)."""
    assert place.judge is not None
    settings = judge_settings()
    async with httpx.AsyncClient(timeout=1800) as client:
        await policy_stream(client, place.policy_url, questions, 0, 1, 4, [])
    for fields in turns[-2:]:  # turns the rounds reach last, if at all
        await cast_votes(place.judge, fields, settings, settings.prompt_version)


async def judge_alone(places: list[Placement], plain: str, n: int,
                      turns: list[dict[str, str]]) -> None:
    """`n` turns judged with nothing else running: by the judge engine, the one engine's
    judge adapter, and the adapter `plain` (the same weights without the judge's chat
    template); latencies and answers against the judge engine's."""
    two, one = places
    assert two.judge is not None and one.judge is not None
    settings = judge_settings()
    untemplated = ChatBackend(one.judge.client, one.judge_url + "/v1",
                              model=f"{POLICY_NAME}:{plain}", api_key=None, concurrency=8)
    sides = {"judge engine": two.judge, "one engine's judge adapter": one.judge,
             "the adapter with SmolLM2's template": untemplated}
    got: dict[str, list[tuple[float, str, int | None]]] = {name: [] for name in sides}
    for k in range(n):
        for name, backend in sides.items():
            t0 = time.perf_counter()
            prm, _ = await cast_votes(backend, turns[k % len(turns)], settings,
                                      settings.prompt_version)
            got[name].append((1e3 * (time.perf_counter() - t0), prm.votes[0].text, prm.reward))
    ref = got["judge engine"]
    for name, rows in got.items():
        line = (f"judge alone, {name}: p50 {statistics.median(r[0] for r in rows):,.0f} ms "
                f"({n} turns, no policy traffic)")
        if name != "judge engine":
            same = sum(r[1] == f[1] for r, f in zip(rows, ref, strict=True))
            verdicts = sum(r[2] == f[2] for r, f in zip(rows, ref, strict=True))
            line += f"; answers alike the judge engine's {same} of {n}, verdicts {verdicts} of {n}"
        print(line, flush=True)


# -- set-up -------------------------------------------------------------------------------------
def policy_adapter(base: Path, out: Path) -> Path:
    """A new user's policy adapter on `base`, as the trainer writes one."""
    from trainer.backends.torch import TorchBackend
    from trainer.config import LoraSettings, TrainerSettings

    maker = TorchBackend(TrainerSettings(device="cpu", kl_coef=0.0,
                                         lora=LoraSettings(enabled=True)))
    maker.load(base)
    maker.fresh_adapter(0)
    maker.save_adapter(out)
    del maker
    gc.collect()
    return out


def write_plain_adapter(adapter: Path, out: Path) -> Path:
    """The judge adapter's weights and config alone (no chat template of its own)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(adapter / name, out / name)
    return out


def load(url: str, name: str, folder: Path) -> None:
    from trainer.adapters import load_adapter

    load_adapter(EngineSettings(url=url), name, folder)


@contextmanager
def placements(args: argparse.Namespace, work: Path) -> Iterator[list[Placement]]:
    """Both placements' engines, healthy, adapters loaded; stopped on exit."""
    merged = ensure_judge_model(args.state_dir, args.judge_adapter, base=args.base)
    served = write_served_adapter(work / "judge-adapter", args.judge_adapter)
    policy = policy_adapter(args.base, work / "policy-v1")
    threads = args.policy_threads
    with ExitStack() as stack:
        p_url, p_pid = stack.enter_context(engine_process(
            args.base, threads, work / "policy.log", "--served-model-name", POLICY_NAME))
        j_url, j_pid = stack.enter_context(engine_process(
            merged, args.judge_threads, work / "judge.log", "--served-model-name", JUDGE_NAME,
            "--dtype", JUDGE_DTYPE, *SPECULATIVE_FLAGS))
        o_url, o_pid = stack.enter_context(engine_process(
            args.base, threads, work / "one.log", "--served-model-name", POLICY_NAME))
        load(p_url, policy_adapter_name(1), policy)
        load(o_url, policy_adapter_name(1), policy)
        load(o_url, JUDGE_NAME, served)
        two = Placement(PLACEMENTS[0], p_url, [p_pid, j_pid], judge_url=j_url)
        one = Placement(PLACEMENTS[1], o_url, [o_pid], judge_url=o_url,
                        judge_model=f"{POLICY_NAME}:{JUDGE_NAME}")
        yield [two, one]


# -- the run ------------------------------------------------------------------------------------
def mb(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def dtype_of(log: Path) -> str:
    """The engine's weights dtype as its start line reports it (`serving M on URL (cpu,
    float32, …)`), or '?'."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("clawrl engine: serving") and line.endswith(")"):
            parts = line.rsplit("(", 1)[-1].split(", ")
            if len(parts) > 1:
                return parts[1]
    return "?"


async def measure(places: list[Placement], args: argparse.Namespace, work: Path) -> None:
    turns, questions = judge_turns(), [q["text"] for q in read_jsonl(QUESTIONS)]
    async with httpx.AsyncClient(timeout=1800) as client:
        for place in places:
            if place.judge_model is None:  # the judge engine, as the worker builds it
                place.judge = build_judge_backend(judge_settings(place.judge_url),
                                                  EngineSettings(url=place.policy_url), client)
            else:
                place.judge = ChatBackend(client, place.judge_url + "/v1",
                                          model=place.judge_model, api_key=None,
                                          concurrency=8)
            place.read_memory("idle")
            print(f"memory, {place.name}, idle: RSS {mb(place.memory['idle'][0])} MB  PSS "
                  f"{mb(place.memory['idle'][1])} MB (before the warm-up)", flush=True)
            await warm_up(place, turns, questions)
        for rnd in range(args.rounds):
            for place in places[:: 1 - 2 * (rnd % 2)]:
                await run_round(place, rnd, args, turns, questions)
            two, one = places
            print(f"round {rnd + 1}: " + "  |  ".join(
                f"{p.name}: judge p50 {statistics.median(p.latencies[rnd]):,.0f} ms "
                f"({len(p.latencies[rnd])} requests), policy "
                f"{statistics.median(p.rates[rnd]):,.1f} tokens/s" for p in (two, one)),
                flush=True)
        for place in places:
            place.read_memory("after traffic")
        load(places[1].policy_url, PLAIN_JUDGE, write_plain_adapter(args.judge_adapter,
                                                                     work / PLAIN_JUDGE))
        await judge_alone(places, PLAIN_JUDGE, args.alone, turns)


def report(places: list[Placement], args: argparse.Namespace) -> None:
    two, one = places
    for when in ("idle", "after traffic"):
        for place in places:
            rss, pss = place.memory[when]
            print(f"memory, {place.name}, {when}: RSS {mb(rss)} MB  PSS {mb(pss)} MB "
                  f"({len(place.pids)} process{'es' * (len(place.pids) > 1)})")
    for place in places:
        lat = [x for r in place.latencies.values() for x in r]
        print(f"judge latency, {place.name}: p50 {pct(lat, 0.5):,.0f} ms  p90 "
              f"{pct(lat, 0.9):,.0f} ms ({len(lat)} requests, {args.streams} policy "
              f"stream{'s' * (args.streams > 1)} beside)")
    for place in places:
        rates = [x for r in place.rates.values() for x in r]
        print(f"policy tokens/s, {place.name}: median {statistics.median(rates):,.1f} "
              f"({len(rates)} replies of {args.reply_tokens} tokens)")
    rounds = range(args.rounds)

    def ratio(of: str, q: float) -> float:
        def figure(p: Placement, r: int) -> float:
            return pct(p.latencies[r], q) if of == "judge" else statistics.median(p.rates[r])
        return statistics.median(figure(one, r) / figure(two, r) for r in rounds)

    rss_x, pss_x = (one.memory["after traffic"][i] / two.memory["after traffic"][i]
                    for i in (0, 1))
    print(f"one engine / two engines: judge p50 {ratio('judge', 0.5):.2f}x  p90 "
          f"{ratio('judge', 0.9):.2f}x  policy tokens/s {ratio('policy', 0.5):.2f}x "
          f"(medians of per-round ratios)  memory after traffic RSS {rss_x:.2f}x  PSS {pss_x:.2f}x")
    both = [k for k in two.answers if k in one.answers]
    same = sum(two.answers[k] == one.answers[k] for k in both)
    print(f"judge answers alike in both placements: {same} of {len(both)} "
          f"(same turn, same round)")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    avg = os.getloadavg()
    print(f"load average at the start: {avg[0]:.1f} / {avg[1]:.1f} / {avg[2]:.1f}",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="clawrl-bench-placement-"))
    try:
        with placements(args, work) as places:
            engines = (f"two engines = policy engine ({dtype_of(work / 'policy.log')}, "
                       f"threads {args.policy_threads or 'default'}, {policy_adapter_name(1)}) "
                       f"+ judge engine (merged, {dtype_of(work / 'judge.log')}, n-gram "
                       f"drafts, threads {args.judge_threads}); one engine = base "
                       f"({dtype_of(work / 'one.log')}, threads "
                       f"{args.policy_threads or 'default'}) + {policy_adapter_name(1)} + judge "
                       f"adapter")
            print(engines, flush=True)
            asyncio.run(measure(places, args, work))
        report(places, args)
    except EngineStartError as exc:
        print(f"{PROG}: {exc}", flush=True)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(machine_line(), flush=True)
    return 0

"""`clawrl eval`: the simulated users' conversations, the outputs, and (slow) the whole loop.

The simulator unit tests put a scripted assistant behind `httpx.MockTransport` (the OpenAI
API is the interface the users speak); the slow test runs the real stack: proxy, judge,
trainer and engine with the small tiny world model.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from clawrl.eval import cli, report
from clawrl.eval import config as evalconfig
from clawrl.world.recipe import PERSONAL_RECIPE, TINYWORLD_RECIPE
from clawrl.world.simulate import PeoplePhrasings, SimUser, phrasings
from clawrl.world.town import CORRECTIONS, FRESH_CORRECTIONS, World


class ScriptedAssistant:
    """An OpenAI-compatible endpoint that answers from a script and records requests.

    Replies are templates: `{name}` and `{value}` are the person and the true answer of the
    latest question asked, `{wrong}` a value that is not the answer.
    """

    def __init__(self, replies: list[str], world: World | None = None) -> None:
        self.replies = list(replies)
        self.world = world or World.build(0)
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []

    def _render(self, template: str, messages: list[dict[str, str]]) -> str:
        asked = [q for m in messages if m["role"] == "user"
                 for q in self.world.train + self.world.heldout if m["content"].endswith(q.text)]
        if not asked:
            return template
        value = self.world.answer(asked[-1])
        return template.format(name=asked[-1].name, value=value,
                               wrong="nowhere" if value != "nowhere" else "somewhere")

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((dict(request.headers), body))
        text = (self._render(self.replies.pop(0), body["messages"])
                if body.get("max_tokens") != 1 else "x")
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": "default",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}]})


def _user(script: ScriptedAssistant, pref: str) -> SimUser:
    client = AsyncOpenAI(base_url="http://proxy.test/v1", api_key="ck-test",
                         http_client=httpx.AsyncClient(transport=httpx.MockTransport(script)))
    return SimUser("sim-0", pref, client, random.Random(0))


async def test_violation_gets_a_correction_and_the_session_closes_with_a_next_state() -> None:
    world = World.build(0)
    script = ScriptedAssistant(["It is {value}.", "it is {value}.", "it is {value}."], world)
    user = _user(script, "lowercase")
    await user.chat_session(world, questions=2, max_redos=1)
    bodies = [b for _, b in script.requests]
    assert len(bodies) == 4  # reply, redo, second question, closing one-token turn
    correction = bodies[1]["messages"][-1]["content"]
    assert correction in CORRECTIONS["lowercase"] + FRESH_CORRECTIONS["lowercase"]
    assert bodies[1]["messages"][-2]["content"].startswith("It is ")
    closing_headers, closing = script.requests[-1]
    assert closing["max_tokens"] == 1 and closing_headers["x-session-done"] == "true"
    assert closing["messages"][-2]["content"].startswith("it is ")
    assert [e["satisfied"] for e in user.log] == [False, True, True]
    assert [e["correct"] for e in user.log] == [True, True, True]
    await user.client.close()


async def test_people_followups_come_from_the_pool_written_apart() -> None:
    """`--followups people`: every correction, praise and move-on the user sends is a line of
    clawrl/world/data/sim_followups.jsonl (placeholders filled), never a corpus phrasing."""
    world = World.build(0)
    pool = PeoplePhrasings()
    templates = [re.escape(t).replace(re.escape("{fact}"), ".+").replace(
        re.escape("{question}"), ".+") for t in pool.praises + pool.move_ons + pool.facts
        + [x for xs in pool.styles.values() for x in xs]]
    sent: list[str] = []
    for seed in range(12):
        # wrong, then a violating redo: a fact correction then a style correction; then the
        # second question after a satisfying reply; then praise at the end
        script = ScriptedAssistant(["It is {wrong}.", "It is {value}.", "it is {value}."]
                                   + ["it is {value}."] * 5, world)
        user = _user(script, "lowercase")
        user.says = pool
        await user.chat_session(world, questions=2, max_redos=2, rng=random.Random(seed))
        sent += [m["content"] for m in script.requests[-1][1]["messages"]
                 if m["role"] == "user"][1:]  # the first is a question
        await user.client.close()
    questions = {q.text for q in world.train}
    for text in sent:
        assert text in questions or any(re.fullmatch(t, text, re.S) for t in templates), text
        assert text not in CORRECTIONS["lowercase"] + FRESH_CORRECTIONS["lowercase"]
    assert any(t in pool.styles["lowercase"] for t in sent)
    assert any(t in pool.praises for t in sent)
    assert any(any(re.fullmatch(re.escape(m).replace(re.escape("{fact}"), ".+"), t)
                   for m in pool.facts) for t in sent)
    assert any(t not in questions and any(t.endswith(q) for q in questions) for t in sent)
    # every preference the eval can ask for has corrections in the pool
    assert {"lowercase", "brief", "no_lists", "no_signoff"} <= set(pool.styles)


async def test_a_wrong_answer_is_corrected_with_the_true_fact_before_any_style() -> None:
    world = World.build(0)
    script = ScriptedAssistant(["it is {wrong}.", "it is {value}.", "it is {value}."], world)
    user = _user(script, "lowercase")
    await user.chat_session(world, questions=2, max_redos=1)
    bodies = [b for _, b in script.requests]
    question = next(q for q in world.train
                    if bodies[0]["messages"][-1]["content"].endswith(q.text))
    correction = bodies[1]["messages"][-1]["content"]
    assert world.answer(question) in correction  # states the true fact
    assert not any(c in correction for c in CORRECTIONS["lowercase"])
    assert [e["correct"] for e in user.log] == [False, True, True]
    assert [e["satisfied"] for e in user.log] == [True, True, True]
    await user.client.close()


async def test_concurrent_sessions_with_their_own_rngs_are_reproducible() -> None:
    world = World.build(0)
    asked = []
    for _ in range(2):
        script = ScriptedAssistant(["it is {value}."] * 8, world)
        user = _user(script, "lowercase")
        await user.chat_session(world, rng=random.Random("a"))
        await user.chat_session(world, rng=random.Random("b"))
        asked.append([b["messages"][-1]["content"] for _, b in script.requests])
        assert user.rng.getstate() == random.Random(0).getstate()  # the user's RNG untouched
        await user.client.close()
    assert asked[0] == asked[1]


async def test_a_user_whose_correction_is_ignored_corrects_again_and_leaves() -> None:
    script = ScriptedAssistant(["It is {value}.", "IT IS {value}."])
    user = _user(script, "lowercase")
    await user.chat_session(World.build(0), questions=2, max_redos=1)
    assert len(script.requests) == 3
    headers, closing = script.requests[-1]
    assert headers["x-session-done"] == "true"
    assert closing["messages"][-1]["content"] in CORRECTIONS["lowercase"] + FRESH_CORRECTIONS[
        "lowercase"]
    await user.client.close()


async def test_probe_sends_side_turns_and_scores_first_replies() -> None:
    world = World.build(0)
    prompts = [q.text for q in world.heldout[:2]]
    answers = [world.answer(q) for q in world.heldout[:2]]
    script = ScriptedAssistant([f"it is {answers[0]}.", "I Do Not Know."])
    user = _user(script, "lowercase")
    result = await user.probe(world, prompts, concurrency=1)  # the script answers in order
    assert result.satisfied == 0.5 and result.correct == 0.5
    for headers, body in script.requests:
        assert headers["x-turn-type"] == "side"
        assert len(body["messages"]) == 1
    await user.client.close()


async def test_probes_with_the_same_seeds_get_the_same_replies_from_the_engine(
        engine_url: str) -> None:
    """Common random numbers: every version is probed with the same per-prompt seeds, so the
    same weights answer the same way and a change in the figures is the model's. Through the
    embedded engine sampling at temperature 1."""
    from clawrl.eval.rounds import probe_seeds

    world = World.build(0)
    prompts = [q.text for q in world.heldout[:12]]
    seeds = probe_seeds(0, 0, len(prompts))
    assert seeds == probe_seeds(0, 0, len(prompts)) != probe_seeds(0, 1, len(prompts))
    client = AsyncOpenAI(base_url=f"{engine_url}/v1", api_key="unused")
    user = SimUser("sim-0", "lowercase", client, random.Random(0), max_tokens=24)
    first = await user.probe(world, prompts, seeds=seeds)
    again = await user.probe(world, prompts, seeds=seeds)
    other = await user.probe(world, prompts, seeds=probe_seeds(0, 1, len(prompts)))
    assert first.replies == again.replies
    assert other.replies != first.replies  # the seed, not a greedy engine, fixed them
    with pytest.raises(ValueError, match="2 seeds for 12 prompts"):
        await user.probe(world, prompts, seeds=seeds[:2])
    await client.close()


async def test_chat_sessions_send_a_sampling_seed_drawn_from_their_rng() -> None:
    world = World.build(0)
    sent = []
    for _ in range(2):
        script = ScriptedAssistant(["It is {value}.", "it is {value}.", "it is {value}."], world)
        user = _user(script, "lowercase")
        await user.chat_session(world, questions=2, rng=random.Random("s"))
        seeds = [b.get("seed") for _, b in script.requests if b.get("max_tokens") != 1]
        assert seeds and all(isinstance(s, int) for s in seeds) and len(set(seeds)) == len(seeds)
        sent.append(seeds)
        await user.client.close()
    assert sent[0] == sent[1]


def test_probes_past_the_held_out_questions_repeat_each_before_any_thrice() -> None:
    """`--probes` above the 66 held-out questions asks each again (more sampled replies per
    question) instead of stopping at 66; every question comes up once per pass."""
    from collections import Counter

    from clawrl.eval.rounds import probe_set

    world = World.build(0)
    held = [q.text for q in world.heldout]
    assert probe_set(world, 10, seed=0) == probe_set(world, 10, seed=0)
    assert len(set(probe_set(world, 10, seed=0))) == 10
    many = probe_set(world, 2 * len(held) + 5, seed=1)
    counts = Counter(many)
    assert len(many) == 2 * len(held) + 5 and set(counts) == set(held)
    assert sorted(set(counts.values())) == [2, 3] and list(counts.values()).count(3) == 5


async def test_probes_keep_at_most_their_concurrency_in_flight() -> None:
    world = World.build(0)
    in_flight = peak = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": "default",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "no idea"}}]})

    client = AsyncOpenAI(base_url="http://proxy.test/v1", api_key="ck-test",
                         http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    user = SimUser("sim-0", "lowercase", client, random.Random(0))
    result = await user.probe(world, [q.text for q in world.heldout] * 2, concurrency=5)
    assert len(result.replies) == 2 * len(world.heldout) and peak == 5
    await client.close()


def _rows() -> list[dict[str, Any]]:
    rows = []
    for method, rise in [("combine", 0.2), ("none", 0.0)]:
        for rnd in range(3):
            for pref in ("lowercase", "brief"):
                rows.append({"method": method, "round": rnd, "version": str(rnd),
                             "user": f"sim-0-{pref}", "pref": pref,
                             "satisfied": 0.3 + rise * rnd, "correct": 0.9})
    return rows


def test_table_and_curve(tmp_path: Path) -> None:
    table = report.print_table(_rows())
    lines = table.splitlines()
    assert len(lines) == 4 and "combine/lowercase" in lines[0] and "none/brief" in lines[0]
    assert lines[3].startswith("2") and "0.70 (v2, acc 0.90)" in lines[3]
    report.plot_curve(_rows(), tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _seed_rows(seed: int, sat: dict[str, list[float]], acc: list[float],
               method: str = "combine") -> list[dict[str, Any]]:
    return [{"method": method, "seed": seed, "round": n, "version": str(n),
             "user": f"sim-{i}-{pref}", "pref": pref, "satisfied": s, "correct": acc[n]}
            for i, (pref, curve) in enumerate(sat.items()) for n, s in enumerate(curve)]


def test_targets_per_method_and_seed() -> None:
    rows = (_seed_rows(0, {"lowercase": [0.4, 0.8, 0.95, 0.9], "brief": [0.1, 0.5, 0.7, 0.92]},
                       [0.98, 0.97, 0.95, 0.94])
            # seed 1 reaches both bars but loses 7 points of accuracy on the way
            + _seed_rows(1, {"lowercase": [0.4, 0.9, 1.0, 1.0], "brief": [0.1, 0.9, 0.9, 0.9]},
                         [0.98, 0.91, 0.97, 0.97])
            # seed 2: only one preference reaches the bar
            + _seed_rows(2, {"lowercase": [0.4, 0.95, 1.0, 1.0], "brief": [0.1, 0.5, 0.8, 0.89]},
                         [0.98, 0.98, 0.98, 0.98])
            + _seed_rows(0, {"lowercase": [0.4, 0.45, 0.35, 0.4], "brief": [0.1, 0.1, 0.2, 0.1]},
                         [0.98] * 4, method="none"))
    got = {(t["method"], t["seed"]): t for t in report.targets(rows)}
    assert got["combine", 0]["reached"] == {"lowercase": 2, "brief": 3}
    assert got["combine", 0]["worst_accuracy_drop"] == pytest.approx(0.04)
    assert got["combine", 0]["met"]
    assert got["combine", 1]["reached"] == {"lowercase": 1, "brief": 1}
    assert got["combine", 1]["worst_accuracy_drop"] == pytest.approx(0.07)
    assert got["combine", 1]["final_accuracy_drop"] == pytest.approx(0.01)
    assert not got["combine", 1]["met"]
    assert got["combine", 2]["reached"] == {"lowercase": 1, "brief": None}
    assert not got["combine", 2]["met"]
    assert got["none", 0]["spread"] == pytest.approx(0.1)
    text = report.print_targets(report.targets(rows))
    assert "brief 0.10->0.92 (>= 0.9 at round 3)" in text and "(not reached)" in text
    assert text.count("MET") == 1 and text.count("not met") == 2


def test_several_seeds_table_shows_the_mean_and_curve_the_band(tmp_path: Path) -> None:
    rows = (_seed_rows(0, {"lowercase": [0.4, 0.8]}, [1.0, 0.9])
            + _seed_rows(1, {"lowercase": [0.2, 0.6]}, [1.0, 0.8]))
    for r in rows[2:]:
        r["version"] = "9" if r["round"] else "0"  # seed 1 served another version at round 1
    lines = report.print_table(rows).splitlines()
    assert lines[0] == "mean over seeds 0,1"
    assert "0.30 (v0, acc 1.00)" in lines[2] and "0.70 (v*, acc 0.85)" in lines[3]
    report.plot_curve(rows, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


@pytest.mark.parametrize(("argv", "message"), [
    (["--methods", "sgd"], "unknown or missing method/preference: ['sgd']"),
    (["--prefs", "loud"], "unknown or missing method/preference: ['loud']"),
    (["--followups", "issue", "--prefs", "uppercase"],
     "--followups issue has no corrections for 'uppercase'"),
    (["--rounds", "0"], "must be >= 1"),
    (["--seeds", "0,x"], "--seeds takes integers like 0,1,2, not '0,x'"),
    (["--seeds", "1,1"], "--seeds needs distinct integers, got '1,1'"),
    (["--seeds", "0,1", "--proxy-url", "http://p", "--engine-url", "http://e"],
     "--seeds needs a stack per seed"),
    (["--track", "toolcall", "--personal"], "--track toolcall takes none of --small"),
    (["--track", "toolcall", "--methods", "combine"],
     "unknown or missing method/preference: ['combine']"),
    (["--track", "toolcall", "--proxy-url", "http://p", "--engine-url", "http://e"],
     "--track toolcall starts its own stacks"),
    (["--track", "tools"], "invalid choice: 'tools'"),
    (["--probe-split", "train"], "--probe-split is for --track toolcall"),
    (["--track", "toolcall", "--probe-split", "test"], "invalid choice: 'test'"),
    (["--ptx-coef", "-0.1"], "--kl-coef, --ptx-coef and --replay-coef must be >= 0"),
    (["--replay-coef", "-1"], "--kl-coef, --ptx-coef and --replay-coef must be >= 0"),
])
def test_bad_arguments_are_one_clear_line(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_toolcall_probe_asks_held_out_questions_unless_told_to_use_held_in_ones() -> None:
    from clawrl.envs.toolcall import ToolcallEnv
    from clawrl.eval.agents import _pool, _probe

    world = World.build(0)
    for argv, questions in (([], world.heldout), (["--probe-split", "train"], world.train)):
        config = cli.parse_args(["--track", "toolcall", *argv])
        probe = _probe(config)
        asked = {ToolcallEnv(probe.seed + i, **probe.options).episode.question
                 for i in range(probe.episodes)}
        assert asked <= set(questions) and len(asked) > 20
        # The dev probe's held-in episodes are other episodes than the training waves'.
        trained = {_pool(config, r, w).seed + i for r in range(1, 9) for w in range(16)
                   for i in range(16)}
        assert not trained & {probe.seed + i for i in range(probe.episodes)}


def test_the_toolcall_track_defaults_and_its_methods_settings() -> None:
    config = cli.parse_args(["--track", "toolcall"])
    assert config.track == "toolcall" and config.model.name == "tinyworld-tools"
    assert config.methods == ("outcome+process", "outcome", "process", "none")
    assert config.lr == evalconfig.TOOLCALL_LR and cli.parse_args([]).lr == 8e-4
    envs = [evalconfig.stack_env(config, m) for m in config.methods[:3]]
    # All train with rl; only the outcome's weight differs (1.0: the outcome alone, 0: the
    # judge's process reward alone).
    assert [e.pop("CLAWRL_TRAINER__OUTCOME_WEIGHT") for e in envs] == ["0.5", "1.0", "0.0"]
    assert [evalconfig.trainer_method(m) for m in config.methods[:3]] == ["rl"] * 3
    assert envs[0] == envs[1] == envs[2]
    # The track's recipe has the batch-mean baseline; the chat track leaves it to the
    # trainer (its own default). Several steps per version only when asked for.
    assert envs[0]["CLAWRL_TRAINER__REWARD_BASELINE"] == evalconfig.TOOLCALL_BASELINE
    # The tool-call model's recipe has no corpus term (its corpus is what agents unlearn).
    assert envs[0]["CLAWRL_TRAINER__PTX_COEF"] == "0.0"
    assert envs[0]["CLAWRL_TRAINER__KL_COEF"] == str(TINYWORLD_RECIPE["kl_coef"])
    chat = evalconfig.stack_env(cli.parse_args([]), "combine")
    assert "CLAWRL_TRAINER__REWARD_BASELINE" not in chat
    # The corpus term is the recipe's unless asked otherwise, and always said explicitly.
    assert chat["CLAWRL_TRAINER__PTX_COEF"] == str(TINYWORLD_RECIPE["ptx_coef"])
    off = evalconfig.stack_env(cli.parse_args(["--ptx-coef", "0"]), "combine")
    assert off["CLAWRL_TRAINER__PTX_COEF"] == "0.0"
    # Replay is off unless asked for, and always said explicitly too.
    assert chat["CLAWRL_TRAINER__REPLAY_COEF"] == "0.0"
    assert evalconfig.stack_env(cli.parse_args(["--replay-coef", "0.5"]),
                                "combine")["CLAWRL_TRAINER__REPLAY_COEF"] == "0.5"
    assert "CLAWRL_TRAINER__MINI_BATCHES" not in chat
    # Its few simulated users fill batches without the trainer's fair-share caps.
    assert (chat["CLAWRL_TRAINER__USER_BATCH_SHARE"],
            chat["CLAWRL_TRAINER__USER_WINDOW_BATCHES"]) == ("1", "0")
    # Versions are full batches on any machine; only opd's may be partial.
    assert chat["CLAWRL_TRAINER__MAX_WAIT_S"] == envs[0]["CLAWRL_TRAINER__MAX_WAIT_S"] == \
        str(evalconfig.FULL_BATCH_WAIT_S)
    for partial in (evalconfig.stack_env(cli.parse_args([]), "opd"),
                    evalconfig.stack_env(cli.parse_args(["--small"]), "combine")):
        assert partial["CLAWRL_TRAINER__MAX_WAIT_S"] == str(evalconfig.PARTIAL_AFTER_S)
    steps = evalconfig.stack_env(cli.parse_args(["--track", "toolcall", "--mini-batches",
                                                 "4"]), "outcome")
    assert steps["CLAWRL_TRAINER__MINI_BATCHES"] == "4"


def test_defaults_and_the_small_run() -> None:
    full = cli.parse_args([])
    assert (full.batch_size, full.rounds, full.methods, full.seeds) == (64, 8, evalconfig.METHODS, (0,))
    assert not full.keep_db
    # The full run is judged by the judge model, its users speak the pool written apart.
    assert (full.judge_engine, full.followups) == (True, "people")
    small = cli.parse_args(["--small", "--seeds", "3,4", "--keep-db"])
    assert (small.batch_size, small.rounds, small.methods) == (32, 4, ("combine", "none"))
    assert (small.judge_engine, small.followups) == (False, "corpus")
    assert small.seeds == (3, 4) and small.seed == 3 and small.keep_db
    assert small.model.name == "tinyworld-ci"
    chosen = cli.parse_args(["--no-judge-engine", "--followups", "issue"])
    assert (chosen.judge_engine, chosen.followups, chosen.prefs) == (False, "issue", ("lowercase",))
    # --personal: conflicting users; the shared model against one adapter per user.
    personal = cli.parse_args(["--personal"])
    assert personal.methods == ("combine", "personal", "none")
    assert personal.prefs == ("lowercase", "uppercase")


def test_personal_users_train_their_own_batches_with_their_recipe() -> None:
    config = cli.parse_args(["--personal"])
    shared, personal = (evalconfig.stack_env(config, m) for m in ("combine", "personal"))
    assert personal.pop("CLAWRL_TRAINER__PERSONAL") == "true"
    assert personal.pop("CLAWRL_TRAINER__ADAPTER_LR") == str(config.adapter_lr)
    # Each method trains with its own recipe, as `clawrl up` / `clawrl up --personal` would:
    # the adapters with a KL of 0.2 and no corpus term, the shared model with its own.
    assert [personal.pop(k) for k in ("CLAWRL_TRAINER__KL_COEF", "CLAWRL_TRAINER__PTX_COEF")] \
        == [str(float(PERSONAL_RECIPE["kl_coef"])), "0.0"] == ["0.2", "0.0"]
    assert [shared.pop(k) for k in ("CLAWRL_TRAINER__KL_COEF", "CLAWRL_TRAINER__PTX_COEF")] \
        == [str(TINYWORLD_RECIPE["kl_coef"]), str(TINYWORLD_RECIPE["ptx_coef"])]
    # Each user's adapter trains on a batch of their own samples as big as the shared
    # model's batch of everyone's, as `clawrl up --personal` trains it.
    assert shared["CLAWRL_TRAINER__BATCH_SIZE"] == personal["CLAWRL_TRAINER__BATCH_SIZE"] == "64"
    assert shared == personal  # the trainer's method is combine for both
    # A KL or corpus term given on the command line is every method's.
    given = cli.parse_args(["--personal", "--kl-coef", "0.1", "--ptx-coef", "0.5"])
    for method in given.methods:
        env = evalconfig.stack_env(given, method)
        assert (env["CLAWRL_TRAINER__KL_COEF"], env["CLAWRL_TRAINER__PTX_COEF"]) == ("0.1", "0.5")
    assert evalconfig.method_recipe(given, "personal") == {"kl_coef": 0.1, "ptx_coef": 0.5}


def test_every_method_gets_the_same_trainer_settings_but_the_method() -> None:
    config = evalconfig.EvalConfig(model=Path("m"), out=Path("o"))
    envs = [evalconfig.stack_env(config, m) for m in ("rl", "opd", "combine")]
    assert [e.pop("CLAWRL_TRAINER__METHOD") for e in envs] == ["rl", "opd", "combine"]
    # ... and the partial-batch wait: only opd's batches may be partial.
    assert [e.pop("CLAWRL_TRAINER__MAX_WAIT_S") for e in envs] == [
        str(evalconfig.FULL_BATCH_WAIT_S), str(evalconfig.PARTIAL_AFTER_S),
        str(evalconfig.FULL_BATCH_WAIT_S)]
    assert envs[0] == envs[1] == envs[2]


@pytest.fixture(scope="session")
def world_model_dir() -> Path:
    """The full tiny world model, cached at .clawrl/models/tinyworld (the `clawrl up` and
    `clawrl eval` default); built once (~10 min on 2 idle cores) when missing."""
    from clawrl.world.pretrain import FULL, build, is_built

    path = Path(__file__).resolve().parents[2] / ".clawrl" / "models" / "tinyworld"
    if not is_built(path, FULL):
        path.parent.mkdir(parents=True, exist_ok=True)
        build(path, FULL, log=lambda _: None)
    return path


def _eval_rows(argv: list[str], out: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    server = os.environ.get("CLAWRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    monkeypatch.setenv("CLAWRL_DATABASE__URL",
                       server.replace("postgresql://", "postgresql+psycopg://", 1))
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert (out / "curve.png").is_file() and (out / "table.txt").is_file()
    rows: list[dict[str, Any]] = json.loads((out / "results.json").read_text())["probes"]
    return rows


def test_small_eval_learns_above_no_training_through_the_real_stack(
        ci_world_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`clawrl eval --small`: the CI-sized model behind the real proxy, judge, trainer and
    engine; a lowercase-loving user; `combine` against `none` on the same seeds, 4 versions.

    Measured while writing this (docs/eval.md): combine 0.38 -> 0.84 while none
    stays at 0.28-0.31; the bar below is half that gap.
    """
    out = tmp_path / "eval"
    rows = _eval_rows(["--small", "--model", str(ci_world_dir), "--keep-db"], out, monkeypatch)
    last = {r["method"]: r for r in rows if r["round"] == evalconfig.SMALL_ROUNDS}
    assert last["combine"]["version"] == str(evalconfig.SMALL_ROUNDS)
    assert last["none"]["version"] == "0"
    assert last["combine"]["pref"] == "lowercase"
    assert last["combine"]["satisfied"] >= last["none"]["satisfied"] + 0.25, rows
    # --keep-db: each method's database stays for SQL: the run's turns, votes and versions.
    import psycopg

    from clawrl.eval.stack import drop_database

    urls = {m: (out / m / "database.txt").read_text().strip() for m in ("combine", "none")}
    try:
        with psycopg.connect(urls["combine"].replace("+psycopg", "")) as conn:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM judgments WHERE reward IS NOT NULL),"
                " (SELECT count(*) FROM policy_versions WHERE published_at IS NOT NULL)"
            ).fetchone()
        assert row is not None and row[0] >= 32 and row[1] == evalconfig.SMALL_ROUNDS, row
    finally:
        for url in urls.values():
            server, name = url.rsplit("/", 1)
            drop_database(f"{server}/postgres", name)


@pytest.mark.slow
def test_learning_beats_no_training_through_the_real_stack(
        world_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full tiny world model (~10 min to build once): combine vs none on the same
    seeds, a brevity-loving user, six published versions."""
    rows = _eval_rows(["--model", str(world_model_dir), "--methods", "combine,none",
                       "--prefs", "brief", "--rounds", "6"], tmp_path / "eval", monkeypatch)
    last = {r["method"]: r for r in rows if r["round"] == 6}
    assert last["combine"]["version"] == "6" and last["none"]["version"] == "0"
    assert last["combine"]["satisfied"] >= last["none"]["satisfied"] + 0.2, rows


def test_a_failed_request_mid_run_is_one_line_and_keeps_the_rounds_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A request the proxy refuses (here a 429) ends the run with one readable line; the
    rounds already probed are written, not lost."""
    from clawrl.eval import stack as evalstack

    def one_round_then_refused(config: Any, method: str, on_round: Any) -> None:
        on_round(method, 0, _seed_rows(config.seed, {"lowercase": [0.4]}, [1.0], method))
        request = httpx.Request("POST", "http://proxy.test/v1/chat/completions")
        raise openai.RateLimitError("Rate limit reached", body=None,
                                    response=httpx.Response(429, request=request))

    monkeypatch.setattr(evalstack, "run_method", one_round_then_refused)
    config = evalconfig.EvalConfig(model=tmp_path / "m", out=tmp_path / "out",
                                 methods=("combine",), seeds=(3,))
    assert cli.run_eval(config) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("clawrl eval: a simulated user's request failed: Rate limit reached")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["method"], r["seed"], r["round"]) for r in saved["probes"]] == [("combine", 3, 0)]


async def test_the_issue_user_says_exactly_its_two_sentences() -> None:
    """`--followups issue`: "please answer in lowercase only, no capital letters." to a reply
    in capitals, "thanks, perfect." (then the next question) to a lowercase one."""
    world = World.build(0)
    script = ScriptedAssistant(["It is {value}.", "it is {value}.", "it is {value}."], world)
    user = _user(script, "lowercase")
    user.says = phrasings("issue")
    await user.chat_session(world, questions=2, max_redos=1, rng=random.Random(0))
    sent = [m["content"] for m in script.requests[-1][1]["messages"] if m["role"] == "user"]
    assert sent[1] == "please answer in lowercase only, no capital letters."
    assert sent[2].startswith("thanks, perfect. ") and sent[2].removeprefix(
        "thanks, perfect. ") in {q.text for q in world.train}
    assert sent[3] == "thanks, perfect."
    with pytest.raises(ValueError, match="only asks for lowercase"):
        phrasings("issue").correction("brief", random.Random(0))
    await user.client.close()


def test_a_keyed_engine_is_asked_for_its_version_with_its_key(
        tiny_model_dir: Path, engine_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`clawrl eval --proxy-url` against `clawrl up`: its engine needs the key (from the
    running stack's file, or CLAWRL_ENGINE__API_KEY); without one, a clear error."""
    import asyncio

    from clawrl.cli.stack import StackError
    from clawrl.eval.rounds import serving_version

    url = engine_factory(tiny_model_dir, "--api-key", "stack-key")
    monkeypatch.delenv("CLAWRL_ENGINE__API_KEY", raising=False)
    with pytest.raises(StackError, match="answered 401 .set CLAWRL_ENGINE__API_KEY"):
        asyncio.run(serving_version(url))
    monkeypatch.setenv("CLAWRL_ENGINE__API_KEY", "stack-key")
    assert asyncio.run(serving_version(url)) == "0"


def test_the_toolcall_track_trains_from_outcomes_through_the_real_stack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`clawrl eval --track toolcall`: the shipped tool-call model behind the real engine,
    proxy, judge and trainer; the agent's episodes through the pool; one version trained from
    the outcomes; held-out probes as side turns that post no outcome."""
    import psycopg

    from clawrl.eval.stack import drop_database
    from clawrl.world.pretrain import TOOLS_BUILD, prebuilt

    model = prebuilt(TOOLS_BUILD)
    assert model is not None
    out = tmp_path / "eval"
    rows = _eval_rows(["--track", "toolcall", "--model", str(model), "--methods", "outcome",
                       "--rounds", "1", "--probes", "8", "--batch-size", "16",
                       "--no-judge-engine", "--keep-db"], out, monkeypatch)
    assert [(r["method"], r["round"], r["pref"]) for r in rows] == [
        ("outcome", 0, "toolcall"), ("outcome", 1, "toolcall")]
    # A wave of 16 episodes writes 30-40 samples: the trainer may publish two batches of 16
    # before the round's probe.
    assert rows[0]["version"] == "0" and int(rows[1]["version"]) >= 1
    assert rows[1]["failed_train_episodes"] == 0  # every request and outcome was taken
    assert all(0.0 <= r["satisfied"] <= 1.0 and abs(sum(r["first_move"].values()) - 1) < 1e-3
               for r in rows)
    url = (out / "outcome" / "database.txt").read_text().strip()
    try:
        with psycopg.connect(url.replace("+psycopg", "")) as conn:
            sessions, with_outcome, probe_outcomes, trained, final_turns = conn.execute(
                "SELECT (SELECT count(*) FROM sessions WHERE external_id LIKE 'train-%'),"
                " (SELECT count(*) FROM sessions WHERE external_id LIKE 'train-%'"
                "    AND outcome IS NOT NULL),"
                " (SELECT count(*) FROM sessions WHERE external_id LIKE 'probe-%'"
                "    AND outcome IS NOT NULL),"
                " (SELECT count(*) FROM samples WHERE trained_step IS NOT NULL"
                "    AND outcome IS NOT NULL),"
                " (SELECT count(*) FROM samples s JOIN turns t ON t.id = s.turn_id"
                "    WHERE t.next_state IS NULL)").fetchone()
        assert sessions >= 16 and with_outcome == sessions
        assert probe_outcomes == 0
        # Trained samples saw their episode's outcome; the final answers' turns (no next
        # state) have samples too, from their outcome.
        assert trained >= 16 and final_turns > 0
    finally:
        server, name = url.rsplit("/", 1)
        drop_database(f"{server}/postgres", name)


def test_the_default_model_dir_is_kept_at_the_shipped_build_a_named_one_as_it_is(
        tmp_path: Path) -> None:
    from clawrl.eval.stack import ensure_model
    from clawrl.world.pretrain import MARKER, TOOLS_BUILD, build_key

    # An older release's tool-call build in the state dir (another key): replaced.
    for name in ("default", "named"):
        stale = tmp_path / name / "tinyworld-tools"
        stale.mkdir(parents=True)
        (stale / "config.json").write_text("{}")
        (stale / MARKER).write_text(json.dumps({"key": "an-older-build"}))
    state = json.loads((ensure_model(tmp_path / "default" / "tinyworld-tools", tools=True,
                                     default=True) / MARKER).read_text())
    assert state["key"] == build_key(TOOLS_BUILD)
    # A dir the user named is served as it is, whatever it holds.
    named = ensure_model(tmp_path / "named" / "tinyworld-tools", tools=True)
    assert json.loads((named / MARKER).read_text())["key"] == "an-older-build"
    assert cli.parse_args(["--track", "toolcall"]).default_model
    assert not cli.parse_args(["--track", "toolcall", "--model", str(named)]).default_model


def test_a_round_whose_version_the_gate_rejected_goes_on_with_the_served_one(
        tiny_model_dir: Path, engine_factory: Any, db_url: str) -> None:
    """The gate (trainer/gate.py) rejects a version: it is never served, so the round stops
    waiting for it and probes the version still served; with nothing rejected or
    published, the wait ends in a clear error."""
    import asyncio

    from sqlalchemy import text

    from clawrl.base.db import create_async
    from clawrl.cli.stack import StackError
    from clawrl.eval.rounds import wait_published

    url = engine_factory(tiny_model_dir)

    async def wait(reject: bool) -> int:
        db = create_async(db_url)
        try:
            if reject:
                async with db.begin() as conn:
                    await conn.execute(text(
                        "INSERT INTO policy_versions (version, path, status) "
                        "VALUES (1, '/nowhere', 'rejected')"))
            return await wait_published(db, "combine", url, 0, timeout_s=3, rejected=0,
                                        poll_s=0.2)
        finally:
            await db.dispose()

    with pytest.raises(StackError, match="published nothing after v0 within 3 s"):
        asyncio.run(wait(reject=False))
    assert asyncio.run(wait(reject=True)) == 0

"""`clawrl eval --attack`: the marker detector, the adversary's levers against a proxy that
refuses them, the summary and the arguments. (The whole run against the real stack: the
attack run in docs/results, and the defences' own tests in tests/proxy and tests/trainer.)"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from clawrl.eval import cli
from clawrl.eval import config as evalconfig
from clawrl.eval.attack import Adversary, attack_summary, garbled, town_words
from clawrl.world.town import Style, World, render_reply
from trainer.config import TrainerSettings


def test_replies_of_the_town_are_not_garbled_and_tempered_noise_is() -> None:
    world = World.build(0)
    words = town_words(world)
    rng = random.Random(7)
    # Replies the town writes (other styles and draws than the vocabulary's): none garbled.
    for q in world.heldout:
        assert not garbled(render_reply(world, q, Style.random(rng), rng), words)
    assert garbled("", words) and garbled("...", words)
    assert garbled("uma lives in qzxv plorf wibble", words)
    assert not garbled("uma lives in dakar. hope this helps! qzxv", words)


class Proxy:
    """An OpenAI-shaped endpoint that refuses what the defended proxy refuses: temperatures
    above 2 (400), the outcome header and route from a key without the verifier scope
    (403). Records every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        self.requests.append((request.url.path, dict(request.headers), body))
        if request.url.path.endswith("/outcome") or "x-session-outcome" in request.headers:
            return httpx.Response(403, json={"error": {
                "message": "setting a session outcome needs a key with the verifier scope",
                "type": "permission_error", "code": "missing_scope", "param": None}})
        if body.get("temperature", 1) > 2:
            return httpx.Response(400, json={"error": {
                "message": "temperature: must be at most 2", "type": "invalid_request_error",
                "code": "invalid_value", "param": "temperature"}})
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": "default",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "qzx plorf"}}]})


async def test_the_adversary_steps_down_to_what_the_proxy_serves() -> None:
    proxy = Proxy()
    client = AsyncOpenAI(base_url="http://proxy.test/v1", api_key="ck-test", max_retries=0,
                         http_client=httpx.AsyncClient(transport=httpx.MockTransport(proxy)))
    adversary = Adversary(client, World.build(0))
    await adversary.session(random.Random(0))
    await adversary.session(random.Random(1))
    await client.close()
    chats = [(h, b) for path, h, b in proxy.requests if path.endswith("/chat/completions")]
    served = [(h, b) for h, b in chats if b["temperature"] == 2.0
              and "x-session-outcome" not in h]
    # Session 1: refused with the header (403), refused at 4 (400), then served at 2 without
    # the header; every later request goes straight to what is served.
    assert adversary.levers["outcome header refused (403)"] == 1
    assert adversary.levers["temperature 4 refused (400)"] == 1
    assert adversary.levers["served at temperature 2"] == len(served) == 6  # 2 + done, x2
    assert not any(p.endswith("/outcome") for p, _, _ in proxy.requests)  # never tried
    # Every served request is a long prompt, praised and in one session per conversation.
    first = served[0][1]["messages"][0]["content"]
    assert len(first.split()) >= 300
    assert {h["x-session-id"] for h, _ in served[:3]} != {h["x-session-id"] for h, _ in served[3:]}
    assert served[1][1]["messages"][2]["content"].startswith("thanks, perfect.")


def test_summary_names_each_method_and_its_figures() -> None:
    rows = [{"method": m, "round": r, "pref": "lowercase", "satisfied": s, "marker": k,
             "adversary_share": a, "trained_samples": 64 * r, "honest_p50_ms": 900.0 + r,
             "levers": {"served at temperature 2": 10}}
            for m, a in (("defended", 0.25), ("undefended", 0.8))
            for r, s, k in ((0, 0.3, 0.02), (1, 0.6, 0.05), (2, 0.9, 0.1))]
    text = attack_summary(rows)
    assert "defended | 0.020 -> 0.100 | lowercase 0.90 | 0.250 of 128 | 901.5" in text
    assert "undefended | 0.020 -> 0.100 | lowercase 0.90 | 0.800 of 128" in text


def test_attack_arguments_and_the_undefended_stack() -> None:
    config = cli.parse_args(["--attack"])
    assert config.attack and config.methods == ("defended", "undefended")
    assert config.rounds == 10 and config.prefs == ("lowercase", "brief")
    small = cli.parse_args(["--attack", "--small", "--rounds", "3"])
    assert small.methods == ("defended", "undefended") and small.rounds == 3
    assert evalconfig.trainer_method("undefended") == "combine"
    defended = evalconfig.stack_env(config, "defended")
    undefended = evalconfig.stack_env(config, "undefended")
    assert defended["CLAWRL_TRAINER__METHOD"] == undefended["CLAWRL_TRAINER__METHOD"]
    # Undefended: one batch of 64 drawn round robin, no share per user, tokens weighed alike,
    # the raw reward.
    assert {k: v for k, v in undefended.items() if defended.get(k) != v} == {
        "CLAWRL_TRAINER__USER_BATCH_SHARE": "1", "CLAWRL_TRAINER__USER_QUOTA": "1",
        "CLAWRL_TRAINER__MAX_BATCH_SIZE": "64", "CLAWRL_TRAINER__LOSS_SHARE": "token",
        "CLAWRL_TRAINER__REWARD_BASELINE": "none"}
    # Both train full batches, as every method; no window (ten versions take minutes).
    for env in (defended, undefended):
        assert env["CLAWRL_TRAINER__MAX_WAIT_S"] == str(evalconfig.FULL_BATCH_WAIT_S)
        assert env["CLAWRL_TRAINER__USER_WINDOW_BATCHES"] == "0"
    # The rounds chat until every user waiting has the quota the trainer reads from the
    # same settings: half a batch defended (a version is full at three quotas), the whole
    # batch undefended. Defended says the trainer's defaults.
    def trainer(env: dict[str, str]) -> TrainerSettings:
        return TrainerSettings(**{k.removeprefix("CLAWRL_TRAINER__").lower(): v
                                  for k, v in env.items() if k.startswith("CLAWRL_TRAINER__")})

    assert evalconfig.version_quota(config, "defended") == trainer(defended).share_rule.quota == 32
    assert evalconfig.version_quota(config, "undefended") == \
        trainer(undefended).share_rule.quota == 64
    assert trainer(defended).share_rule == TrainerSettings(batch_size=64).share_rule
    assert trainer(defended).baseline == "user_mean"  # the shared model's default


@pytest.mark.parametrize("argv", [["--attack", "--personal"],
                                  ["--attack", "--track", "toolcall"]])
def test_attack_takes_no_other_tracks(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert "--attack runs its own methods" in capsys.readouterr().err


def test_attack_runs_one_of_its_methods(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.parse_args(["--attack", "--methods", "defended"]).methods == ("defended",)
    assert cli.main(["--attack", "--methods", "combine"]) == 2
    assert "unknown or missing method" in capsys.readouterr().err


async def test_a_round_knows_when_every_user_waiting_has_a_quota(db_url: str) -> None:
    """`fewest_ready`: the fewest usable samples of any user with some waiting — what the
    attack's rounds compare with the quota (skipped and unjudged ones not counted)."""
    import uuid

    from sqlalchemy import insert, update

    from clawrl.base.db import Judgment, Sample, Turn, User, create_async, create_engine
    from clawrl.eval.rounds import fewest_ready

    sync = create_engine(db_url)

    def add(user: str, n: int, **fields: Any) -> list[int]:
        with sync.begin() as conn:
            uid = conn.execute(insert(User.__table__).values(name=user)
                               .returning(User.__table__.c.id)).scalar_one()
            ids = []
            for _ in range(n):
                turn = conn.execute(insert(Turn.__table__).values(
                    uid=uuid.uuid4(), user_id=uid, request_messages=[], status="ok")
                    .returning(Turn.__table__.c.id)).scalar_one()
                judgment = conn.execute(insert(Judgment.__table__).values(
                    turn_id=turn, prompt_version="v1").returning(Judgment.__table__.c.id))
                ids.append(conn.execute(insert(Sample.__table__).values(
                    turn_id=turn, judgment_id=judgment.scalar_one(), user_id=uid,
                    prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0],
                    weight_version="0", **({"reward": 1} | fields))
                    .returning(Sample.__table__.c.id)).scalar_one())
            return ids

    db = create_async(db_url)
    try:
        assert await fewest_ready(db, "combine") == 0  # nobody waits
        ada = add("ada", 5)
        add("bob", 3, reward=-1)  # a −1 is a signal too
        add("cy", 4, reward=None)  # no signal: not usable, cy does not wait
        add("di", 2, skipped_reason="stale")
        assert await fewest_ready(db, "combine") == 3
        with sync.begin() as conn:
            conn.execute(update(Sample.__table__).where(Sample.__table__.c.id.in_(ada[:4]))
                         .values(skipped_reason="stale"))
        assert await fewest_ready(db, "combine") == 1
    finally:
        await db.dispose()
        sync.dispose()

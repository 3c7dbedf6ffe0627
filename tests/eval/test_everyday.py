"""`clawrl eval --model smollm2-135m`: the everyday data, the preference checkers, and a
simulated person's conversation against a scripted assistant (the whole run against the real
stack is measured in docs/results, an hour per seed on this CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from clawrl.eval import cli
from clawrl.eval import config as evalconfig
from clawrl.eval.everyday import DEFAULT_PREFS, PREFS, Person, load, satisfies
from trainer.config import TrainerSettings
from trainer.shares import full_size, user_limits


def test_the_data_has_every_split_preference_and_follow_up() -> None:
    data = load()
    assert {q.split for q in data.questions} == {"train", "dev", "test"}
    texts = [q.text for q in data.questions]
    assert len(texts) == len(set(texts))
    assert len(data.split("test")) >= 30 and len(data.facts) >= 40
    for kind in ("move_on", "off_topic", "wrong"):
        assert all(t.count("{question}") == 1 for t in data.followups[kind])
    # The guard and the questions are apart from the gate's probe (the trainer selects
    # versions on that one).
    probes = Path(__file__).resolve().parents[2] / "clawrl/engine/probes"
    gated = {json.loads(line)["question"].lower() for p in probes.glob("*.jsonl")
             for line in p.read_text().splitlines()}
    assert len(gated) >= 80
    assert not gated & {q.lower() for q in [f.question for f in data.facts] + texts}


@pytest.mark.parametrize(("pref", "yes", "no"), [
    ("brief", "Boil it for six minutes.", "word " * 31),
    ("brief", "Two steps.", "Steps:\n- one\n- two"),
    ("lowercase", "boil it for six minutes.", "Boil it for six minutes."),
    ("plain", "Boil it for six minutes.", "Boil it 🥚 for six minutes."),
    ("plain", "First this. Then that.", "1. first\n2. then"),
    ("no_question", "Boil it for six minutes.", "Boil it. Would you like more tips?"),
    ("one_paragraph", "Boil it.\nThen peel it.", "Boil it.\n\nThen peel it."),
    ("one_paragraph", "Boil it for six minutes.", "Boil it.\n  \nThen peel it."),
])
def test_each_preference_has_a_checker(pref: str, yes: str, no: str) -> None:
    assert satisfies(pref, yes) and not satisfies(pref, no)
    assert not satisfies(pref, "")


class Assistant:
    """Answers from a script; records requests."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((dict(request.headers), body))
        text = self.replies.pop(0) if body.get("max_tokens") != 1 else "x"
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": "default",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}]})


async def test_a_person_objects_to_off_topic_then_to_style_then_praises() -> None:
    import random

    data = load()
    rng = random.Random(3)
    first = random.Random(3).choice(data.split("train"))  # the question the session asks
    topic = first.topic[0]
    script = Assistant([
        "i like turtles.",                      # off topic: an objection restating it
        f"Sure! {topic.upper()} Matters. Would you like more?",  # on topic, not lowercase
        f"{topic} it is.",                      # both: praise or the next question
        f"{topic} again.",
    ])
    client = AsyncOpenAI(base_url="http://proxy.test/v1", api_key="ck-test",
                         http_client=httpx.AsyncClient(transport=httpx.MockTransport(script)))
    person = Person("person-0-lowercase", "lowercase", client, data)
    await person.chat_session(rng, questions=1, max_redos=2)
    await client.close()
    assert [(e["on_topic"], e["satisfied"]) for e in person.log] == [
        (False, True), (True, False), (True, True)]
    said = [b["messages"][-1]["content"] for _, b in script.requests]
    assert first.text in said[1] and said[1] != first.text  # the objection restates it
    assert said[2] in data.followups["style:lowercase"]
    headers, last = script.requests[-1]
    assert headers["x-session-done"] == "true" and last["max_tokens"] == 1
    assert last["messages"][-1]["content"] in data.followups["praise"]
    # No temperature sent: the model's own sampling defaults, as a chat app leaves them.
    assert all("temperature" not in b for _, b in script.requests)


def test_a_real_model_by_name_is_an_everyday_run() -> None:
    config = cli.parse_args(["--model", "smollm2-135m", "--lr", "1e-5"])
    assert config.everyday and config.prefs == DEFAULT_PREFS and config.rounds == 10
    assert set(DEFAULT_PREFS) < set(PREFS) and "no_question" not in DEFAULT_PREFS
    assert config.methods == ("combine", "none") and config.model.name == "smollm2-135m"
    env = evalconfig.stack_env(config, "combine")
    assert "CLAWRL_TRAINER__LR" not in env  # the model's recipe ...
    assert config.extra_env == {"CLAWRL_TRAINER__LR": "1e-05"}  # ... but what was asked
    assert not cli.parse_args([]).everyday
    steps = cli.parse_args(["--model", "smollm2-135m", "--mini-batches", "4"])
    assert steps.extra_env == {"CLAWRL_TRAINER__MINI_BATCHES": "4"}


def test_the_people_chat_until_the_trainers_batch_is_full() -> None:
    """The people are users of one shared model, so the trainer draws them by the product's
    fair share; a round chats until every person has a quota, which is exactly when the
    trainer's batch is full (else each round waited out the trainer's MAX_WAIT_S)."""
    config = cli.parse_args(["--model", "smollm2-135m"])
    env = evalconfig.stack_env(config, "combine")
    settings = TrainerSettings(**{k.removeprefix("CLAWRL_TRAINER__").lower(): v
                                  for k, v in env.items() if k.startswith("CLAWRL_TRAINER__")})
    rule = settings.share_rule
    assert rule == TrainerSettings(batch_size=config.batch_size).share_rule  # the defaults
    quota = evalconfig.version_quota(config, "combine")
    people = len(config.prefs)
    assert quota == rule.quota == config.batch_size // 2
    # every person waiting with a quota fills the batch; one short of it does not
    def drawn(waiting: dict[int, int]) -> int:
        return sum(min(n, limit) for n, limit in zip(
            waiting.values(), user_limits(waiting, rule).values(), strict=True))

    waiting = {user: quota for user in range(people)}
    assert drawn(waiting) == full_size(people, rule) == quota * people
    assert drawn({**waiting, 0: quota - 1}) < full_size(people, rule)


def test_a_real_model_takes_no_tiny_world_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--model", "smollm2-135m", "--small"]) == 2
    assert "a real model (--model NAME) takes none of" in capsys.readouterr().err
    assert cli.main(["--model", "smollm2-135m", "--prefs", "shouting"]) == 2

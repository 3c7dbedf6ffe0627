"""The gate before serving (trainer/gate.py): a version that lost what the model knew is
never published; the trainer goes back to the served weights with a smaller learning rate.

Against real Postgres, the real trainer loop and the real embedded engine, on the tiny world
model, whose facts ("Where does Ada live?") are its capability: the probe is its held-out
questions with their answers. Samples that teach those very questions wrong answers are what
damages it here, as a style's reward damaged SmolLM2's facts.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import select
from sqlalchemy.engine import Engine

from clawrl.base.db import PolicyVersion
from clawrl.world.town import World, wrong_world
from trainer.config import Settings, TrainerSettings
from trainer.gate import Gate, GateResult, ProbeError, ProbeItem, is_right, load_probe
from trainer.train import train

SampleFactory = Callable[..., int]
REPO = Path(__file__).resolve().parents[2]
KNOWS = REPO / "clawrl" / "world" / "prebuilt" / "tinyworld-ci"  # knows its world's facts
PROBE_SIZE = 12


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def write_probe(path: Path) -> Path:
    world = World.build(0)
    with path.open("w") as f:
        for q in world.heldout[:PROBE_SIZE]:
            f.write(json.dumps({"question": q.text, "answers": [world.answer(q)]}) + "\n")
    return path


def test_a_bad_probe_is_one_readable_line(tmp_path: Path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"question": "Where?", "answers": ["Rome"]}\n{"question": "x"}\n')
    with pytest.raises(ProbeError, match=r"p\.jsonl:2: expected"):
        load_probe(bad)
    bad.write_text('{"question": "Where?", "answers": []}\n')
    with pytest.raises(ProbeError, match="at least one answer"):
        load_probe(bad)
    bad.write_text("\n")
    with pytest.raises(ProbeError, match="no questions"):
        load_probe(bad)
    with pytest.raises(ProbeError, match="No such file"):
        load_probe(tmp_path / "missing.jsonl")
    bad.write_text('{"question": "How do I unclog a sink?", "topic": []}\n')
    with pytest.raises(ProbeError, match="at least one topic word"):
        load_probe(bad)
    bad.write_text('{"question": "How?", "topic": "drain"}\n')
    with pytest.raises(ProbeError, match="at least one topic word"):
        load_probe(bad)


def test_both_kinds_load_and_an_open_question_is_on_topic_by_its_words(
        tmp_path: Path) -> None:
    probe = tmp_path / "p.jsonl"
    probe.write_text('{"question": "Capital of Italy?", "answers": ["Rome"]}\n'
                     '{"question": "How do I unclog a sink?", "topic": ["drain", "plunger"]}\n')
    fact, open_ = load_probe(probe)
    assert fact.answers == ("Rome",) and not fact.topic
    assert open_.topic == ("drain", "plunger") and not open_.answers
    assert open_.on_topic("Pour hot water down the DRAINS.")  # a word's start, any case
    assert open_.on_topic("Use a plunger.") and not open_.on_topic("Bake it for 20 minutes.")
    assert not open_.on_topic("Try the undrained pasta.")  # not inside another word


def test_a_drop_on_either_kind_fails_and_says_which() -> None:
    both = GateResult(base=0.7, candidate=0.7, max_drop=0.05, questions=10, newly_wrong=[],
                      topic_base=0.95, topic_candidate=0.6, max_topic_drop=0.1,
                      topic_questions=20, newly_off_topic=["How?"])
    assert not both.passed and both.summary() == "facts 0.70 -> 0.70, on topic 0.95 -> 0.60"
    assert GateResult(0.7, 0.6, 0.05, 10, ["Where?"]).passed is False
    open_only = GateResult(None, None, 0.05, 0, [], 1.0, 0.95, 0.1, 20, ["How?"])
    assert open_only.passed and open_only.summary() == "on topic 1.00 -> 0.95"


def test_answers_match_as_whole_words() -> None:
    assert is_right("The capital of Italy is Rome.", ("Rome",))
    assert is_right("ROME!", ("rome",)) and is_right("about 100 degrees", ("100",))
    assert not is_right("Romeo", ("Rome",)) and not is_right("1000", ("100",))
    assert not is_right("It freezes at -18.0°C.", ("0",))
    assert is_right("It is carbon dioxide.", ("carbon dioxide", "CO2"))


def test_the_probe_tells_a_model_that_knows_from_one_that_does_not(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gate = Gate(load_probe(write_probe(tmp_path / "probe.jsonl")), 0.05,
                AutoTokenizer.from_pretrained(KNOWS))
    assert "facts right" in gate.measure_base(AutoModelForCausalLM.from_pretrained(KNOWS))
    assert gate.base_marks is not None
    base = sum(gate.base_marks[0]) / PROBE_SIZE
    assert base >= 0.75  # the tiny world model answers its held-out questions
    random = gate.check(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert random.candidate is not None and random.candidate <= 0.1 and not random.passed
    assert len(random.newly_wrong) >= int(base * PROBE_SIZE) - 1
    assert random.topic_base is None  # a probe of facts only
    same = gate.check(AutoModelForCausalLM.from_pretrained(KNOWS))
    assert same.passed and same.candidate == base and same.newly_wrong == []


def test_open_questions_tell_a_model_that_stays_on_topic_from_one_that_wanders(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """The tiny world's replies name the person asked about ("- ADA LIVES IN …"): a reply
    that names nobody asked about has left the question, right answer or not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    world = World.build(0)
    probe = tmp_path / "open.jsonl"
    probe.write_text("".join(json.dumps({"question": q.text, "topic": [q.name]}) + "\n"
                             for q in world.heldout[:PROBE_SIZE]))
    gate = Gate(load_probe(probe), 0.05, AutoTokenizer.from_pretrained(KNOWS), 0.1)
    assert "open questions on topic" in gate.measure_base(
        AutoModelForCausalLM.from_pretrained(KNOWS))
    wandered = gate.check(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert wandered.topic_base is not None and wandered.topic_base >= 0.9
    assert wandered.topic_candidate is not None and wandered.topic_candidate <= 0.2
    assert not wandered.passed and wandered.base is None
    assert len(wandered.newly_off_topic) >= PROBE_SIZE - 3
    assert gate.check(AutoModelForCausalLM.from_pretrained(KNOWS)).passed


def teach_wrong_answers(url: str, add_sample: SampleFactory, n: int) -> None:
    """`n` samples, each a probe question answered wrong, rewarded +1, with the serving
    model's logprobs of that answer (as a judge-approved turn would carry)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(KNOWS)
    world = World.build(0)
    for i in range(n):
        q = world.heldout[i % PROBE_SIZE]
        wrong = wrong_world(world, q, random.Random(i)).answer(q)
        text = tok.apply_chat_template([{"role": "user", "content": q.text}],
                                       add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(str(text), add_special_tokens=False)  # as the engine renders it
        response = tok.encode(f"{q.name} {wrong}.", add_special_tokens=False)
        r = httpx.post(url + "/generate", timeout=60, json={
            "input_ids": prompt + response, "return_logprob": True,
            "logprob_start_len": len(prompt) - 1, "sampling_params": {"max_new_tokens": 0}})
        r.raise_for_status()
        meta = r.json()["meta_info"]
        add_sample(prompt_ids=prompt, response_ids=response, reward=1,
                   rollout_logprobs=[t[0] for t in meta["input_token_logprobs"][1:]],
                   weight_version=meta["weight_version"])


def settings_for(tmp_path: Path, db_url: str, url: str, model: Path, **kw: Any) -> Settings:
    trainer = TrainerSettings(**({
        "model": model, "batch_size": 24, "micro_batch_size": 8, "max_wait_s": 0.2,
        "poll_s": 0.05, "kl_coef": 0.0, "lr": 1e-3, "device": "cpu", "publish_attempts": 2,
        "publish_backoff_s": 0.05, "gate_probe": write_probe(tmp_path / "probe.jsonl"),
        "gate_max_drop": 0.0} | kw))
    return Settings(state_dir=tmp_path / "state", database={"url": db_url},  # type: ignore[arg-type]
                    engine={"url": url}, trainer=trainer)  # type: ignore[arg-type]


def version_rows(db: Engine) -> dict[int, tuple[str, dict[str, Any]]]:
    t = PolicyVersion.__table__
    with db.connect() as conn:
        return {r.version: (r.status, r.stats) for r in
                conn.execute(select(t.c.version, t.c.status, t.c.stats))}


def test_a_version_that_forgot_is_rejected_and_the_trainer_backs_off(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        engine_factory: Callable[..., str], capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(KNOWS, model)
    url = engine_factory(model)
    teach_wrong_answers(url, add_sample, 24)
    train(settings_for(tmp_path, db_url, url, model), max_steps=1, once=True)
    [(version, (status, stats))] = version_rows(db).items()
    gate = stats["gate"]
    assert status == "rejected" and not gate["passed"], gate
    assert gate["candidate"] < gate["base"] and gate["newly_wrong"]
    assert gate["questions"] == PROBE_SIZE and gate["max_drop"] == 0.0
    # Never served: the engine still has the base weights.
    assert httpx.get(url + "/model_info").json()["weight_version"] == "default"
    out = capsys.readouterr().out
    assert f"v{version} REJECTED by the gate" in out and "back to v0, lr 0.0005" in out
    # A restart does not resume from the rejected version, and keeps the back-off.
    teach_wrong_answers(url, add_sample, 24)
    train(settings_for(tmp_path, db_url, url, model, gate_max_drop=1.0), max_steps=1,
          once=True)
    rows = version_rows(db)
    assert rows[version][0] == "rejected"
    newer = max(rows)
    assert newer > version and rows[newer][0] == "published"
    assert rows[newer][1]["gate"]["passed"] is True
    assert httpx.get(url + "/model_info").json()["weight_version"] == str(newer)


def test_a_verdict_is_settled_only_once_the_reply_cannot_undo_it() -> None:
    fact = ProbeItem("What is the capital of Italy?", answers=("Rome",))
    assert not fact.settled("The capital of Italy is Rome")  # might go on to "Romeo"
    assert fact.settled("The capital of Italy is Rome.") and fact.settled("Rome is")
    assert not fact.settled("It is Romeo") and not fact.settled("It is not known")
    open_ = ProbeItem("How do I unclog a sink?", topic=("drain", "plunger"))
    assert open_.settled("Pour hot water down the drai\ufffd") is False
    assert open_.settled("Use a plung") is False and open_.settled("Use a plunger")
    assert open_.settled("Pour it down the drain")  # "drain" begins a word: on topic already

"""The shared model as a LoRA adapter (trainer/policy_adapter.py) against real Postgres and the
real embedded engine on the tiny model: a step saves an adapter folder and publishes it with
`/load_lora_adapter` (the base weights never move); samples the engine generates with that
adapter are on-policy for the next step; older adapters are unloaded but the previous one; a
restarted engine gets the served one again; rollback and the gate work on adapter versions.
The proxy's side (serving the adapter, the turn's policy version) is tests/proxy/
test_adapters.py; the full-weight path is tests/trainer/test_train_loop.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from proxyharness import RunningProxy, create_user, query, serve
from sqlalchemy import text
from sqlalchemy.engine import Engine
from test_gate import KNOWS, teach_wrong_answers
from test_gate import settings_for as gate_settings
from test_train_loop import PROMPT, settings_for

from clawrl.base.settings import EngineSettings
from trainer.metrics import TrainerMetrics
from trainer.policy_adapter import served_adapter
from trainer.train import ensure_serving, train
from trainer.versions import VersionsError, prune, rollback

SampleFactory = Callable[..., int]
LORA = {"enabled": True, "r": 4, "alpha": 16}
CHAT = [{"role": "user", "content": "Where does Ada live?"}]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def rollout(url: str, prompt: list[int], lora: str | None = None,
            version: str | None = None) -> dict[str, Any]:
    """Six tokens sampled at temperature 1 (with `lora`: by that adapter), and what a sample
    row needs; `version`: the turn's policy version as the proxy records it for the shared
    model's adapter (the engine's own label names the base)."""
    body: dict[str, Any] = {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = httpx.post(url + "/generate", json=body, timeout=60)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return {"prompt_ids": prompt, "response_ids": [t[1] for t in meta["output_token_logprobs"]],
            "rollout_logprobs": [t[0] for t in meta["output_token_logprobs"]],
            "weight_version": version or meta["weight_version"]}


def add_batch(add_sample: SampleFactory, url: str, lora: str | None = None,
              version: str | None = None) -> None:
    for i, reward in enumerate([1, -1, 1, -1]):
        add_sample(reward=reward, **rollout(url, PROMPT[: 4 + i], lora, version))


def engine_adapters(url: str) -> set[str]:
    data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def version_rows(db: Engine) -> dict[int, tuple[str, str | None]]:
    with db.connect() as conn:
        rows = conn.execute(text("SELECT version, status, adapter FROM policy_versions"))
        return {r.version: (r.status, r.adapter) for r in rows}


def last_step(db: Engine) -> dict[str, Any]:
    with db.connect() as conn:
        metrics: dict[str, Any] = conn.execute(text(
            "SELECT metrics FROM training_steps ORDER BY step DESC LIMIT 1")).scalar_one()
    return metrics


def turn_through_proxy(tmp_path: Path, db_url: str, engine_url: str) -> tuple[Any, ...]:
    """One greedy chat through the real proxy by a user without an adapter of their own;
    returns the turn's (adapter, weight_version, response_ids)."""
    from clawrl.base.settings import load_settings
    from proxy.app import create_app

    _, key = create_user(db_url, "carol")

    async def ask() -> str:
        settings = load_settings(state_dir=tmp_path / "proxy", engine={"url": engine_url},
                                 proxy={"journal_path": tmp_path / "journal.jsonl"})
        app = create_app(settings, db_url=db_url)
        async with serve(app) as url:
            proxy = RunningProxy(url, app)
            async with proxy.client(key) as client:
                raw = await client.chat.completions.with_raw_response.create(
                    model="default", messages=CHAT, max_tokens=6, temperature=0)
            await proxy.settle()
            return raw.headers["x-clawrl-turn-id"]

    uid = asyncio.run(ask())
    [row] = query(db_url, "SELECT adapter, weight_version, response_ids FROM turns "
                          "WHERE uid = %s", uuid.UUID(uid))
    return row


def engine_chat_ids(url: str, lora: str | None) -> list[int]:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": CHAT, "max_tokens": 6, "temperature": 0,
        "return_token_ids": True, "lora_path": lora})
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["choices"][0]["response_token_ids"]
    return ids


def lora_settings(tmp_path: Path, db_url: str, url: str, model: Path, **kw: Any) -> Any:
    return settings_for(tmp_path, db_url, url, model, lora=LORA, adapter_lr=5e-3,
                        keep_trainer_states=1, **kw)


def test_adapter_versions_are_published_served_on_policy_restored_and_rolled_back(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        tiny_model_dir: Path, engine_factory: Callable[..., str]) -> None:
    url = engine_factory(tiny_model_dir)
    settings = lora_settings(tmp_path, db_url, url, tiny_model_dir)
    add_batch(add_sample, url)
    assert train(settings, max_steps=1) == 1

    # v1 is an adapter folder (a few KB here), not a model; the engine serves it beside the
    # base, whose weights never moved.
    v1 = settings.weights_dir() / "v000001"
    assert (v1 / "adapter_config.json").is_file()
    assert (v1 / "adapter_model.safetensors").is_file()
    assert not (v1 / "config.json").exists() and not (v1 / "model.safetensors").exists()
    assert set(json.loads((v1 / "clawrl_complete.json").read_text())["files"]) == {
        "adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert version_rows(db) == {1: ("published", "policy-v1")}
    assert engine_adapters(url) == {"policy-v1"}
    assert httpx.get(url + "/model_info").json()["weight_version"] == "default"
    # Through the proxy, a user without an adapter of their own is served policy-v1, and
    # the turn's policy version is 1 (what the trainer reads for staleness and ratios).
    adapter, label, ids = turn_through_proxy(tmp_path, db_url, url)
    assert (adapter, label) == ("policy-v1", "1")
    assert ids == engine_chat_ids(url, "policy-v1")

    # Samples the engine generates with policy-v1 (the proxy records their version as 1)
    # are on-policy for the live adapter: the step's first ratio is 1.
    add_batch(add_sample, url, "policy-v1", "1")
    assert train(settings, max_steps=1) == 1
    metrics = last_step(db)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4), metrics
    assert metrics["abs_log_ratio_max"] < 1e-3
    assert engine_adapters(url) == {"policy-v1", "policy-v2"}  # the previous one stays
    add_batch(add_sample, url, "policy-v2", "2")
    assert train(settings, max_steps=1) == 1
    assert last_step(db)["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert engine_adapters(url) == {"policy-v2", "policy-v3"}  # v1 unloaded
    assert served_adapter(db) == "policy-v3"
    # keep_trainer_states 1: the older folders keep their adapter, not their optimizer.
    assert not (v1 / "trainer_state").exists() and (v1 / "adapter_model.safetensors").is_file()

    # An engine restarted forgets its adapters: the trainer loads the served one again.
    fresh = engine_factory(tiny_model_dir)
    metrics_file = TrainerMetrics(tmp_path / "m.prom", None)
    ensure_serving(db, EngineSettings(url=fresh), settings.trainer, 3, settings.weights_dir(),
                   metrics_file)
    assert engine_adapters(fresh) == {"policy-v3"}
    v3_here = rollout(url, PROMPT, "policy-v3")
    v3_there = rollout(fresh, PROMPT, "policy-v3")
    assert v3_here["rollout_logprobs"] != pytest.approx(rollout(url, PROMPT)["rollout_logprobs"])
    assert v3_there["response_ids"] and len(v3_there["rollout_logprobs"]) == 6

    # Rollback to v1 (its trainer_state was dropped): loaded again, newer versions retired;
    # the adapter served until now stays loaded for proxies that still name it.
    info = rollback(db, EngineSettings(url=url), settings.weights_dir(), 1)
    assert info["adapter"] == "policy-v1"
    assert version_rows(db) == {1: ("published", "policy-v1"), 2: ("retired", "policy-v2"),
                                3: ("retired", "policy-v3")}
    assert served_adapter(db) == "policy-v1"
    assert engine_adapters(url) == {"policy-v1", "policy-v3"}
    # The restarted trainer continues from v1's adapter: samples of policy-v1 are on-policy.
    add_batch(add_sample, url, "policy-v1", "1")
    assert train(settings, max_steps=1) == 1
    assert last_step(db)["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert version_rows(db)[4] == ("published", "policy-v4")
    assert engine_adapters(url) == {"policy-v1", "policy-v4"}
    # Prune never deletes the served adapter version.
    assert prune(db, EngineSettings(url=url), settings.weights_dir(), keep=1) == [1, 2, 3]
    assert (settings.weights_dir() / "v000004" / "adapter_model.safetensors").is_file()
    with pytest.raises(VersionsError, match="no version 9"):
        rollback(db, EngineSettings(url=url), settings.weights_dir(), 9)

    # Rollback to the base model: no shared adapter is served or loaded any more.
    assert rollback(db, EngineSettings(url=url), settings.weights_dir(), 0)["adapter"] is None
    assert served_adapter(db) is None and engine_adapters(url) == set()
    assert {s for s, _ in version_rows(db).values()} == {"retired"}


def test_the_gate_rejecting_an_adapter_version_leaves_the_served_one(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        engine_factory: Callable[..., str], capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(KNOWS, model)
    url = engine_factory(model)

    def settings(max_drop: float) -> Any:
        # Four optimizer steps a version: one Adam step from B = 0 moves a rank-4 adapter too
        # little for the damage to be sure, and whether a greedy answer flipped was then up
        # to the last bits of a threaded matmul (it passed and failed on the same code).
        return gate_settings(tmp_path, db_url, url, model, lora=LORA, adapter_lr=1e-2,
                             gate_max_drop=max_drop, epochs=4)

    teach_wrong_answers(url, add_sample, 24)
    assert train(settings(1.0), max_steps=1, once=True) == 1  # any drop passes
    assert version_rows(db) == {1: ("published", "policy-v1")}
    teach_wrong_answers(url, add_sample, 24)
    train(settings(0.0), max_steps=1, once=True)
    rows = version_rows(db)
    assert rows[2] == ("rejected", None), rows
    assert "v2 REJECTED by the gate" in capsys.readouterr().out
    # Never loaded: the engine and the proxy's pick are still v1.
    assert engine_adapters(url) == {"policy-v1"} and served_adapter(db) == "policy-v1"

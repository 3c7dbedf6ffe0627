"""Personal LoRA adapters through the real proxy, the real engine and Postgres: the proxy picks
the adapter from the API key's user (`user_adapters`), logs which one served each turn, and
serves the base model to users without one — or whose adapter the engine does not have."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from loras import make_adapters_in_child
from proxyharness import ProxyFactory, create_user, query

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("user-adapters")
    return make_adapters_in_child(tiny_model_dir, {root / f"v{i}": 10 + i for i in (1, 2)})


def direct_ids(engine_url: str, lora: str | None) -> list[int]:
    body = {"model": "default", "messages": MESSAGES, "return_token_ids": True, "lora_path": lora,
            **GREEDY}
    r = httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["choices"][0]["response_token_ids"]
    return ids


def publish(db_url: str, user_id: int, name: str, version: int, path: Path,
            loaded: bool = True) -> None:
    """What a publisher writes once the engine has the adapter (docs/proxy.md)."""
    query(db_url, "INSERT INTO user_adapters (user_id, name, version, path, loaded) "
                  "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (user_id) DO UPDATE SET "
                  "name = EXCLUDED.name, version = EXCLUDED.version, path = EXCLUDED.path, "
                  "loaded = EXCLUDED.loaded, updated_at = now() RETURNING user_id",
          user_id, name, version, str(path), loaded)


def served(db_url: str, uid: str, last: str = "status") -> tuple[Any, ...]:
    """The turn's adapter, adapter_version, response_ids and `last` (a column)."""
    rows = query(db_url, f"SELECT adapter, adapter_version, response_ids, {last} FROM turns "
                         "WHERE uid = %s", uuid.UUID(uid))
    assert len(rows) == 1
    return rows[0]


async def test_the_proxy_serves_each_user_their_adapter(
        proxy_factory: ProxyFactory, db_url: str, engine_factory: Any,
        tiny_model_dir: Path, adapter_dirs: list[Path]) -> None:
    engine = engine_factory(tiny_model_dir)
    async with httpx.AsyncClient(base_url=engine, timeout=60) as http:
        for name, path in (("user-alice-v1", adapter_dirs[0]),
                           ("user-alice-v2", adapter_dirs[1])):
            r = await http.post("/load_lora_adapter", json={"lora_name": name,
                                                            "lora_path": str(path)})
            assert r.status_code == 200, r.text
    base, v1, v2 = (direct_ids(engine, lora) for lora in (None, "user-alice-v1",
                                                           "user-alice-v2"))
    assert len({tuple(base), tuple(v1), tuple(v2)}) == 3

    alice, alice_key = create_user(db_url, "alice")
    _, bob_key = create_user(db_url, "bob")  # no adapter: the base model
    carol, carol_key = create_user(db_url, "carol")
    publish(db_url, alice, "user-alice-v1", 1, adapter_dirs[0])
    # Carol's row says loaded, but the engine has no such adapter (restarted, say).
    publish(db_url, carol, "user-carol-v1", 1, adapter_dirs[0])
    proxy = await proxy_factory(engine)

    async def ask(key: str, *, stream: bool = False, model: str = "default") -> str:
        async with proxy.client(key) as client:
            if stream:
                async with client.chat.completions.with_streaming_response.create(
                        model=model, messages=MESSAGES, stream=True, **GREEDY) as raw:
                    async for _ in raw.iter_lines():
                        pass
                    return raw.headers["x-clawrl-turn-id"]
            raw_reply = await client.chat.completions.with_raw_response.create(
                model=model, messages=MESSAGES, **GREEDY)
            return raw_reply.headers["x-clawrl-turn-id"]

    turns = await asyncio.gather(ask(alice_key), ask(alice_key, stream=True), ask(bob_key),
                                 ask(carol_key), ask(bob_key, model="default:user-alice-v1"))
    await proxy.settle()
    rows = [served(db_url, uid) for uid in turns]
    assert rows[0] == ("user-alice-v1", 1, v1, "ok")
    assert rows[1] == ("user-alice-v1", 1, v1, "ok")  # streamed
    assert rows[2] == (None, None, base, "ok")
    assert rows[3] == (None, None, base, "ok")  # fell back to the base model
    assert rows[4] == (None, None, base, "ok")  # nobody names someone else's adapter

    # Clients see the base model only, never the users' adapters.
    async with proxy.client(bob_key) as client:
        assert [m.id for m in (await client.models.list()).data] != []
        assert not any("user-" in m.id for m in (await client.models.list()).data)

    # A new version: the publisher loads it, then flips the row; the proxy follows within
    # its key-cache TTL (2 s).
    publish(db_url, alice, "user-alice-v2", 2, adapter_dirs[1])
    await asyncio.sleep(2.5)
    uid = await ask(alice_key)
    # Marked not loaded (an unpublish): the base model again.
    publish(db_url, alice, "user-alice-v2", 2, adapter_dirs[1], loaded=False)
    await asyncio.sleep(2.5)
    uid_base = await ask(alice_key)
    await proxy.settle()
    assert served(db_url, uid) == ("user-alice-v2", 2, v2, "ok")
    assert served(db_url, uid_base) == (None, None, base, "ok")


async def test_users_without_their_own_adapter_get_the_shared_models_adapter(
        proxy_factory: ProxyFactory, db_url: str, engine_factory: Any,
        tiny_model_dir: Path, adapter_dirs: list[Path],
        caplog: pytest.LogCaptureFixture) -> None:
    """The shared model learning as an adapter (trainer/policy_adapter.py): the newest
    published version's adapter serves every user without one of their own, and the turn's
    policy version is that version (the engine's label names the base); a user's own adapter
    wins; an adapter the engine lacks falls back to the base, logged, with the base's label."""
    engine = engine_factory(tiny_model_dir)
    async with httpx.AsyncClient(base_url=engine, timeout=60) as http:
        for name, path in (("policy-v3", adapter_dirs[0]), ("user-alice-v1", adapter_dirs[1])):
            r = await http.post("/load_lora_adapter", json={"lora_name": name,
                                                            "lora_path": str(path)})
            assert r.status_code == 200, r.text
    base, shared, own = (direct_ids(engine, lora) for lora in (None, "policy-v3",
                                                               "user-alice-v1"))
    assert len({tuple(base), tuple(shared), tuple(own)}) == 3
    alice, alice_key = create_user(db_url, "alice")
    _, dave_key = create_user(db_url, "dave")
    publish(db_url, alice, "user-alice-v1", 1, adapter_dirs[1])
    # v3 is the newest published version; v4 the gate rejected (never served).
    for version, status, adapter in ((2, "published", "policy-v2"),
                                     (3, "published", "policy-v3"), (4, "rejected", None)):
        query(db_url, "INSERT INTO policy_versions (version, path, status, adapter) "
                      "VALUES (%s, '/v', %s, %s) RETURNING version", version, status, adapter)
    proxy = await proxy_factory(engine)

    async def ask(key: str) -> str:
        async with proxy.client(key) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="default", messages=MESSAGES, **GREEDY)
            return raw.headers["x-clawrl-turn-id"]

    dave, alice_turn = await ask(dave_key), await ask(alice_key)
    await proxy.settle()
    assert served(db_url, dave, "weight_version") == ("policy-v3", None, shared, "3")
    assert served(db_url, alice_turn, "weight_version") == ("user-alice-v1", 1, own, "default")

    # The engine lost the adapter (restarted): the base serves, and says so in the log.
    async with httpx.AsyncClient(base_url=engine, timeout=60) as http:
        r = await http.post("/unload_lora_adapter", json={"lora_name": "policy-v3"})
        assert r.status_code == 200, r.text
    with caplog.at_level("WARNING"):
        fallback = await ask(dave_key)
    await proxy.settle()
    assert served(db_url, fallback, "weight_version") == (None, None, base, "default")
    assert any(getattr(rec, "action", None) == "adapter_fallback" and "policy-v3" in
               rec.getMessage() for rec in caplog.records)

    # Rolled back to the base model (every version retired): no adapter within the TTL.
    query(db_url, "UPDATE policy_versions SET status = 'retired' RETURNING version")
    await asyncio.sleep(2.5)
    after = await ask(dave_key)
    await proxy.settle()
    assert served(db_url, after, "weight_version") == (None, None, base, "default")

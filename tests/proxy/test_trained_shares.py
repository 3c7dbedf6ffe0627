"""`/metrics` shows each user's share of what the shared model was trained on (proxy/metrics.py
`TrainedShares`), read from a real Postgres by the app's lifespan, not per scrape."""

from __future__ import annotations

import asyncio
import uuid

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from proxyharness import ProxyFactory
from sqlalchemy import insert, text

from clawrl.base.db import Judgment, Sample, Turn, User, create_async, create_engine
from proxy.metrics import TrainedShares


def seed(db_url: str) -> dict[str, int]:
    """Shared steps 1-3 and a personal step 4: ada 6 samples, bob 2 in the shared model;
    carl 5 in his own adapter's step only."""
    db = create_engine(db_url)
    users: dict[str, int] = {}
    with db.begin() as conn:
        for name in ("ada", "bob", "carl"):
            users[name] = conn.execute(insert(User).values(name=name)
                                       .returning(User.id)).scalar_one()
        conn.execute(text("INSERT INTO training_steps (step, status, num_samples, num_tokens, "
                          "user_id) VALUES (1, 'ok', 3, 0, NULL), (2, 'ok', 3, 0, NULL), "
                          "(3, 'ok', 2, 0, NULL), (4, 'ok', 5, 0, :carl)"),
                     {"carl": users["carl"]})
        for name, step, n in (("ada", 1, 2), ("bob", 1, 1), ("ada", 2, 3), ("ada", 3, 1),
                              ("bob", 3, 1), ("carl", 4, 5), ("bob", None, 4)):
            for _ in range(n):
                turn = conn.execute(insert(Turn).values(
                    uid=uuid.uuid4(), user_id=users[name], request_messages=[],
                    status="ok").returning(Turn.id)).scalar_one()
                judgment = conn.execute(insert(Judgment).values(
                    turn_id=turn, prompt_version="v1").returning(Judgment.id)).scalar_one()
                conn.execute(insert(Sample).values(
                    turn_id=turn, judgment_id=judgment, user_id=users[name], prompt_ids=[1],
                    response_ids=[2], rollout_logprobs=[-1.0], reward=1, trained_step=step))
    db.dispose()
    return users


async def test_shares_over_the_newest_versions(db_url: str) -> None:
    users = seed(db_url)
    db = create_async(db_url)
    try:
        shares = TrainedShares(versions=2)  # steps 2 and 3: ada 4, bob 1
        registry = CollectorRegistry()
        registry.register(shares)
        assert "clawrl_trained_share{" not in generate_latest(registry).decode()
        await shares.refresh(db)
        body = generate_latest(registry).decode()
        assert f'clawrl_trained_share{{user_id="{users["ada"]}"}} 0.8' in body
        assert f'clawrl_trained_share{{user_id="{users["bob"]}"}} 0.2' in body
        assert f'clawrl_trained_samples_recent{{user_id="{users["ada"]}"}} 4.0' in body
        assert f'user_id="{users["carl"]}"' not in body  # his adapter is not the shared model
        # A user who drops out of the window drops out of the metric.
        shares.versions = 1
        await shares.refresh(db)
        body = generate_latest(registry).decode()
        assert f'clawrl_trained_share{{user_id="{users["ada"]}"}} 0.5' in body
        shares.versions = 0
        await shares.refresh(db)
        assert "clawrl_trained_share{" not in generate_latest(registry).decode()
    finally:
        await db.dispose()


async def test_the_proxys_metrics_show_each_users_share(proxy_factory: ProxyFactory,
                                                        db_url: str) -> None:
    users = seed(db_url)
    proxy = await proxy_factory("http://127.0.0.1:9")  # no engine needed for /metrics
    want = f'clawrl_trained_share{{user_id="{users["ada"]}"}} 0.75'  # 6 of the 8 shared
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        deadline = asyncio.get_running_loop().time() + 30
        while want not in (body := (await client.get("/metrics")).text):
            assert asyncio.get_running_loop().time() < deadline, body
            await asyncio.sleep(0.05)
    assert f'clawrl_trained_share{{user_id="{users["bob"]}"}} 0.25' in body

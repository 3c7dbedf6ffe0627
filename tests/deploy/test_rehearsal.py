"""The multi-node recipe run for real (deploy/rehearsal/rehearsal.sh): ten network-namespace
hosts, Postgres, HAProxy over two proxies, SGLang's router over two judge engines, two judge
workers, the policy engine and a torchrun job over two hosts, every role started by
deploy/multi-gpu/launch-node.sh. Chats go through the load balancer with the OpenAI SDK.

Then one proxy host and one judge engine host lose their link: requests fail over to the
other proxy, judge jobs to the other engine, nothing accepted is lost; healed, both hosts
take work again.

Needs root, iproute2, Postgres 15's binaries, HAProxy and a Python with `sglang_router`
(CLAWRL_ROUTER_PYTHON, default the test's own); skipped where any is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clawrl.bench.cluster import (
    Rehearsal,
    conversation,
    create_key,
    engine_prompt_tokens,
    new_user,
    query,
    wait_for,
)

ROUTER_PYTHON = os.environ.get("CLAWRL_ROUTER_PYTHON", sys.executable)


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("/usr/sbin/ip", "/usr/lib/postgresql/15/bin/initdb"):
        if not Path(tool).exists():
            return f"needs {tool}"
    if shutil.which("haproxy") is None:
        return "needs haproxy (apt-get install haproxy)"
    if subprocess.run([ROUTER_PYTHON, "-c", "import sglang_router"],
                      capture_output=True, check=False).returncode != 0:
        return "needs sglang-router (pip install sglang-router; CLAWRL_ROUTER_PYTHON)"
    return None


pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")


@pytest.fixture(scope="module")
def rehearsal() -> Iterator[Rehearsal]:
    with tempfile.TemporaryDirectory(prefix="clawrl-rehearsal-") as tmp:
        os.chmod(tmp, 0o755)  # Postgres runs as its own user under it
        r = Rehearsal(Path(tmp), {"PYTHON": sys.executable, "ROUTER_PYTHON": ROUTER_PYTHON})
        try:
            r.up()
            yield r
        finally:
            r.down()


def judge_jobs(db: str, user: str) -> dict[str, int]:
    rows = query(db, "SELECT j.status, count(*) FROM jobs j JOIN turns t ON t.id = j.turn_id "
                     "JOIN users u ON u.id = t.user_id WHERE u.name = %s AND j.kind = 'judge' "
                     "GROUP BY 1", user)
    return {status: n for status, n in rows}


def stored_once(db: str, uids: list[str]) -> bool:
    rows = query(db, "SELECT uid::text, count(*) FROM turns WHERE uid = ANY(%s::uuid[]) "
                     "GROUP BY 1", uids)
    return sorted(u for u, n in rows if n == 1) == sorted(uids)


def all_judged(db: str, user: str, conversations: int) -> bool:
    jobs = judge_jobs(db, user)
    return jobs.get("done", 0) >= conversations and set(jobs) == {"done"}


def proxy_turns(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("clawrl_turns_total"))


def test_cluster_serves_judges_trains_and_survives_a_cut(rehearsal: Rehearsal) -> None:
    from openai import OpenAI

    s = rehearsal.settings
    db, engine_key = s["CLAWRL_DATABASE__URL"], s["CLAWRL_ENGINE__API_KEY"]
    judge_engines = {h: f"http://{rehearsal.addr(h)}:30001" for h in ("je1", "je2")}
    px2 = f"http://{rehearsal.addr('px2')}:8000"
    user = new_user()
    with rehearsal.inside():
        key = create_key(rehearsal.lb_url, s["CLAWRL_PROXY__ADMIN_KEY"], user)
        client = OpenAI(base_url=rehearsal.lb_url + "/v1", api_key=key, max_retries=0,
                        timeout=90)
        # 1. All up: every turn stored once, every follow-up judged through the router (both
        # engines read prompts), a version trained by the two-node torchrun job and served.
        uids = [u for i in range(6) for u in conversation(client, i)]
        wait_for("turns stored", lambda: stored_once(db, uids), 60)
        wait_for("judged", lambda: all_judged(db, user, 6), 120)
        assert {m for (m,) in query(db, "SELECT DISTINCT judge_model FROM judgments")} == {"judge"}
        assert all(engine_prompt_tokens(u, engine_key) > 0 for u in judge_engines.values())
        wait_for("a version served", lambda: int(httpx.get(
            f"http://{rehearsal.addr('pol')}:30000/model_info", timeout=5,
            headers={"Authorization": f"Bearer {engine_key}"}).json()["weight_version"]) >= 1,
            180)
        served_uids = conversation(client, 0)
        wait_for("turns stored", lambda: stored_once(db, served_uids), 60)
        (version,) = query(db, "SELECT weight_version FROM turns WHERE uid = %s::uuid",
                           served_uids[0])[0]
        assert int(version) >= 1
        assert query(db, "SELECT count(*) FROM policy_versions WHERE status = 'published' "
                         "AND version = %s", int(version))[0][0] == 1
        px2_before = proxy_turns(px2)
        je2_before = engine_prompt_tokens(judge_engines["je2"], engine_key)
    assert "running" in rehearsal.run("status").split("tr1-trainer")[1].splitlines()[0]

    # 2. px2 and je2 cut off: the load balancer and the router route around them.
    rehearsal.run("cut", "px2")
    rehearsal.run("cut", "je2")
    with rehearsal.inside():
        cut_uids = [u for i in range(6) for u in conversation(client, i)]
        wait_for("turns stored", lambda: stored_once(db, cut_uids), 60)
        wait_for("judged with je2 cut", lambda: all_judged(db, user, 13), 180)

    # 3. Healed: both hosts take work again.
    rehearsal.run("heal", "px2")
    rehearsal.run("heal", "je2")
    with rehearsal.inside():
        healed = 0
        while healed < 12 and not (proxy_turns(px2) > px2_before and engine_prompt_tokens(
                judge_engines["je2"], engine_key) > je2_before):
            cut_uids += conversation(client, healed)
            healed += 1
            time.sleep(1)
        wait_for("px2 serves again", lambda: proxy_turns(px2) > px2_before, 30)
        wait_for("je2 judges again", lambda: engine_prompt_tokens(
            judge_engines["je2"], engine_key) > je2_before, 60)
        wait_for("turns stored", lambda: stored_once(db, cut_uids), 60)
        wait_for("judged after heal", lambda: all_judged(db, user, 13 + healed), 180)
        total = query(db, "SELECT count(*) FROM turns t JOIN users u ON u.id = t.user_id "
                          "WHERE u.name = %s", user)[0][0]
    assert total == len(uids) + len(served_uids) + len(cut_uids)

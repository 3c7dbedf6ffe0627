"""kill -9 of `python -m trainer.train` at many points, then restart: no sample lost or
trained twice, DB and checkpoint folders agree, the engine serves the newest version."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Engine

from clawrl.base.db import PolicyVersion, Sample, TrainingStep
from trainer.export import list_version_dirs, verify_version

SampleFactory = Callable[..., int]
PROMPT = [1, 30, 31, 32, 33, 2, 1, 40]
NUM_SAMPLES = 24
# Seconds after the trainer has resumed (model loaded) before SIGKILL: spread over claim,
# forward/backward, export, commit and publish of the first steps.
QUICK_DELAYS = [0.3, 0.9]
FULL_DELAYS = [0.05, 0.25, 0.45, 0.7, 1.0, 1.4]


def start_trainer(tmp_path: Path, db_url: str, engine_url: str, model: Path,
                  log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "CLAWRL_DATABASE__URL": db_url, "CLAWRL_ENGINE__URL": engine_url,
           "CLAWRL_STATE_DIR": str(tmp_path / "state"), "CLAWRL_TRAINER__MODEL": str(model),
           "CLAWRL_TRAINER__BATCH_SIZE": "2", "CLAWRL_TRAINER__MICRO_BATCH_SIZE": "1",
           "CLAWRL_TRAINER__MAX_WAIT_S": "0.1", "CLAWRL_TRAINER__POLL_S": "0.05",
           "CLAWRL_TRAINER__KL_COEF": "0.02", "CLAWRL_TRAINER__LR": "1e-4",
           "CLAWRL_TRAINER__DEVICE": "cpu", "CLAWRL_TRAINER__PUBLISH_BACKOFF_S": "0.05",
           # Every restart publishes again; don't let the samples go stale meanwhile.
           "CLAWRL_TRAINER__MAX_STALENESS": "1000",
           # One user's 24 samples: no cap per hour (tests/trainer/test_fair_batches.py).
           "CLAWRL_TRAINER__USER_WINDOW_BATCHES": "0"}
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "trainer.train"], stdout=fh,
                                stderr=subprocess.STDOUT, env=env)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def trained_counts(db: Engine) -> tuple[dict[int, int | str | None], dict[int, Any]]:
    """({sample id: trained_step, or its skipped_reason}, {step: training_steps row})."""
    s, t = Sample.__table__, TrainingStep.__table__
    with db.connect() as conn:
        samples = {r.id: r.trained_step or r.skipped_reason
                   for r in conn.execute(select(s.c.id, s.c.trained_step, s.c.skipped_reason))}
        steps = {r.step: r for r in conn.execute(select(t))}
    return samples, steps


@pytest.mark.parametrize("delays", [
    pytest.param(QUICK_DELAYS, id="2-kills"),
    pytest.param(FULL_DELAYS, id="6-kills", marks=pytest.mark.slow),
])
def test_kill_minus_nine_anywhere_loses_nothing_and_trains_nothing_twice(
        delays: list[float], tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        tiny_model_dir: Path, engine_factory: Callable[..., str]) -> None:
    url = engine_factory(tiny_model_dir)
    for i in range(NUM_SAMPLES):
        r = httpx.post(url + "/generate", json={
            "input_ids": PROMPT[: 3 + i % 5], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}},
            timeout=60).json()
        out = r["meta_info"]["output_token_logprobs"]
        add_sample(prompt_ids=PROMPT[: 3 + i % 5], response_ids=[t[1] for t in out],
                   rollout_logprobs=[t[0] for t in out], reward=1 if i % 2 else -1,
                   weight_version=r["meta_info"]["weight_version"])
    log = tmp_path / "trainer.log"

    for delay in delays:
        size = log.stat().st_size if log.exists() else 0
        proc = start_trainer(tmp_path, db_url, url, tiny_model_dir, log)
        wait_for(lambda size=size: "resuming at" in log.read_bytes()[size:].decode(  # type: ignore[misc]
            errors="replace"), 120, "the trainer to resume")
        time.sleep(delay)
        proc.kill()  # SIGKILL: no cleanup of any kind
        proc.wait(timeout=30)

    # A last, undisturbed run finishes the job; then stop it the polite way.
    proc = start_trainer(tmp_path, db_url, url, tiny_model_dir, log)

    def newest_status() -> str | None:
        with db.connect() as conn:
            return conn.execute(text("SELECT status FROM policy_versions "
                                     "ORDER BY version DESC LIMIT 1")).scalar()

    try:
        wait_for(lambda: all(v is not None for v in trained_counts(db)[0].values()), 180,
                 "every sample to be trained or skipped")
        # The last step's version is saved before it is published: wait for the publish
        # (on a busy machine it can lag the step's commit by seconds).
        wait_for(lambda: newest_status() == "published", 120, "the newest version published")
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    samples, steps = trained_counts(db)
    per_step = Counter(samples.values())
    assert all(isinstance(k, int) for k in per_step), per_step  # none skipped
    assert sum(per_step.values()) == NUM_SAMPLES
    # Every step row accounts for exactly the samples marked with it, steps are contiguous.
    assert sorted(steps) == list(range(1, len(steps) + 1))
    assert {n: r.num_samples for n, r in steps.items()} == dict(per_step)
    assert all(r.status == "ok" for r in steps.values())
    # DB versions and folders agree after the final restart, each folder complete.
    pv = PolicyVersion.__table__
    with db.connect() as conn:
        rows = {r.version: r.status for r in conn.execute(select(pv.c.version, pv.c.status))}
    weights = tmp_path / "state" / "weights"
    assert set(list_version_dirs(weights)) == set(rows) == set(steps)
    for path in list_version_dirs(weights).values():
        verify_version(path)
    newest = max(rows)
    assert rows[newest] == "published"
    assert httpx.get(url + "/model_info").json()["weight_version"] == str(newest)
    assert "Traceback" not in log.read_text().split("resuming at")[-1]

"""`clawrl train --backend megatron` end to end: real Postgres, the real embedded engine.

Samples are sampled by the engine (/generate with logprobs), trained by the megatron backend
in the trainer loop, exported, published, served; a restarted trainer resumes from megatron's
distributed checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import select
from sqlalchemy.engine import Engine

pytest.importorskip("megatron.core")

from childproc import free_port  # noqa: E402

from clawrl.base.db import PolicyVersion, TrainingStep  # noqa: E402
from trainer.backends.megatron import MegatronBackend  # noqa: E402
from trainer.config import Settings, TrainerSettings  # noqa: E402
from trainer.train import train  # noqa: E402

PROMPT = [1, 30, 31, 32, 33, 2, 1, 40]


def rollout(url: str, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(url + "/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}},
        timeout=60)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return {"prompt_ids": prompt, "response_ids": [t[1] for t in meta["output_token_logprobs"]],
            "rollout_logprobs": [t[0] for t in meta["output_token_logprobs"]],
            "weight_version": meta["weight_version"]}


def test_megatron_backend_trains_publishes_and_resumes(
        tmp_path: Path, db_url: str, db: Engine, add_sample: Callable[..., int],
        tiny_model_dir: Path, engine_factory: Callable[..., str]) -> None:
    torch.set_num_threads(1)
    url = engine_factory(tiny_model_dir)
    for i, reward in enumerate([1, -1, 1, -1]):
        add_sample(reward=reward, **rollout(url, PROMPT[: 5 + i]))
    trainer = TrainerSettings(backend="megatron", model=tiny_model_dir, batch_size=2,
                              micro_batch_size=1, max_wait_s=0.2, poll_s=0.05, kl_coef=0.02,
                              lr=1e-3, publish_attempts=2, publish_backoff_s=0.05)
    settings = Settings(state_dir=tmp_path / "state", database={"url": db_url},  # type: ignore[arg-type]
                        engine={"url": url}, trainer=trainer)  # type: ignore[arg-type]
    assert train(settings, max_steps=2) == 2

    with db.connect() as conn:
        rows = conn.execute(select(TrainingStep.__table__).order_by(TrainingStep.__table__.c.step)
                            ).mappings().all()
        published = conn.execute(select(PolicyVersion.__table__.c.version)
                                 .where(PolicyVersion.__table__.c.status == "published")).all()
    assert [(r["step"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok")]
    # megatron's recomputed logprobs equal the engine's serving logprobs: first ratio is 1
    assert rows[0]["metrics"]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert sorted(v for (v,) in published) == [1, 2]
    assert httpx.get(url + "/model_info").json()["weight_version"] == "2"
    state = tmp_path / "state" / "weights" / "v000002" / "trainer_state"
    assert (state / "megatron.json").is_file() and (state / "dist").is_dir()

    # A restarted trainer resumes from v2 with megatron's optimizer state and trains step 3.
    for reward in (1, 1):
        add_sample(reward=reward, **rollout(url, PROMPT))
    backend = MegatronBackend(trainer)
    assert train(settings, max_steps=1, backend=backend) == 1
    assert backend.steps == 3  # 2 restored from the checkpoint + 1
    assert httpx.get(url + "/model_info").json()["weight_version"] == "3"


@pytest.mark.slow
def test_torchrun_tensor_parallel_trainer_publishes(
        tmp_path: Path, db_url: str, add_sample: Callable[..., int], tiny_model_dir: Path,
        engine_factory: Callable[..., str]) -> None:
    """deploy/torchrun.sh with 2 CPU ranks (TP=2): rank 0 runs the loop, rank 1 follows."""
    url = engine_factory(tiny_model_dir)
    for reward in (1, -1):
        add_sample(reward=reward, **rollout(url, PROMPT))
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NPROC": "2", "TP": "2", "MASTER_PORT": str(free_port()),
           "PYTHON": sys.executable, "CLAWRL_STATE_DIR": str(tmp_path / "state"),
           "CLAWRL_DATABASE__URL": db_url, "CLAWRL_ENGINE__URL": url,
           "CLAWRL_TRAINER__BATCH_SIZE": "2", "CLAWRL_TRAINER__MAX_WAIT_S": "0.2"}
    proc = subprocess.run([str(repo / "deploy" / "torchrun.sh"), "--model", str(tiny_model_dir),
                           "--max-steps", "1"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "v1 published" in proc.stdout
    assert httpx.get(url + "/model_info").json()["weight_version"] == "1"

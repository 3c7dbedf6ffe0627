"""Training state on disk and how a restarted trainer finds where it stopped.

A checkpoint is a version folder (export.py: a model, or under LoRA the adapter) plus
`trainer_state/`: optimizer state from the backend, RNG states, and `state.json` written last. The database decides
which checkpoints are real: a folder counts only if its `policy_versions` row exists, because
that row is committed in the same transaction that marks the step's samples trained.

    restart: remove `.tmp-v*` and every version folder without a DB row (a crash between
    export and commit: its samples are still unmarked and will be trained again), then load
    the newest non-retired version whose folder verifies, else the base model.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from clawrl.base.db import PolicyVersion, TrainingStep
from trainer.backends.base import Backend
from trainer.config import TrainerSettings
from trainer.export import (
    ADAPTER_CONFIG,
    STATE_DIR,
    CheckpointError,
    list_version_dirs,
    remove_temp_dirs,
    verify_version,
    version_dir,
    write_version,
)

log = logging.getLogger("clawrl.trainer")
RNG_FILE = "rng.pt"
STATE_INFO = "state.json"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(backend: Backend, weights_dir: Path, version: int, base_model_dir: Path,
                    info: dict[str, Any] | None = None) -> Path:
    """Export weights + trainer state to `weights_dir/v{version:06d}` (marker last)."""

    def write(tmp: Path) -> None:
        backend.export(tmp)
        state = tmp / STATE_DIR
        backend.save_state(state)
        torch.save(rng_state(), state / RNG_FILE)
        (state / STATE_INFO).write_text(json.dumps({"version": version, **(info or {})}))

    return write_version(weights_dir, version, write, base_model_dir, info)


def has_trainer_state(path: Path) -> bool:
    return (path / STATE_DIR / STATE_INFO).is_file()


def load_checkpoint(backend: Backend, cfg: TrainerSettings, base_model_dir: Path,
                    path: Path | None) -> None:
    """Load the base model (path None) or a version folder into the backend.

    Full fine-tuning loads the weights from the folder; LoRA loads the base and then the
    folder's adapter (an adapter version) or the adapter its trainer_state kept (a merged
    version written before). The KL reference is always the base model.
    """
    if path is None:
        backend.load(base_model_dir)
        return
    verify_version(path)
    if cfg.lora.enabled and (path / ADAPTER_CONFIG).is_file():
        # An adapter version: the base, then the folder's adapter and its optimizer state
        # (a version whose trainer_state was dropped resumes with fresh moments).
        backend.load(base_model_dir)
        backend.load_adapter(path)  # type: ignore[attr-defined]  # torch: adapter_mode
        if has_trainer_state(path):
            restore_rng(torch.load(path / STATE_DIR / RNG_FILE, weights_only=True))
        return
    backend.load(base_model_dir if cfg.lora.enabled else path, reference_dir=base_model_dir)
    if has_trainer_state(path):
        backend.load_state(path / STATE_DIR)
        restore_rng(torch.load(path / STATE_DIR / RNG_FILE, weights_only=True))
    elif cfg.lora.enabled:
        raise CheckpointError(f"{path} has no trainer_state: LoRA adapters cannot be restored")
    else:
        log.warning("%s has no trainer_state; optimizer state starts fresh", path,
                    extra={"action": "resume_without_state"})


def drop_old_trainer_states(weights_dir: Path, keep: int) -> None:
    """Keep optimizer state only in the newest `keep` version folders (weights stay)."""
    dirs = [p for p in list_version_dirs(weights_dir).values() if has_trainer_state(p)]
    for path in dirs[:-keep] if keep > 0 else dirs:
        shutil.rmtree(path / STATE_DIR, ignore_errors=True)


@dataclass
class ResumePoint:
    version: int  # 0 = base model
    path: Path | None
    next_step: int
    published: bool


def find_resume_point(db: Engine, weights_dir: Path) -> ResumePoint:
    """Clean up after a crash and pick the checkpoint to continue from (see module doc)."""
    pv = PolicyVersion.__table__
    with db.connect() as conn:
        rows = conn.execute(select(pv.c.version, pv.c.status, pv.c.path)
                            .order_by(pv.c.version.desc())).all()
        last_step = conn.execute(select(func.max(TrainingStep.__table__.c.step))).scalar()
    known = {r.version for r in rows}
    remove_temp_dirs(weights_dir)
    for n, path in list_version_dirs(weights_dir).items():
        if n not in known:
            log.warning("removing %s: no policy_versions row (crashed before commit)", path,
                        extra={"action": "remove_orphan_checkpoint"})
            shutil.rmtree(path)
    next_step = (last_step or 0) + 1
    for r in rows:
        if r.status in ("retired", "rejected"):  # rolled back, or never served (the gate)
            continue
        path = version_dir(weights_dir, r.version)
        try:
            verify_version(path)
        except CheckpointError as exc:
            log.error("cannot resume from v%d: %s", r.version, exc,
                      extra={"action": "skip_bad_checkpoint"})
            continue
        return ResumePoint(r.version, path, next_step, r.status == "published")
    return ResumePoint(0, None, next_step, True)

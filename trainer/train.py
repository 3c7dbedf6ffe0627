"""`clawrl train`: turn judged samples into gradient steps and hot-swap them into the engine.

    clawrl train [--backend torch] [--model DIR] [--once] [--max-steps N]
    python -m trainer.train …            (the same; settings from CLAWRL_… environment)

One step, in order — the order is the crash-safety argument:

    1. claim    lock up to batch_size ready samples (SKIP LOCKED, transaction left open)
    2. train    forward/backward/AdamW; NaN/inf -> step recorded 'skipped', weights untouched
    3. save     weights/v{N:06d}/ (weights + optimizer + RNG), completion marker last
    4. commit   ONE transaction: training_steps N + policy_versions N ('saved') + samples
                trained_step = N, committed with the row locks from step 1
    5. publish  /update_weights_from_disk, version read back -> policy_versions 'published'
                (under LoRA: the version is an adapter, loaded with /load_lora_adapter beside
                the frozen base: trainer/policy_adapter.py)

Killed before 4: the transaction rolls back, the samples are claimable again, and the
restart deletes v{N} (no DB row) and retrains them from v{N−1}. Killed after 4: restart
loads v{N} and publishes it if it was not. Nothing is lost, nothing is trained twice.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from statistics import mean
from typing import Any

from pydantic import ValidationError
from sqlalchemy import bindparam, func, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from clawrl.base.db import create_engine
from trainer.backends.base import Backend, BackendError, StepStats, make_backend
from trainer.checkpoint import (
    drop_old_trainer_states,
    find_resume_point,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import Settings, TrainerSettings, load_settings, model_recipe
from trainer.data import VERSIONS, Claim, claim_batch, record_step, replay_of
from trainer.export import CheckpointError, version_dir
from trainer.gate import Gate, GateResult, load_probe
from trainer.metrics import TrainerMetrics
from trainer.serving import RolledBack, ensure_serving, publish

log = logging.getLogger("clawrl.trainer")
# While no samples arrive, check this often that the engine still serves our version.
IDLE_CHECK_S = 60.0


class StopFlag:
    """Set by SIGTERM/SIGINT: the step in progress finishes, then the loop exits."""

    def __init__(self) -> None:
        self.stop = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stop", True))

    def __call__(self) -> bool:
        return self.stop


def step_rows(step: int, stats: StepStats, claim: Claim, skipped: Counter[str],
              path: Path | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The training_steps row and (for an ok step) the policy_versions row of step N."""
    rewards = [r for r in claim.rewards if r is not None]
    reward_mean = mean(rewards) if rewards else None
    staleness = mean(claim.batch.staleness)
    ok = stats.status == "ok"
    metrics = stats.as_metrics() | {"skipped": dict(skipped)}
    outcomes = [o for o in claim.outcomes if o is not None]
    if outcomes:  # samples whose session had an outcome when the batch was claimed
        metrics |= {"outcome_samples": len(outcomes), "outcome_mean": mean(outcomes)}
    step_row = dict(step=step, version=step if ok else None, status=stats.status,
                    num_samples=stats.num_samples, num_tokens=stats.num_tokens, loss=stats.loss,
                    reward_mean=reward_mean, staleness_mean=staleness,
                    skipped_stale=skipped.get("stale", 0), tokens_per_s=stats.tokens_per_s,
                    metrics=metrics)
    if not ok:
        return step_row, None
    version_row = dict(version=step, step=step, path=str(path), status="saved",
                       num_samples=stats.num_samples, loss=stats.loss, reward_mean=reward_mean,
                       stats=metrics)
    return step_row, version_row


def progress_line(step: int, stats: StepStats, row: dict[str, Any], published: str) -> str:
    reward = row["reward_mean"]
    loss = "-" if stats.loss is None else f"{stats.loss:+.4f}"
    skipped = sum(row["metrics"]["skipped"].values())
    return (f"step {step:>5} {stats.status:<7} | {stats.num_samples} samples "
            f"{stats.num_tokens} tok {stats.tokens_per_s:,.0f} tok/s | loss {loss} | reward "
            f"{'-' if reward is None else f'{reward:+.2f}'} | staleness "
            f"{row['staleness_mean']:.1f} ({skipped} skipped) | {published}")


def open_gate(cfg: TrainerSettings, base_dir: Path, backend: Backend,
              at_base: bool) -> Gate | None:
    """The gate (trainer/gate.py) with the base model's score, or None without a probe.
    `at_base`: the backend holds the base model (nothing trained yet; fresh LoRA adapters
    change nothing), so it is measured as it is rather than loaded a second time."""
    if cfg.gate_probe is None:
        return None
    if not hasattr(backend, "model"):
        log.warning("the gate needs the torch backend; versions are published unchecked",
                    extra={"action": "gate_unavailable"})
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    gate = Gate(load_probe(cfg.gate_probe), cfg.gate_max_drop, tokenizer,
                cfg.gate_max_topic_drop)
    if at_base:
        figures = gate.measure_base(backend_model(backend))
    else:
        base = AutoModelForCausalLM.from_pretrained(str(base_dir))
        figures = gate.measure_base(base)
        del base
    log.info("gate: the base model has %s; a version more than %.2f below on facts or %.2f "
             "on topic is not served", figures, cfg.gate_max_drop, cfg.gate_max_topic_drop,
             extra={"action": "gate_base"})
    return gate


def backend_model(backend: Backend) -> Any:
    return backend.model  # type: ignore[attr-defined]  # torch only (open_gate checks)


def version_path(weights_dir: Path, version: int) -> Path | None:
    return version_dir(weights_dir, version) if version > 0 else None


def back_off(backend: Backend, base_dir: Path, served: Path | None, times: int) -> float:
    """Back to the served version's weights (None: the base) with the learning rate times
    `gate_backoff` per rejection; returns the new learning rate."""
    cfg: TrainerSettings = backend.cfg  # type: ignore[attr-defined]
    factor = cfg.gate_backoff ** times
    update = {"lr": cfg.lr * factor}
    if cfg.adapter_lr is not None:
        update["adapter_lr"] = cfg.adapter_lr * factor
    backend.cfg = cfg.model_copy(update=update)  # type: ignore[attr-defined]
    load_checkpoint(backend, backend.cfg, base_dir, served)  # type: ignore[attr-defined]
    return float(backend.lr)  # type: ignore[attr-defined]


def record_gate(db: Engine, version: int, result: GateResult) -> None:
    """The gate's figures on the version's row; 'rejected' when it failed."""
    gate = bindparam("gate", {"gate": result.as_stats()}, type_=JSONB)
    values: dict[str, Any] = {"stats": VERSIONS.c.stats.op("||")(gate)}
    if not result.passed:
        values["status"] = "rejected"
    with db.begin() as conn:
        conn.execute(update(VERSIONS).where(VERSIONS.c.version == version).values(**values))


def rejections_since(db: Engine, version: int) -> int:
    """Versions rejected by the gate after `version` (the served one)."""
    with db.connect() as conn:
        return int(conn.execute(select(func.count()).where(
            VERSIONS.c.version > version, VERSIONS.c.status == "rejected")).scalar() or 0)


def train(settings: Settings, *, max_steps: int | None = None, once: bool = False,
          should_stop: StopFlag | None = None, backend: Backend | None = None) -> int:
    """The trainer loop (see the module docstring). Returns the number of ok steps."""
    cfg, stop = settings.trainer, should_stop or StopFlag()
    from clawrl.base.dbcli import resolve_url

    db = create_engine(resolve_url(settings))
    base_dir, weights_dir = settings.model_dir(), settings.weights_dir()
    metrics = TrainerMetrics(settings.metrics_textfile(), cfg.metrics_port)

    # Resume: drop checkpoints the DB never committed, load the newest real one.
    backend = backend or make_backend(cfg)
    point = find_resume_point(db, weights_dir)
    load_checkpoint(backend, cfg, base_dir, point.path)
    current = point.version
    log.info("resuming at v%d, next step %d", current, point.next_step,
             extra={"action": "resume"})
    ensure_serving(db, settings.engine, cfg, current, weights_dir, metrics)
    gate = open_gate(cfg, base_dir, backend, at_base=point.path is None)
    rejected = rejections_since(db, current)
    if gate is not None and rejected:  # the back-off outlives a restart
        back_off(backend, base_dir, version_path(weights_dir, current), rejected)

    try:
        return run_steps(settings, db, backend, metrics, point.version, point.next_step,
                         max_steps=max_steps, once=once, stop=stop, gate=gate)
    finally:
        db.dispose()
        close = getattr(backend, "close", None)  # megatron: release follower ranks
        if close is not None:
            close()


def run_steps(settings: Settings, db: Engine, backend: Backend, metrics: TrainerMetrics,
              current: int, step: int, *, max_steps: int | None, once: bool,
              stop: StopFlag, gate: Gate | None = None) -> int:
    """Claim → train → save → commit → publish, until stopped. Returns the ok step count."""
    cfg, ok_steps = settings.trainer, 0
    base_dir, weights_dir = settings.model_dir(), settings.weights_dir()
    while not stop() and (max_steps is None or ok_steps < max_steps):
        # 1. claim (idle: come back every IDLE_CHECK_S to check what the engine serves)
        try:
            claim, skipped = claim_batch(
                db, cfg, backend.limits, current, should_stop=stop,
                give_up_after_s=cfg.max_wait_s if once else IDLE_CHECK_S)
        except OperationalError as exc:
            log.warning("database unavailable, retrying: %s", exc, extra={"action": "db_down"})
            time.sleep(5 * cfg.poll_s)
            continue
        if claim is None:
            if skipped:
                log.info("skipped samples: %s", dict(skipped), extra={"action": "skip"})
                for reason, n in skipped.items():
                    metrics.skipped.labels(reason).inc(n)
            if once:
                print("no trainable samples ready", flush=True)
                break
            ensure_serving(db, settings.engine, cfg, current, weights_dir, metrics)
            continue
        try:
            # 2. train
            stats = backend.train_step(claim.batch, replay_of(db, cfg, step))
            # 3. save (ok steps only)
            path = None
            t0 = time.perf_counter()
            if stats.status == "ok":
                path = save_checkpoint(backend, weights_dir, step, base_dir, {"step": step})
            # 4. commit
            step_row, version_row = step_rows(step, stats, claim, skipped, path)
            record_step(claim, step=step_row, version=version_row,
                        trained=stats.status == "ok")
        except BaseException:
            claim.release()  # rows unlocked, nothing marked: a restart retrains them
            raise
        metrics.record_step(step, stats, step_row["reward_mean"], step_row["staleness_mean"],
                            dict(skipped))
        # 5. the gate: a version that lost what the model knew is never served
        if path is not None and gate is not None:
            result = gate.check(backend_model(backend))
            record_gate(db, step, result)
            if not result.passed:
                lr = back_off(backend, base_dir, version_path(weights_dir, current), 1)
                log.warning("v%d rejected by the gate: %s (max drops %.2f, %.2f); back to "
                            "v%d at lr %g", step, result.summary(), result.max_drop,
                            result.max_topic_drop, current, lr,
                            extra={"action": "gate_rejected"})
                metrics.write()
                print(progress_line(step, stats, step_row,
                                    f"v{step} REJECTED by the gate ({result.summary()}); "
                                    f"back to v{current}, lr {lr:g}"), flush=True)
                step += 1
                if once:
                    break
                continue
        # 6. publish
        if path is not None:
            current = step
            published = publish(db, settings.engine, cfg, step, path, metrics)
            metrics.publish_seconds.set(time.perf_counter() - t0)
            status = f"v{step} {'published' if published else 'NOT published (saved)'}"
            drop_old_trainer_states(weights_dir, cfg.keep_trainer_states)
            ok_steps += 1
        else:
            status = f"skipped: {stats.reason}"
        metrics.write()
        print(progress_line(step, stats, step_row, status), flush=True)
        step += 1
        if once:
            break
    return ok_steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clawrl train", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["torch", "megatron"], help="training backend")
    p.add_argument("--tp", type=int, help="megatron: tensor parallel size")
    p.add_argument("--pp", type=int, help="megatron: pipeline parallel size")
    p.add_argument("--model", type=Path, help="base model directory (Hugging Face format)")
    p.add_argument("--weights-dir", type=Path, help="where v{N:06d}/ checkpoints go")
    p.add_argument("--engine-url", help="serving engine to publish to")
    p.add_argument("--method", choices=["rl", "opd", "combine"])
    p.add_argument("--once", action="store_true",
                   help="train one batch from what is ready (waits at most max_wait_s), exit")
    p.add_argument("--max-steps", type=int, help="stop after N ok (saved) steps")
    p.add_argument("--personal", action="store_true", default=None,
                   help="one LoRA adapter per user, trained on that user's samples only "
                        "(trainer/personal.py)")
    return p


def resolve_settings(args: argparse.Namespace) -> Settings:
    """The environment's settings, the command line's flags over them, and under both the
    model's own training settings (its recipe.json) for whatever neither set.
    Raises ValidationError when they conflict (personal mode on megatron)."""
    settings = load_settings()
    overrides = {k: v for k, v in (("backend", args.backend), ("model", args.model),
                                   ("weights_dir", args.weights_dir), ("method", args.method),
                                   ("tp", args.tp), ("pp", args.pp),
                                   ("personal", args.personal))
                 if v is not None}
    explicit = settings.trainer.model_fields_set | set(overrides)
    settings.trainer = TrainerSettings.model_validate(settings.trainer.model_dump() | overrides)
    recipe = {k: v for k, v in model_recipe(settings.model_dir(),
                                            personal=settings.trainer.personal).items()
              if k not in explicit}
    if settings.trainer.backend == "megatron":  # full weights only (a recipe's LoRA is not)
        recipe.pop("lora", None)
    if recipe:
        settings.trainer = TrainerSettings.model_validate(settings.trainer.model_dump() | recipe)
        log.info("the model's own training settings (its recipe.json): %s "
                 "(CLAWRL_TRAINER__* changes them)",
                 ", ".join(f"{k} {v}" for k, v in recipe.items()))
    if settings.trainer.ptx_coef == 0 and "ptx_data" in recipe:  # the term is off
        settings.trainer = settings.trainer.model_copy(update={"ptx_data": None})
    return settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from clawrl.base.logs import setup_logging

    setup_logging(logging.INFO, "%(asctime)s %(levelname)s %(message)s")
    for noisy in ("httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        settings = resolve_settings(args)
    except ValidationError as exc:
        msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
        print(f"clawrl train: {msg}", file=sys.stderr)
        return 2
    if args.engine_url:
        settings.engine = settings.engine.model_copy(update={"url": args.engine_url})
    if not (settings.model_dir() / "config.json").is_file():
        print(f"clawrl train: no model at {settings.model_dir()} (build it with `clawrl "
              "tinyworld build` or pass --model DIR)", file=sys.stderr)
        return 1
    from clawrl.base.engine_check import TRAINER_NEEDS, check_at_start
    from clawrl.base.engine_client import EngineClient

    problem = check_at_start(EngineClient.from_settings(settings.engine), TRAINER_NEEDS)
    if problem:
        print(f"clawrl train: {problem}", file=sys.stderr)
        return 1
    if settings.trainer.threads:
        import torch

        torch.set_num_threads(settings.trainer.threads)
    stop = StopFlag()
    stop.install()
    try:
        if settings.trainer.personal:
            from trainer.personal import train_personal

            train_personal(settings, max_steps=args.max_steps, once=args.once,
                           should_stop=stop)
        else:
            train(settings, max_steps=args.max_steps, once=args.once, should_stop=stop)
    except (CheckpointError, RolledBack, BackendError) as exc:
        print(f"clawrl train: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

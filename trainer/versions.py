"""`clawrl versions`: list weight versions, roll the engine back to one, prune old folders.

    clawrl versions list                 every version: status, samples, loss, reward, folder
    clawrl versions rollback N           re-publish v N to the engine; newer versions 'retired'
                                         (N = 0: the base model; every version 'retired')
    clawrl versions prune --keep K       delete folders of all but the newest K versions
    clawrl versions list|rollback N|prune --keep K --user NAME
                                         the same for one user's personal adapter (personal
                                         mode, trainer/personal.py); rollback 0: no adapter

Rollback re-publishes the old folder with `weight_version = N`, so new turns record N. Newer
versions are marked 'retired': a (re)started trainer resumes from N, never from a retired
version. Version 0 is the base model (`--model` / the trainer's model dir): rolling back to
it retires every version, and a restarted trainer starts over from the base weights (its
versions keep counting up from the last step). Stop the trainer before rolling back, or its next step publishes on top again.
Samples already trained by retired versions stay consumed. Prune never deletes the version
the engine serves (nor the newest K non-retired versions, one of which the trainer resumes
from); pruned versions are marked 'retired'.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any, cast

import httpx
from sqlalchemy import Table, func, select, update
from sqlalchemy.engine import Engine

from clawrl.base.db import PolicyVersion, create_engine
from clawrl.base.engine_client import policy_adapter_version, sync_client
from clawrl.base.settings import EngineSettings
from trainer.adapters import AdapterPublishError
from trainer.config import Settings, load_settings
from trainer.export import CheckpointError, verify_version, version_dir
from trainer.policy_adapter import (
    is_adapter_version,
    rollback_adapter,
    served_adapter,
    unload_all,
)
from trainer.publish import PublishError, publish_version, serving_version

PV = cast(Table, PolicyVersion.__table__)


class VersionsError(Exception):
    """A versions command that cannot run (message is the one line shown to the user)."""


def engine_serving(engine: EngineSettings) -> str | None:
    """The engine's current weight_version, or None when it cannot be asked."""
    try:
        with sync_client(engine, 10.0) as client:
            return serving_version(client)
    except httpx.HTTPError:
        return None


def folder_state(path: Path) -> str:
    try:
        verify_version(path)
    except CheckpointError as exc:
        return "missing" if not path.exists() else f"bad ({exc})"
    return "ok"


def list_versions(db: Engine, weights_dir: Path) -> list[dict[str, Any]]:
    with db.connect() as conn:
        rows = conn.execute(select(PV).order_by(PV.c.version)).mappings().all()
    return [dict(r) | {"folder": folder_state(version_dir(weights_dir, r["version"]))}
            for r in rows]


def rollback(db: Engine, engine: EngineSettings, weights_dir: Path, version: int,
             attempts: int = 3, base_dir: Path | None = None) -> dict[str, Any]:
    """Publish version N again (0: the base model in `base_dir`) and retire every newer
    version. Returns the engine's info (an adapter version: its name, `adapter`)."""
    path = version_dir(weights_dir, version)
    if (version > 0 and is_adapter_version(path)) or (version == 0 and served_adapter(db)):
        return rollback_adapter_version(db, engine, path, version)
    if version == 0:
        if base_dir is None or not (base_dir / "config.json").is_file():
            raise VersionsError(f"rollback to v0 needs the base model; none at {base_dir} "
                                "(set --model or CLAWRL_TRAINER__MODEL)")
        path = base_dir
    else:
        _check_rollback_target(db, version)
    try:
        # The base model is a plain Hugging Face folder: no completion marker to verify.
        info = publish_version(engine, path, version, attempts=attempts, verify=version != 0)
    except (CheckpointError, PublishError) as exc:
        raise VersionsError(f"rollback to v{version} refused, engine unchanged: {exc}") from exc
    with db.begin() as conn:
        conn.execute(update(PV).where(PV.c.version > version,
                                      PV.c.status.not_in(("retired", "rejected")))
                     .values(status="retired"))  # a rejected version keeps saying so
        conn.execute(update(PV).where(PV.c.version == version)
                     .values(status="published", published_at=func.now()))
    return info


def rollback_adapter_version(db: Engine, engine: EngineSettings, path: Path,
                             version: int) -> dict[str, Any]:
    """Rollback where the shared model is a LoRA adapter (trainer/policy_adapter.py): load
    version N's adapter and make it the newest published; 0: no adapter (the engine's base
    weights, which adapters never change), every version retired and unloaded."""
    if version == 0:
        with db.begin() as conn:
            conn.execute(update(PV).where(PV.c.status.not_in(("retired", "rejected")))
                         .values(status="retired"))
        unload_all(engine)
        return {"weight_version": "0", "adapter": None}
    _check_rollback_target(db, version)
    try:
        name = rollback_adapter(db, engine, version, path)
    except (CheckpointError, AdapterPublishError, httpx.HTTPError) as exc:
        raise VersionsError(f"rollback to v{version} refused, engine unchanged: {exc}") from exc
    return {"weight_version": str(version), "adapter": name, "model_path": str(path)}


def _check_rollback_target(db: Engine, version: int) -> None:
    with db.connect() as conn:
        row = conn.execute(select(PV.c.status).where(PV.c.version == version)).first()
    if row is None:
        raise VersionsError(f"no version {version} (see `clawrl versions list`)")
    if row.status == "rejected":
        raise VersionsError(f"v{version} was rejected by the gate before serving (it lost "
                            "what the base model knew); roll back to another version")


def prune(db: Engine, engine: EngineSettings, weights_dir: Path, keep: int,
          dry_run: bool = False) -> list[int]:
    """Delete the folders of all versions but the newest `keep` non-retired ones and the
    serving one; mark them 'retired'. Returns the pruned version numbers."""
    if keep < 1:
        raise VersionsError("--keep must be at least 1 (the trainer resumes from the newest)")
    with db.connect() as conn:
        rows = conn.execute(select(PV.c.version, PV.c.status, PV.c.published_at)
                            .order_by(PV.c.version)).all()
    live = [r.version for r in rows if r.status != "retired"]
    protected = set(live[-keep:])
    serving = engine_serving(engine)
    adapter = served_adapter(db)
    if adapter is not None:  # the shared model is an adapter: the proxy serves the newest
        protected.add(policy_adapter_version(adapter) or 0)  # published version's
    elif serving is not None and serving.isdigit():
        protected.add(int(serving))
    else:  # engine unreachable: protect what the DB says was published last
        published = [r for r in rows if r.published_at is not None]
        if published:
            protected.add(max(published, key=lambda r: r.published_at).version)
    victims = [r.version for r in rows if r.version not in protected
               and version_dir(weights_dir, r.version).exists()]
    if dry_run:
        return victims
    for n in victims:
        with db.begin() as conn:
            conn.execute(update(PV).where(PV.c.version == n).values(status="retired"))
        shutil.rmtree(version_dir(weights_dir, n))
    return victims


def _fmt(v: Any, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def print_list(rows: list[dict[str, Any]], serving: str | None) -> None:
    print(f"{'':1} {'version':>7} {'step':>5} {'status':<9} {'samples':>7} {'loss':>9} "
          f"{'reward':>6}  {'created':<19}  folder")
    for r in rows:
        mark = "*" if serving is not None and serving == str(r["version"]) else " "
        print(f"{mark} {r['version']:>7} {_fmt(r['step']):>5} {r['status']:<9} "
              f"{r['num_samples']:>7} {_fmt(r['loss'], '+.4f'):>9} "
              f"{_fmt(r['reward_mean'], '+.2f'):>6}  {r['created_at']:%Y-%m-%d %H:%M:%S}  "
              f"{r['folder']}")
    print(f"* = serving (engine reports weight_version {serving!r})" if serving is not None
          else "engine unreachable: serving version unknown")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clawrl versions", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="list weight versions")
    rb = sub.add_parser("rollback", help="re-publish an older version")
    rb.add_argument("version", type=int, help="a version number; 0 = the base model")
    rb.add_argument("--model", type=Path, help="the base model dir, for version 0 (default: "
                    "the trainer's, <state_dir>/models/tinyworld)")
    pr = sub.add_parser("prune", help="delete old version folders")
    pr.add_argument("--keep", type=int, required=True)
    pr.add_argument("--dry-run", action="store_true")
    for cmd in (ls, rb, pr):
        cmd.add_argument("--user", help="one user's personal adapter versions (personal mode)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    settings: Settings = load_settings()
    from clawrl.base.dbcli import resolve_admin_url

    db = create_engine(resolve_admin_url(settings))
    weights_dir = settings.weights_dir()
    try:
        if args.user is not None:
            return _user_command(db, settings, args)
        if args.cmd == "list":
            adapter = served_adapter(db)  # the shared model as an adapter: the proxy's pick
            serving = (str(policy_adapter_version(adapter)) if adapter is not None
                       else engine_serving(settings.engine))
            print_list(list_versions(db, weights_dir), serving)
        elif args.cmd == "rollback":
            if args.version < 0:
                raise VersionsError(f"no version {args.version} (versions count up from 0)")
            info = rollback(db, settings.engine, weights_dir, args.version,
                            base_dir=args.model or settings.model_dir())
            if "adapter" in info:
                print(f"the proxy now serves v{info['weight_version']} "
                      f"({info['adapter'] or 'the base model, no adapter'}) within "
                      "seconds")
            else:
                print(f"engine now serves v{info.get('weight_version')} from "
                      f"{info.get('model_path')}")
        else:
            pruned = prune(db, settings.engine, weights_dir, args.keep, args.dry_run)
            verb = "would prune" if args.dry_run else "pruned"
            print(f"{verb} {len(pruned)} version(s): {', '.join(map(str, pruned)) or '-'}")
    except VersionsError as exc:
        print(f"clawrl versions: {exc}", file=sys.stderr)
        return 1
    finally:
        db.dispose()
    return 0


def _user_command(db: Engine, settings: Settings, args: argparse.Namespace) -> int:
    """`--user NAME`: list, roll back or prune one user's adapter versions."""
    from trainer.personal import (
        list_user_versions,
        prune_user,
        rollback_user,
        user_id_of,
    )

    user_id = user_id_of(db, args.user)
    if user_id is None:
        raise VersionsError(f"no user named {args.user!r}")
    if args.cmd == "list":
        rows = list_user_versions(db, user_id)
        print(f"{'version':>7} {'step':>5} {'status':<9} {'samples':>7} {'loss':>9} "
              f"{'reward':>6}  {'created':<19}  folder")
        for r in rows:
            print(f"{r['version']:>7} {_fmt(r['step']):>5} {r['status']:<9} "
                  f"{r['num_samples']:>7} {_fmt(r['loss'], '+.4f'):>9} "
                  f"{_fmt(r['reward_mean'], '+.2f'):>6}  {r['created_at']:%Y-%m-%d %H:%M:%S}"
                  f"  {r['folder']}")
        if not rows:
            print(f"{args.user} has no adapter versions")
    elif args.cmd == "rollback":
        if args.version < 0:
            raise VersionsError(f"no version {args.version} (versions count up from 0)")
        try:
            served = rollback_user(db, settings.engine, user_id, args.version)
        except (AdapterPublishError, httpx.HTTPError) as exc:
            raise VersionsError(f"rollback refused, {args.user} keeps their adapter: "
                                f"{exc}") from exc
        print(f"{args.user} is now served {served}")
    else:
        if args.keep < 1:
            raise VersionsError("--keep must be at least 1")
        pruned = prune_user(db, user_id, args.keep, args.dry_run)
        verb = "would prune" if args.dry_run else "pruned"
        print(f"{verb} {len(pruned)} version(s) of {args.user}: "
              f"{', '.join(map(str, sorted(pruned))) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

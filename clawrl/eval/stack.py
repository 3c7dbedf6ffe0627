"""The stack `clawrl eval` runs for one method: a fresh database and its own processes.

Reuses `clawrl up`'s process handling (clawrl/cli/stack.py): every service is a child process
(`clawrl engine|proxy|judge|train`) logging to `<out>/<method>/logs/`, stopped in order.
The database is a fresh one per method on the configured server (`CLAWRL_DATABASE__URL`),
or on an embedded Postgres under `<out>/pg` when none is configured.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawrl.cli.ports import free_port
from clawrl.cli.stack import (
    HOST,
    Stack,
    StackError,
    judge_engine_env,
    pull_named_model,
    wait_healthy,
)
from clawrl.eval.agents import run_agent_rounds
from clawrl.eval.attack import run_attack_rounds
from clawrl.eval.config import EvalConfig, stack_env, trainer_method
from clawrl.eval.everyday import run_everyday_rounds
from clawrl.eval.rounds import run_rounds

__all__ = ["StackError", "drop_database", "ensure_model", "fresh_database", "run_method"]



def ensure_model(model: Path, small: bool = False, tools: bool = False,
                 default: bool = False, everyday: bool = False) -> Path:
    """The model dir to serve: a dir the user named (`default` False) as it is when it holds
    a model, else the tiny world model built there (`small`: the CI-sized build; `tools`: the
    tool-call model). The default dir in the state dir is kept at the current build: one
    an older release left there (another build key) is replaced by the shipped build, as
    `clawrl up` does (the builder returns at once when it is current)."""
    from clawrl.world.pretrain import CI, FULL, build, build_tools

    if (model / "config.json").is_file() and not default:
        return model
    if everyday:  # a real model by name: `clawrl models pull NAME` into <state>/models/NAME
        return pull_named_model(model.name, model.parent.parent)
    model.parent.mkdir(parents=True, exist_ok=True)
    return build_tools(model) if tools else build(model, CI if small else FULL)


def fresh_database(server_url: str, name: str) -> str:
    """Create database `name` on the server of `server_url` and migrate it; its URL."""
    import psycopg
    from sqlalchemy.engine import make_url

    from clawrl.base.dbcli import upgrade

    admin = make_url(server_url).set(drivername="postgresql")
    with psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    return url


def drop_database(server_url: str, name: str) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(server_url).set(drivername="postgresql")
    with psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run_method(config: EvalConfig, method: str,
               on_round: Callable[[str, int, list[dict[str, Any]]], None]) -> None:
    """Start a fresh stack for `method`, run the rounds (probe rows to `on_round`), stop
    everything."""
    from clawrl.base.dbcli import resolve_url, stop_embedded
    from clawrl.base.settings import load_settings
    state = (config.out / method).resolve()
    state.mkdir(parents=True, exist_ok=True)
    settings = load_settings(state_dir=config.out.resolve())
    embedded = settings.database.url is None
    server = resolve_url(settings)
    db_name = f"clawrl_eval_{method}_{uuid.uuid4().hex[:8]}"
    db_url = fresh_database(server, db_name)
    engine_port, proxy_port = free_port(), free_port()
    engine_url = f"http://{HOST}:{engine_port}"
    proxy_url = f"http://{HOST}:{proxy_port}"
    env = {**os.environ, "CLAWRL_DATABASE__URL": db_url, "CLAWRL_STATE_DIR": str(state),
           "CLAWRL_ENGINE__URL": engine_url, "CLAWRL_PROXY__HOST": HOST,
           "CLAWRL_PROXY__PORT": str(proxy_port), "PYTHONUNBUFFERED": "1",
           **stack_env(config, method), **config.extra_env}
    # A round's phases take turns (chat and judge, then train and gate, then probe): while
    # the trainer works the engines wait, so it takes every core, unless the user chose.
    env.setdefault("CLAWRL_TRAINER__THREADS", str(os.cpu_count() or 1))
    stack = Stack(state, env)
    try:
        engine = stack.start("engine", ["engine", "--model", str(config.model.resolve()),
                                        "--host", HOST, "--port", str(engine_port),
                                        "--threads", str(config.engine_threads)])
        wait_healthy(stack, engine, f"{engine_url}/health", 300.0)
        proxy = stack.start("proxy", ["proxy", "--host", HOST, "--port", str(proxy_port)])
        wait_healthy(stack, proxy, f"{proxy_url}/readyz", 300.0)
        if method != "none":
            if config.judge_engine:
                judge_port = free_port()
                judge = stack.start("judge-engine", [
                    "judge", "serve",
                    "--state-dir", str((config.judge_state_dir or config.out).resolve()),
                    "--host", HOST, "--port", str(judge_port),
                    "--threads", str(config.engine_threads)])
                wait_healthy(stack, judge, f"http://{HOST}:{judge_port}/health", 600.0)
                stack.env.update(judge_engine_env(f"http://{HOST}:{judge_port}"))
            stack.start("judge", ["judge"])
            stack.start("train", ["train", "--model", str(config.model.resolve()),
                                  "--engine-url", engine_url, "--method", trainer_method(method),
                                  "--weights-dir", str(state / "weights")])
        rounds = (run_agent_rounds if config.track == "toolcall" else
                  run_attack_rounds if config.attack else
                  run_everyday_rounds if config.everyday else run_rounds)
        asyncio.run(_guarded(stack, rounds(config, method, proxy_url, db_url, engine_url,
                                           on_round)))
    finally:
        stack.stop()
        if config.keep_db:
            (state / "database.txt").write_text(db_url + "\n")
            print(f"clawrl eval: kept the {method} database: {db_url}", file=sys.stderr)
        else:
            drop_database(server, db_name)
        if embedded:
            stop_embedded(config.out.resolve())


async def _guarded(stack: Stack, work: Any) -> Any:
    """Run `work`, but fail fast (with the log tail) if a service dies meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=1.0)
        dead = stack.dead()
        if dead is not None and not task.done():
            task.cancel()
            raise StackError(f"the {dead.name} exited with code {dead.proc.returncode}; "
                             f"see {dead.log_path}:\n{dead.tail()}")
    return task.result()

"""`clawrl env`: run agent episodes against the proxy, N at a time.

    clawrl env terminal|toolcall|swe|gui [--episodes 16] [--concurrency 4] [--max-steps 6]
                        [--tasks a,b] [--split train|heldout]
                        [--base-url URL] [--api-key KEY] [--model default] [--max-tokens 128]
                        [--temperature 1.0] [--seed 0] [--json FILE] [--screenshots DIR]

The proxy is `--base-url`, else the running `clawrl up`'s: the one `clawrl users|keys|sql` act on
(clawrl/base/statefile.py `choose_stack`). The key is
`--api-key`, else `$CLAWRL_API_KEY`, else a fresh one for the user `env-<NAME>` made in the
running stack's database (unlimited rate, as `clawrl eval` makes its users'). Prints the
success rate per task, episodes/s and whether the sandbox has its own network namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from clawrl.envs.pool import PoolConfig, print_result, run_pool
from clawrl.envs.protocol import EnvError
from clawrl.envs.registry import ENVS, make_env


class CliError(Exception):
    """One readable line, then exit 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        print(f"clawrl env: {message} (see `clawrl env --help`)", file=sys.stderr)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="clawrl env", description=__doc__.split("\n\n")[0])
    p.add_argument("name", metavar="NAME",
                   help="the environment: " + "; ".join(f"{n}: {h}" for n, (_, h) in ENVS.items()))
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="episodes at once")
    p.add_argument("--max-steps", type=int, default=6, help="chat requests per episode at most")
    p.add_argument("--tasks", default="", help="comma-separated task names (terminal: "
                   "write_file, count_lines, find_word, move_file, sum_numbers, delete_logs, "
                   "uppercase, sort_lines); default all")
    p.add_argument("--split", default="", help="toolcall: the questions, swe and gui: the "
                   "tasks; train (held-in, the default) or heldout")
    p.add_argument("--base-url", default="", help="the proxy's /v1 URL")
    p.add_argument("--api-key", default="")
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="episode i uses seed + i // group")
    p.add_argument("--group", type=int, default=1,
                   help="episodes per seed: each task run this many times (compared with "
                        "each other by the trainer's group_mean baseline)")
    p.add_argument("--json", type=Path, help="also write every episode here")
    p.add_argument("--screenshots", default="", help="gui: write each page state's screenshot "
                   "into this folder (their paths are in the episodes' details)")
    return p


def config_from(args: argparse.Namespace) -> PoolConfig:
    """The pool's config, or EnvError for a bad value (checked before any request)."""
    for name in ("episodes", "concurrency", "max_steps", "max_tokens", "group"):
        if getattr(args, name) < 1:
            raise EnvError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.temperature <= 2.0:
        raise EnvError("--temperature must be in [0, 2]")
    options: dict[str, Any] = {
        "tasks": [t.strip() for t in args.tasks.split(",") if t.strip()]} if args.tasks else {}
    if options and args.name != "terminal":
        raise EnvError(f"--tasks applies to the terminal environment, not {args.name!r}")
    if args.split:
        if args.name not in ("toolcall", "swe", "gui"):
            raise EnvError(f"--split applies to the toolcall, swe and gui environments, not "
                           f"{args.name!r}")
        options["split"] = args.split
    if args.screenshots:
        if args.name != "gui":
            raise EnvError(f"--screenshots applies to the gui environment, not {args.name!r}")
        os.makedirs(args.screenshots, exist_ok=True)
        options["screenshots"] = str(Path(args.screenshots).resolve())
    make_env(args.name, args.seed, **options)  # a bad name or task fails here, in one line
    return PoolConfig(env=args.name, episodes=args.episodes, concurrency=args.concurrency,
                      max_steps=args.max_steps, seed=args.seed, group=args.group,
                      model=args.model,
                      max_tokens=args.max_tokens, temperature=args.temperature,
                      session_prefix=f"env-{args.name}", options=options)


def chosen_stack(environ: Mapping[str, str], cwd: Path | None = None) -> dict[str, Any] | None:
    """The running stack whose proxy the episodes go to: the one `clawrl users|keys|sql`
    would act on (clawrl/base/statefile.py `choose_stack`: `CLAWRL_STATE_DIR`, then this
    folder's `.clawrl`, then the last started); with `CLAWRL_DATABASE__URL` set, the last
    started. Says so on stderr when that is not the last started one."""
    from clawrl.base.statefile import choose_stack, running_stack

    choice = choose_stack(environ, cwd)
    if choice.source == "database_url":
        return running_stack()
    if choice.note:
        print(f"clawrl env: {choice.note}", file=sys.stderr)
    return choice.record


def proxy_and_key(args: argparse.Namespace) -> tuple[str, str]:
    stack = chosen_stack(os.environ)
    base_url = args.base_url or (f"{stack['proxy_url']}/v1" if stack else "")
    if not base_url:
        raise CliError("no proxy: pass --base-url http://HOST:PORT/v1, or start `clawrl up`")
    key = args.api_key or os.environ.get("CLAWRL_API_KEY", "")
    if key:
        return base_url, key
    if not stack or not stack.get("database_url"):
        raise CliError("no API key: pass --api-key (or set CLAWRL_API_KEY); with `clawrl up` "
                       "running one is made for you")
    return base_url, asyncio.run(_make_key(stack["database_url"], f"env-{args.name}"))


async def _make_key(db_url: str, user: str) -> str:
    from clawrl.base.db import create_async
    from proxy import admin
    from proxy.auth import VERIFIER

    db = create_async(db_url)
    try:
        await admin.ensure_user(db, user)
        # One key for the whole pool of agents (no per-key limit in flight), a verifier
        # key: the environment posts each episode's outcome (a reward).
        return (await admin.create_key(db, user, name="clawrl env", rate_limit_rpm=0,
                                       max_concurrent=0, scopes=[VERIFIER])).secret
    finally:
        await db.dispose()


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = config_from(args)
        base_url, key = proxy_and_key(args)
    except (EnvError, CliError) as exc:
        print(f"clawrl env: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, EnvError) else 1
    try:
        import openai  # noqa: F401
    except ImportError:
        print("clawrl env: needs the OpenAI SDK: pip install 'clawrl[eval]'", file=sys.stderr)
        return 1
    if args.name in ("terminal", "swe"):
        from clawrl.envs.sandbox import network_isolated

        print("sandbox network: " + ("none (own network namespace)" if network_isolated()
                                     else "NOT isolated (unshare unavailable; proxies unset)"))
    print(f"{cfg.episodes} {args.name} episodes, {cfg.concurrency} at a time, through "
          f"{base_url}", flush=True)
    result = asyncio.run(run_pool(cfg, base_url, key))
    print_result(result)
    if args.json:
        args.json.write_text(json.dumps({"seconds": result.seconds,
                                         "episodes": [asdict(e) for e in result.episodes]},
                                        indent=2))
    return 0 if not result.errors() else 1

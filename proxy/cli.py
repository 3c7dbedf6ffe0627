"""The `clawrl` console script: dispatches to subcommands.

Each subcommand lives in its own module and is imported only when it runs, so
`clawrl --help` answers instantly and the proxy never imports torch.
Every subcommand function takes its argv list and returns an exit code.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("proxy.stack", "main", "start the whole stack on embedded defaults"),
    "proxy": ("proxy.app", "main", "run the OpenAI-compatible proxy"),
    "engine": ("trainer.engine", "main", "serve a Hugging Face model with SGLang's HTTP API"),
    "judge": ("judge.worker", "main", "run judge workers (and `judge rejudge`)"),
    "train": ("trainer.train", "main", "run the trainer"),
    "versions": ("trainer.versions", "main", "list, roll back or prune weight versions"),
    "tinyworld": ("trainer.tinyworld", "main", "build the tiny world model"),
    "eval": ("trainer.evaluate", "main", "measure that the loop learns (simulated users)"),
    "db": ("proxy.dbcli", "main", "database migrations"),
    "users": ("proxy.admin", "users_main", "create, list, opt out or delete users"),
    "keys": ("proxy.admin", "keys_main", "create, list or revoke API keys"),
    "sql": ("proxy.admin", "sql_main", "run a read-only SQL query on the log"),
    "bench": ("proxy.cli", "bench_main", "benchmarks: proxy, judge, trainer, megatron"),
}

# `clawrl bench NAME` -> module:function(argv)
BENCHES: dict[str, tuple[str, str]] = {
    "proxy": ("proxy.bench", "main"),
    "judge": ("judge.bench", "main"),
    "trainer": ("trainer.bench", "main"),
    "megatron": ("trainer.backends.megatron_bench", "main"),
}


def bench_main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: clawrl bench {{{','.join(BENCHES)}}} [ARGS]", file=sys.stderr)
        return 2
    module, func = BENCHES[argv[0]]
    code: int = getattr(importlib.import_module(module), func)(argv[1:])
    return code


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
    try:
        fn = getattr(importlib.import_module(module), func)
    except ImportError as exc:
        print(f"clawrl {name}: cannot import {module} ({exc}); "
              "install the extras it needs, e.g. pip install 'clawrl[train]'", file=sys.stderr)
        return 1
    code: int = fn(rest)
    return code


if __name__ == "__main__":
    sys.exit(main())

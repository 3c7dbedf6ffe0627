"""`clawrl tinyworld {init,build} DIR ...` (also `python -m clawrl.world ...`): write a random
tiny model (clawrl/world/model.py) or pretrain the tiny world model (clawrl/world/pretrain.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from clawrl.world.model import SIZES, init_model_dir


def _init_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="clawrl tinyworld init",
                                     description="write a random tiny Qwen2-style model")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="test")
    args = parser.parse_args(list(argv))
    try:
        path = init_model_dir(args.dir, seed=args.seed, size=args.size)
    except OSError as exc:
        print(f"clawrl tinyworld init: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(argv: Sequence[str]) -> int:
    """`clawrl tinyworld {init,build} ...`"""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: clawrl tinyworld {init,build} DIR [options]\n"
              "  init   random tiny model + tokenizer + chat template (seconds)\n"
              "  build  pretrain the tiny world model on the synthetic corpus (minutes)")
        return 0 if argv else 2
    command, rest = argv[0], list(argv[1:])
    if command == "init":
        return _init_main(rest)
    if command == "build":
        try:
            from clawrl.world.pretrain import build_main
        except ImportError as exc:
            print(f"clawrl tinyworld build: unavailable ({exc})", file=sys.stderr)
            return 1
        code: int = build_main(rest)
        return code
    print(f"clawrl tinyworld: unknown subcommand {command!r} (init or build)", file=sys.stderr)
    return 2


"""`clawrl judge build` and `clawrl judge evaluate`: make and measure the judge model.

    clawrl judge build [--state-dir .clawrl] [--turns N] [--layers K] [--threads T]
    clawrl judge evaluate [--state-dir .clawrl] [--limit N] [--votes 3] [--port P] [--real]
    clawrl judge serve [--state-dir .clawrl] [--host H] [--port 30001] [--threads 1]

`build` trains the LoRA adapter into clawrl/judgemodel/adapter/ (shipped, so a fresh clone
needs no build); `serve` merges it (once) and serves the judge with the embedded engine
under the model name `judge` (what `clawrl up` runs beside the policy engine); `evaluate` merges it into `<state-dir>/models/judge` (once), serves that
with the embedded engine and runs the held-out set through the real judge code.
(`clawrl judge` without these runs the judge worker, judge/worker.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from clawrl.base.signals import sigterm_as_interrupt
from clawrl.engine.pretrained import PullError
from clawrl.judgemodel.build import BuildConfig
from clawrl.judgemodel.model import DTYPES, JUDGE_DTYPE, SPECULATIVE_FLAGS
from judge.prompts import check_version


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl judge", description="The judge model.")
    sub = p.add_subparsers(dest="cmd", required=True)
    default_state = os.environ.get("CLAWRL_STATE_DIR", ".clawrl")
    defaults = BuildConfig()
    b = sub.add_parser("build", help="LoRA fine-tune the judge on the synthetic set")
    b.add_argument("--state-dir", default=default_state)
    b.add_argument("--turns", type=int, default=defaults.turns, help="judged turns (one example each)")
    b.add_argument("--layers", type=int, default=defaults.layers, help="top layers with LoRA")
    b.add_argument("--rank", type=int, default=defaults.rank)
    b.add_argument("--lr", type=float, default=defaults.lr)
    b.add_argument("--epochs", type=int, default=defaults.epochs)
    b.add_argument("--batch", type=int, default=defaults.batch)
    b.add_argument("--decisive", type=float, default=defaults.decisive,
                   help="loss weight of the score / hint-or-not token")
    b.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads")
    b.add_argument("--out", type=Path, default=None, help="adapter directory (default: shipped)")
    b.add_argument("--written-share", type=float, default=defaults.written_share,
                   help="share of follow-ups from the hand-written lines "
                        "(clawrl/judgemodel/data/train_followups.jsonl); 0: the phrasing "
                        "lists alone")
    b.add_argument("--prompt-version", default=defaults.prompt_version,
                   help="judge prompts to train on (judge/templates/)")
    b.add_argument("--agent-stage", action="store_true",
                   help="train the adapter in --out (default: shipped) further on agent "
                        "steps (lookups of what was asked and of something else, tool "
                        "errors, requests to use tools) with a replay of its own turns "
                        "(~15 min)")
    e = sub.add_parser("evaluate", help="held-out agreement, hints and latency, through "
                                         "the embedded engine and the judge's code")
    e.add_argument("--state-dir", default=default_state)
    e.add_argument("--limit", type=int, default=None, help="a stratified sample of N rows")
    e.add_argument("--votes", type=int, default=3)
    e.add_argument("--port", type=int, default=30071)
    e.add_argument("--threads", type=int, default=1, help="engine torch threads")
    e.add_argument("--dtype", choices=DTYPES, default=JUDGE_DTYPE,
                   help="engine weights (auto: bfloat16 where the CPU computes in it)")
    e.add_argument("--adapter", type=Path, default=None)
    e.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=True,
                   help="n-gram drafts checked in one forward pass, as `judge serve` runs "
                        "(--no-speculative: one token per forward)")
    e.add_argument("--json", type=Path, default=None, help="also write the figures here")
    e.add_argument("--dev", type=int, default=0, metavar="N",
                   help="N synthetic dev turns instead of the held-out set (for choices)")
    e.add_argument("--rows", type=Path, default=None, metavar="FILE",
                   help="judge these follow-ups (the held-out set's format) instead, e.g. "
                        "the dev set clawrl/judgemodel/data/dev_followups.jsonl")
    e.add_argument("--real", action="store_true",
                   help="the real-replies held-out set instead: everyday questions, "
                        "SmolLM2-135M-Instruct's stored replies and follow-ups written apart "
                        "(clawrl/judgemodel/data/heldout_real*.jsonl; --limit samples it)")
    e.add_argument("--agent", type=int, default=0, metavar="N",
                   help="N agent steps about the tiny world's held-out questions instead: "
                        "lookups of what was asked, of something else, tool errors, nudges")
    e.add_argument("--prm-mode", choices=("sample", "logprob"), default=None)
    e.add_argument("--prompt-version", default=None)
    e.add_argument("--hint-votes", type=int, default=None)
    e.add_argument("--temperature", type=float, default=None)
    v = sub.add_parser("serve", help="serve the judge model with the embedded engine")
    v.add_argument("--state-dir", default=default_state)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=30001)
    v.add_argument("--threads", type=int, default=1, help="engine torch threads")
    v.add_argument("--dtype", choices=DTYPES, default=JUDGE_DTYPE,
                   help="engine weights (auto: bfloat16 where the CPU computes in it, "
                        "float32 elsewhere; the same answers on the dev set; docs/judge.md)")
    v.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=True,
                   help="draft answers from earlier ones (greedy answers unchanged)")
    args = p.parse_args(argv)
    state = Path(args.state_dir)
    try:
        if args.cmd in ("build", "evaluate") and args.prompt_version is not None:
            check_version(args.prompt_version)
        if args.cmd == "build":
            from clawrl.judgemodel.build import build_adapter
            from clawrl.judgemodel.model import ADAPTER_DIR

            cfg = BuildConfig(turns=args.turns, layers=args.layers, rank=args.rank,
                              lr=args.lr, epochs=args.epochs, batch=args.batch,
                              decisive=args.decisive, threads=args.threads,
                              prompt_version=args.prompt_version,
                              written_share=args.written_share)
            from clawrl.judgemodel.build import AgentStage

            figures = build_adapter(state, cfg, out=args.out or ADAPTER_DIR,
                                    stage=AgentStage() if args.agent_stage else None)
            print(json.dumps(figures))
            return 0
        if args.cmd == "serve":
            from clawrl.engine.server import main as engine_main
            from clawrl.judgemodel.model import ensure_judge_model

            model = ensure_judge_model(state)
            return engine_main(["--model", str(model), "--host", args.host,
                                "--port", str(args.port), "--served-model-name", "judge",
                                "--threads", str(args.threads), "--dtype", args.dtype,
                                *(SPECULATIVE_FLAGS if args.speculative else ())])
        from clawrl.judgemodel import evaluate, real

        chosen = {"prm_mode": args.prm_mode, "hint_votes": args.hint_votes,
                  "prompt_version": args.prompt_version,
                  "temperature": args.temperature}
        judged = {"votes": args.votes, "port": args.port, "dtype": args.dtype,
                  "adapter": args.adapter,
                  "overrides": {k: v for k, v in chosen.items() if v is not None}}
        try:
            with sigterm_as_interrupt():  # the engine child is stopped on SIGTERM too
                if args.real:
                    report = real.evaluate_real(state, limit=args.limit, threads=args.threads,
                                                speculative=args.speculative, **judged)
                else:
                    report = evaluate.evaluate(state, limit=args.limit, threads=args.threads,
                                               dev=args.dev, agent=args.agent,
                                               rows_file=args.rows,
                                               speculative=args.speculative, **judged)
        except KeyboardInterrupt:
            print("clawrl judge evaluate: stopped", file=sys.stderr)
            return 130
        (real if args.real else evaluate).print_report(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        return 0
    except (PullError, FileNotFoundError, ValueError) as exc:
        print(f"clawrl judge {args.cmd}: {exc}", file=sys.stderr)
        return 1

"""`clawrl bench teacher`: what the teacher writes — how far a hint can move a model.

    clawrl bench teacher [--model smollm2-135m | DIR] [--split dev] [--hints brief,lowercase,...]
                         [--max-tokens 128] [--limit N] [--threads 2] [--json FILE]

The teacher term (docs/trainer.md) pulls the policy toward what the same model writes with the
judge's hint appended to the person's message (judge/prompts.py `teacher_messages`). It can
teach no more than the teacher itself does: a preference the model does not follow when told
is out of the loop's reach, however many versions run. For each hint (the judge's canonical
wording for an everyday preference, `TEACHER_HINTS`) and for none (the base), the model
answers the everyday questions of `--split` (clawrl/eval/data/everyday; `dev` unless told)
greedily, with transformers; printed per hint: the share of replies satisfying each
preference's checker (clawrl/eval/everyday.py `satisfies`), mean words, the share on topic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from clawrl.eval.everyday import PREFS, SPLITS, load, satisfies
from clawrl.judgemodel.synth import NEW_HINTS
from clawrl.world.town import HINTS

# The judge's canonical hint for each everyday preference it can name.
TEACHER_HINTS = {"brief": HINTS["brief"][0], "lowercase": HINTS["lowercase"][0],
                 "plain": HINTS["no_lists"][0], "one_paragraph": NEW_HINTS["one_paragraph"]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="clawrl bench teacher", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="a model `clawrl models pull` made (by name) or a model folder")
    p.add_argument("--split", choices=SPLITS, default="dev")
    p.add_argument("--hints", default=",".join(TEACHER_HINTS),
                   help=f"preferences whose hint to try ({', '.join(TEACHER_HINTS)})")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="the first N questions only")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    args.hints = [h.strip() for h in args.hints.split(",") if h.strip()]
    bad = [h for h in args.hints if h not in TEACHER_HINTS]
    if bad or not args.hints:
        p.error(f"--hints takes {', '.join(TEACHER_HINTS)}; not {', '.join(bad) or 'none'}")
    if args.max_tokens < 1 or args.threads < 1 or (args.limit is not None and args.limit < 1):
        p.error("--max-tokens, --threads and --limit must be >= 1")
    return args


def model_dir(name: str) -> Path:
    from clawrl.base.settings import load_settings
    from clawrl.cli.stack import is_model_name

    path = Path(name)
    return load_settings().state_dir / "models" / name if is_model_name(path) else path


def measure(model: Path, hints: list[str], split: str, max_tokens: int,
            limit: int | None = None) -> dict[str, dict[str, Any]]:
    """Per hint (and `none`): the replies' rates, mean words, on-topic share, seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from judge.prompts import teacher_messages

    questions = load().split(split)[:limit]
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lm.train(False)
    out: dict[str, dict[str, Any]] = {}
    for name in ["none", *hints]:
        started = time.monotonic()
        chats = [[{"role": "user", "content": q.text}] for q in questions]
        if name != "none":
            chats = [teacher_messages(c, TEACHER_HINTS[name]) for c in chats]
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in chats]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = lm.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=tok.pad_token_id)
        replies = [str(tok.decode(g[enc["input_ids"].shape[1]:], skip_special_tokens=True))
                   for g in gen]
        n = len(replies)
        out[name] = {
            "hint": TEACHER_HINTS.get(name),
            "satisfied": {p: round(sum(satisfies(p, r) for r in replies) / n, 4) for p in PREFS},
            "words": round(sum(len(r.split()) for r in replies) / n, 1),
            "on_topic": round(sum(q.on_topic(r) for q, r in zip(questions, replies,
                                                                 strict=True)) / n, 4),
            "seconds": round(time.monotonic() - started, 1), "example": replies[0]}
    return out


def table(figures: dict[str, dict[str, Any]]) -> str:
    head = "hint           " + " ".join(f"{p:>13}" for p in PREFS) + "  words  on topic"
    rows = [f"{name:<15}" + " ".join(f"{f['satisfied'][p]:>13.2f}" for p in PREFS)
            + f"  {f['words']:>5.1f}  {f['on_topic']:>8.2f}" for name, f in figures.items()]
    return "\n".join([head, *rows])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    model = model_dir(args.model)
    if not (model / "config.json").is_file():
        print(f"clawrl bench teacher: no model at {model} (clawrl models pull smollm2-135m)",
              file=sys.stderr)
        return 1
    import torch

    torch.set_num_threads(args.threads)
    figures = measure(model, args.hints, args.split, args.max_tokens, args.limit)
    print(f"{model.name}, {args.split} split, greedy, {args.max_tokens} new tokens: the share "
          "of replies satisfying each preference, with each preference's hint appended as the "
          "teacher's context appends it")
    print(table(figures))
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "split": args.split,
                                         "figures": figures}, indent=1))
    return 0

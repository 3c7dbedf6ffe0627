"""`clawrl bench grammar`: what grammar-constrained decoding (clawrl/engine/grammar.py) costs
per token against free decoding, in the embedded engine's scheduler, on SmolLM2-135M-Instruct.

    clawrl bench grammar [--model DIR] [--threads N] [--reps 3] [--records 6] [--batch 1 8]

The scheduler runs in this process, as `clawrl engine` runs it, without HTTP in between.
Without `--model`, the model is pulled once into .clawrl/bench-cache/smollm2-135m. Figures
are medians of `--reps` repetitions, for 1 and 8 concurrent requests:

1. constrained: each request samples (temperature 1) a JSON array of `--records` records
   under a schema (strings, bounded integers, an enum, a nested object), until the grammar
   ends it;
2. free: the same requests, each sampling (temperature 1) as many tokens as its
   constrained twin did, EOS ignored — so the batch shrinks the same way as rows finish;
3. per token, milliseconds of decode (from the moment every request has its first token
   to the last, over the tokens after the first), free and constrained, and their ratio;
4. what the grammar alone costs: the matcher's mask fill, its application to the logits and
   the accept, replayed over the constrained replies' tokens, per token;
5. compiling the schema: the first time (the tokenizer's vocabulary read included) and again
   (xgrammar's cache).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch

from clawrl.bench.engine import CACHE_DIR, model_bench_parser, run_timed
from clawrl.engine.grammar import Constraint, Grammars
from clawrl.engine.pretrained import pull_model
from clawrl.engine.runtime import load_model
from clawrl.engine.scheduler import SamplingParams, Scheduler, Sequence

PROG = "clawrl bench grammar"
PROMPT = "List some people as JSON records: name, age, role and address."
RECORD = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "role", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 24},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "role": {"enum": ["admin", "user", "guest"]},
              "address": {"type": "object", "additionalProperties": False,
                          "required": ["city", "zip"],
                          "properties": {"city": {"type": "string", "maxLength": 24},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


def schema(records: int) -> str:
    return json.dumps({"type": "array", "items": RECORD, "minItems": records,
                       "maxItems": records})


def _seqs(ids: list[int], params: list[SamplingParams], rep: int) -> list[Sequence]:
    return [Sequence(rid=f"r{rep}-{i}", input_ids=ids,
                     params=SamplingParams(**{**p.__dict__, "seed": rep * 100 + i}))
            for i, p in enumerate(params)]


def per_token_ms(scheduler: Scheduler, seqs: list[Sequence]) -> float:
    """Decode milliseconds per token, over the tokens after each request's first."""
    seconds = run_timed(scheduler, seqs)
    return 1000 * seconds / max(sum(len(s.output_ids) - 1 for s in seqs), 1)


def grammar_ms(grammars: Grammars, spec: tuple[str, str], replies: list[list[int]],
               vocab: int) -> float:
    """Milliseconds per token of the grammar alone: fill the mask, apply it, accept."""
    compiled = grammars.compile(spec)
    logits = torch.zeros(vocab)
    tokens, started = 0, time.perf_counter()
    for reply in replies:
        constraint = Constraint(compiled, vocab)
        for token in reply:
            constraint.mask(logits)
            constraint.accept(token)
            tokens += 1
    return 1000 * (time.perf_counter() - started) / max(tokens, 1)


def main(argv: list[str]) -> int:
    parser = model_bench_parser(PROG, __doc__ or "")
    parser.add_argument("--records", type=int, default=6)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = args.model or pull_model("smollm2-135m", CACHE_DIR)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    vocab = int(model.config.vocab_size)
    eos = {int(model.generation_config.eos_token_id or tokenizer.eos_token_id)}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                        add_generation_prompt=True)
    ids = tokenizer.encode(ids, add_special_tokens=False)
    grammars = Grammars(tokenizer, vocab, eos)
    spec = ("json_schema", schema(args.records))
    print(f"{PROG}: {model_dir}, float32, {args.threads} threads, vocabulary {vocab}, "
          f"medians of {args.reps}", flush=True)
    started = time.perf_counter()
    compiled = grammars.compile(spec)
    first = time.perf_counter() - started
    started = time.perf_counter()
    grammars.compile(spec)
    again = time.perf_counter() - started
    print(f"compile: first {1000 * first:.0f} ms (vocabulary read included), "
          f"again {1000 * again:.2f} ms", flush=True)

    scheduler = Scheduler(model, eos_ids=eos, decode=lambda t: str(tokenizer.decode(t)),
                          weight_version="bench", max_batch=32)
    scheduler.start()
    replies: list[list[int]] = []
    try:
        for n in args.batch:
            free_ms, held_ms, lengths = [], [], []
            for rep in range(args.reps + 1):  # the first repetition warms up
                constrained = _seqs(ids, [SamplingParams(max_new_tokens=1024, grammar=spec)] * n,
                                    rep)
                for seq in constrained:
                    seq.constraint = Constraint(compiled, vocab)
                held = per_token_ms(scheduler, constrained)
                if any(s.finish is None or s.finish["type"] != "stop" for s in constrained):
                    raise RuntimeError(f"a constrained reply did not finish: "
                                       f"{[s.finish for s in constrained]}")
                length = statistics.median(len(s.output_ids) for s in constrained)
                free = per_token_ms(scheduler, _seqs(ids, [
                    SamplingParams(max_new_tokens=len(s.output_ids), ignore_eos=True)
                    for s in constrained], rep))
                if rep:
                    free_ms.append(free)
                    held_ms.append(held)
                    lengths.append(length)
                    replies += [list(s.output_ids) for s in constrained]
            f, h = statistics.median(free_ms), statistics.median(held_ms)
            print(f"decode, {n} concurrent: free {f:.2f} ms/token, constrained {h:.2f} "
                  f"ms/token ({h / f:.2f}x), replies of {statistics.median(lengths):.0f} tokens",
                  flush=True)
    finally:
        scheduler.stop()
    print(f"grammar alone (mask fill + apply + accept): "
          f"{grammar_ms(grammars, spec, replies, vocab):.3f} ms/token over "
          f"{sum(map(len, replies))} tokens", flush=True)
    text = str(tokenizer.decode(replies[0], skip_special_tokens=True))
    sample: Any = json.loads(text)
    print(f"a reply parses: {len(sample)} records, first {json.dumps(sample[0])[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

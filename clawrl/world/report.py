"""What the pretrained tiny world model learned: the numbers in DIR/report.json.

`evaluate_model` generates with the in-memory model on held-out questions (never in the
corpus) and reports:

- `answers`: held-out answer accuracy (greedy and sampled at temperature 1);
- `base_rates`: share of sampled replies (no hint) satisfying each eval preference — the
  starting point of the learning curve in `clawrl eval`;
- `hint_following`: the same share when the teacher hint for that preference is appended;
- `judge`: PRM `\\boxed{}` accuracy and hint extraction on fresh judged turns, split into
  corrections phrased as in the corpus (`seen`) and phrasings the corpus never used (`fresh`).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from clawrl.world.corpus import Message, judge_prompt, render_chatml, teacher_content
from clawrl.world.town import (
    CORRECTIONS,
    EVAL_PREFERENCES,
    FRESH_CORRECTIONS,
    FRESH_PRAISE,
    HINTS,
    NEUTRAL,
    PRAISE,
    Style,
    World,
    fact_correction,
    fact_hint,
    fact_sentence,
    is_correct,
    render_reply,
    satisfies,
    wrong_world,
)

_BOX = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_HINT = re.compile(r"\[HINT\](.*?)\[/HINT\]", re.DOTALL)


def parse_box(text: str) -> int | None:
    """The vote in exactly one `\\boxed{}` (1, +1, -1 or 0), else None (docs/judge-format.md)."""
    boxes = _BOX.findall(text)
    if len(boxes) != 1 or boxes[0] not in ("1", "+1", "-1", "0"):
        return None
    return int(boxes[0])


def parse_hint(text: str) -> str | None:
    """The hint text, "" for an explicit `[NO_HINT]`, None when unparseable."""
    if text.strip() == "[NO_HINT]":
        return ""
    pairs = _HINT.findall(text)
    if len(pairs) != 1 or "[NO_HINT]" in text:
        return None
    return str(pairs[0]).strip()


def generate(model: Any, tokenizer: Any, prompts: list[list[Message]], temperature: float,
             max_new_tokens: int = 64, batch_size: int = 32,
             render: Any = None) -> list[str]:
    """Replies to chat prompts (left-padded batches; stops at `<|im_end|>`). `render`: the
    prompt text of a conversation up to the assistant's turn (default: plain ChatML)."""
    import torch
    from transformers import GenerationConfig

    from clawrl.world.model import ENDOFTEXT, IM_END

    eos, pad = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} \
        if temperature > 0 else {"do_sample": False}
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=pad, **sampling)  # type: ignore[no-untyped-call]
    out: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = [tokenizer.encode(render(p) if render else
                                  render_chatml(p)[0] + "<|im_start|>assistant\n").ids
                 for p in prompts[i:i + batch_size]]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in chunk])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=input_ids, attention_mask=mask,
                                 generation_config=config)
        for row in gen[:, width:].tolist():
            row = row[:row.index(eos)] if eos in row else row
            out.append(tokenizer.decode([t for t in row if t != pad]).strip())
    return out


def _rate(flags: list[bool]) -> float:
    return round(sum(flags) / len(flags), 3) if flags else 0.0


def judge_cases(world: World, n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Judged turns on held-out questions: (request, reply, next_state, label, pref, hint,
    fresh); every sixth reply states a wrong fact and is corrected with the true one."""
    cases = []
    for i in range(n):
        q = world.heldout[i % len(world.heldout)]
        request: list[Message] = [{"role": "user", "content": q.text}]
        kind = i % 6
        fresh = i % 2 == 1 if kind != 5 else (i // 6) % 2 == 1
        if kind == 5:
            reply = {"role": "assistant", "content": render_reply(
                wrong_world(world, q, rng), q, Style.random(rng), rng)}
            fact = fact_sentence(world, q, rng)
            phrasing = fact_correction(fact, rng, fresh=fresh)
            cases.append({"request": request, "reply": reply, "pref": "fact", "label": -1,
                          "hint": fact_hint(fact), "fresh": fresh,
                          "next_state": [{"role": "user", "content": phrasing}]})
            continue
        reply = {"role": "assistant", "content": render_reply(world, q, Style.random(rng), rng)}
        unmet = [p for p in EVAL_PREFERENCES if not satisfies(p, reply["content"])]
        if kind < 2 and unmet:
            pref = rng.choice(unmet)
            text = rng.choice((FRESH_CORRECTIONS if fresh else CORRECTIONS)[pref])
            label: int = -1
        elif kind == 4:
            pref, text, label = None, rng.choice(NEUTRAL), 0
        else:
            pref, label = None, 1
            text = rng.choice(FRESH_PRAISE if fresh else PRAISE)
            if rng.random() < 0.5:
                text += " " + rng.choice(world.train).text
        cases.append({"request": request, "reply": reply, "pref": pref, "label": label,
                      "hint": None, "fresh": fresh,
                      "next_state": [{"role": "user", "content": text}]})
    return cases


def evaluate_model(model: Any, tokenizer: Any, world: World, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(f"report-{seed}")
    questions = [world.heldout[i % len(world.heldout)] for i in range(n)]
    plain = [[{"role": "user", "content": q.text}] for q in questions]
    greedy = generate(model, tokenizer, plain, 0.0)
    sampled = generate(model, tokenizer, plain, 1.0)
    report: dict[str, Any] = {
        "answers": {"heldout_greedy": _rate([is_correct(world, q, t)
                                             for q, t in zip(questions, greedy, strict=True)]),
                    "heldout_sampled": _rate([is_correct(world, q, t)
                                              for q, t in zip(questions, sampled, strict=True)])},
        "base_rates": {p: _rate([satisfies(p, t) for t in sampled]) for p in EVAL_PREFERENCES},
        "hint_following": {},
        "samples": {"greedy": greedy[:4], "sampled": sampled[:4]},
    }
    for pref in EVAL_PREFERENCES:
        hinted = [[{"role": "user", "content": teacher_content(q.text, HINTS[pref][i % 2])}]
                  for i, q in enumerate(questions)]
        replies = generate(model, tokenizer, hinted, 1.0)
        report["hint_following"][pref] = _rate([satisfies(pref, t) for t in replies])
    cases = judge_cases(world, n, rng)
    prm = generate(model, tokenizer, [[{"role": "user", "content": judge_prompt(
        "prm", c["request"], c["reply"], c["next_state"])}] for c in cases], 0.0)
    hints = generate(model, tokenizer, [[{"role": "user", "content": judge_prompt(
        "hint", c["request"], c["reply"], c["next_state"])}] for c in cases], 0.0)
    judge: dict[str, Any] = {}
    for split in ("seen", "fresh"):
        idx = [i for i, c in enumerate(cases) if c["fresh"] == (split == "fresh")]
        corr = [i for i in idx if cases[i]["label"] == -1]
        judge[split] = {
            "prm_accuracy": _rate([parse_box(prm[i]) == cases[i]["label"] for i in idx]),
            "hint_accuracy": _rate([_hint_ok(hints[i], cases[i]) for i in idx]),
            "hint_on_corrections": _rate([_hint_ok(hints[i], cases[i]) for i in corr]),
            "hint_on_facts": _rate([_hint_ok(hints[i], cases[i]) for i in corr
                                    if cases[i]["pref"] == "fact"]),
            "cases": len(idx), "corrections": len(corr),
        }
    judge["examples"] = [{"prompt_next": c["next_state"][0]["content"], "prm": p, "hint": h}
                         for c, p, h in list(zip(cases, prm, hints, strict=True))[:4]]
    report["judge"] = judge
    return report


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> Message:
    """The assistant message for generated `text`: its `<tool_call>` JSON blocks as tool
    calls (what the engine's parser returns), the rest as content."""
    calls = []
    for i, block in enumerate(_TOOL_CALL.findall(text)):
        try:
            call = json.loads(block)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"id": f"call_{i}", "type": "function", "function": {
                "name": call["name"], "arguments": call.get("arguments", {})}})
    content = _TOOL_CALL.sub("", text).strip() if calls else text
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def evaluate_tools(model: Any, tokenizer: Any, world: World, n: int, seed: int,
                   max_steps: int = 4) -> dict[str, Any]:
    """Tool-call episodes on held-out questions, sampled at temperature 1 (as the eval's
    agents are): success rate, the first move (lookup / answer / text), and the held-out
    answer accuracy of the plain chat model (did the tools training make it forget?)."""
    from clawrl.world.tools import TOOLS, ToolEpisode, render_template

    episodes = [ToolEpisode(world, world.heldout[(i * 7 + seed) % len(world.heldout)])
                for i in range(n)]
    convo = [list(e.messages) for e in episodes]
    done = [False] * n
    for _ in range(max_steps):
        live = [i for i in range(n) if not done[i]]
        if not live:
            break
        texts = generate(model, tokenizer, [convo[i] for i in live], 1.0, max_new_tokens=96,
                         render=lambda m: render_template(m, TOOLS, add_generation_prompt=True))
        for i, text in zip(live, texts, strict=True):
            reply = parse_tool_calls(text)
            messages, done[i] = episodes[i].step(reply)
            convo[i] += [reply, *messages]
    outcomes = [e.outcome() for e in episodes]
    first = [e.first_move for e in episodes]
    questions = [world.heldout[i % len(world.heldout)] for i in range(n)]
    greedy = generate(model, tokenizer, [[{"role": "user", "content": q.text}]
                                         for q in questions], 0.0)
    return {"episodes": n, "success": _rate([o > 0 for o in outcomes]),
            "first_move": {k: _rate([f == k for f in first]) for k in sorted(set(first))},
            "answers_heldout_greedy": _rate([is_correct(world, q, t)
                                             for q, t in zip(questions, greedy, strict=True)]),
            "examples": [convo[i][2:] for i in range(min(3, n))]}


def _hint_ok(output: str, case: dict[str, Any]) -> bool:
    """A style correction should yield one of the preference's hints, a fact correction the
    fact's hint, anything else `[NO_HINT]`."""
    parsed = parse_hint(output)
    if case["hint"] is not None:
        return bool(parsed == case["hint"])
    if case["pref"] is None:
        return parsed == ""
    return parsed in HINTS[case["pref"]]

"""The sampling distribution a reply is drawn from: resolved by the proxy, sent to the engine
explicitly, stored with the turn (`turns.sampling`).

The engines fill a parameter the request leaves unset from the model's generation_config
(SGLang's chat route: request value > generation_config > OpenAI default; the embedded
engine the same). So that the stored distribution is the one applied on either engine, the
proxy resolves every parameter that shapes the distribution itself — the request's value,
else the engine's default, else the neutral value — and sends all of them. The engine's
defaults come from `/model_info`'s `preferred_sampling_params` (SGLang's field: its
`--preferred-sampling-params`, which deploy/sglang.sh fills from generation_config.json; the
embedded engine reports its generation_config defaults there), read by the proxy's
weight-version poll. A chat never waits for them: until the poll has read them once (the
engine was down when the proxy started), a parameter the request leaves unset is neither
sent nor known — stored as null, and the engine applies its own default; the trainer skips
such a turn when its temperature is the unknown one. `repetition_penalty` is never
a client's to set (openai_types refuses it) and is pinned at 1: the trainer cannot correct for
it, so a model whose generation_config sets one is served without it.

The stored object: temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
repetition_penalty, `logit_bias` (true when the request sent a non-empty one; the biases
themselves stay in `turns.params`), and `constraint`: the grammar the reply was sampled under
(`constrained`), or null. Both engines decode a structured output under a grammar built from
the request (clawrl/engine/grammar.py; SGLang the same, from the same fields, which the proxy
forwards unchanged): the `response_format` when it is `json_object` or `json_schema`, else a
`tool_choice` of `required` or a named function, else — under `auto` — the names of the
`strict` functions; with the request's `tools` (in `turns.tools`) that is the whole grammar.
trainer/offpolicy.py reads it.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Parameters the engine fills from the model's defaults when a request leaves them unset.
NEUTRAL: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
# Sent as given (OpenAI default 0) or pinned.
PENALTIES = ("presence_penalty", "frequency_penalty")


def parse_defaults(value: Any) -> dict[str, float]:
    """The engine's sampling defaults from `/model_info`'s `preferred_sampling_params` (a JSON
    string on SGLang and the embedded engine, or an object): the known numeric keys only."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    if not isinstance(value, dict):
        return {}
    out: dict[str, float] = {}
    for key in NEUTRAL:
        v = value.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = int(v) if key == "top_k" else float(v)
    return out


def applied_sampling(body: dict[str, Any], defaults: dict[str, float] | None) -> dict[str, Any]:
    """The distribution the engine samples `body` with, given the engine's `defaults` (None:
    not known yet; a parameter the request leaves unset is then None, the engine's own)."""
    out: dict[str, Any] = {}
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if value is None and defaults is not None:
            value = defaults.get(key, neutral)
        out[key] = value
    for key in PENALTIES:
        out[key] = body.get(key) or 0.0
    out["repetition_penalty"] = 1.0
    out["logit_bias"] = bool(body.get("logit_bias"))
    out["constraint"] = constrained(body)
    return out


def constrained(body: dict[str, Any]) -> dict[str, Any] | None:
    """The part of a chat request that constrains decoding to a grammar, or None."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return {"response_format": fmt}
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools or choice == "none":
        return None
    if choice == "required" or isinstance(choice, dict):
        return {"tool_choice": choice}
    strict = [t["function"].get("name") for t in tools if isinstance(t, dict)
              and isinstance(t.get("function"), dict) and t["function"].get("strict")]
    return {"strict_tools": strict} if strict else None


def engine_fields(sampling: dict[str, Any]) -> dict[str, Any]:
    """The fields sent to the engine so it applies exactly `sampling` (whatever its defaults):
    every distribution parameter that is known, explicit. (The biases go as the client sent
    them.)"""
    return {key: sampling[key] for key in (*NEUTRAL, *PENALTIES, "repetition_penalty")
            if sampling[key] is not None}

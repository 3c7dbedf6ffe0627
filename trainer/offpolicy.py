"""What was sampled is what is trained: a sample's behaviour distribution, from the sampling
its turn recorded (`turns.sampling`, written by the proxy: proxy/sampling.py).

The rollout logprobs the engine returns (SGLang by default, and the embedded engine) are
log-probabilities under the tempered distribution `log_softmax(logits / T)` before top-p /
top-k / min-p truncation; a greedy request (T ~ 0 or top_k 1) gets `log_softmax(logits)`.
The trainer recomputes the current policy's logprobs at the same temperature
(`behaviour_temperature`), so the importance ratio compares like with like: exactly 1 on the
weights that sampled.

What it cannot correct for is never trained (`off_policy_reason`, a `skipped_reason` of
'off_policy: …', counted under 'off_policy'):
- `logit_bias`: any bias, however small, lets a client pick the tokens and then reward them;
- presence / frequency penalties and a repetition penalty other than 1: they depend on the
  tokens so far and are applied before the logprobs are taken, so the recorded logprobs are
  of a distribution the policy is not;
- a temperature that is not a finite number in [0, 2] (the proxy's bound), or unknown (null:
  the request left it unset before the proxy had read the engine's defaults);
- a structured output (`constraint`: a grammar, clawrl/engine/grammar.py) when
  `train_constrained` does not allow it (below).

A structured output is drawn from the model's distribution with every token the grammar
refused at that position masked out, and its rollout logprobs are of that masked
distribution μ_t = π_t restricted to the allowed tokens, renormalised: for the sampled token,
log μ(a_t) = log π_old(a_t) − log Z_t, Z_t the mass the grammar allowed. As the policy's own
sample it cannot be trained: the ratio π/μ would read the mask as the policy's doing, and
correcting for it needs each position's mask (replaying the grammar in the trainer). Instead
it is trained as distillation toward μ (trainer/loss.py): μ is the teacher, its logprobs the
rollout ones (replacing any hint teacher the judge scored for the turn); the student is the
current policy's own unmasked logprob, detached, at the sample's temperature (μ's), so the
gap log μ − log π = −log Z_t ≥ 0 on the weights that sampled — 0 where the grammar left the
model free, −log π(a_t) where it forced a_t (the `<tool_call>` a model never opens with),
bounded by `constrained_adv_max`. The ratio's behaviour side is the current policy's own
logprob too (ratio 1: a plain policy gradient, since the sample was not drawn from π and no
importance weight can correct for that). The judge's reward stays beside it, on every token:
where the grammar left the model free (which tool, which arguments) a call whose result went
wrong is pushed down and one that worked up, as for any turn.
`train_constrained`: 'own' (the default) trains them in personal mode and on a shared model one
user alone may train — a grammar can force any exact text (a schema's `const`), so on a model
other users are served it would let one client write into it, as a logit_bias would;
'always'; 'never'.

Truncation (top_p, top_k, min_p) is ignored on both sides: the recorded logprob and the
recomputed one are both of the untruncated tempered distribution, so the ratio stays exactly
the one of the tempered policies. The sampled token is always inside the kept set; what is
ignored is the renormalisation over it (the true behaviour probability is p / mass(kept) ≥ p),
a per-token factor within [1, 1/top_p] for top_p — a bounded, consistent bias, not a license
to steer the model.

A turn written before sampling was recorded (migration 0011; `sampling` NULL) is trained as
before: at temperature 1.
"""

from __future__ import annotations

import math
from typing import Any

from clawrl.engine.scheduler import GREEDY_TEMPERATURE

MAX_TEMPERATURE = 2.0


def _number(value: Any, default: float) -> float | None:
    """A finite number (default when absent), or None for anything else."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def is_constrained(sampling: Any) -> bool:
    """Whether a sample was drawn under a grammar (`sampling.constraint` set)."""
    return isinstance(sampling, dict) and bool(sampling.get("constraint"))


def off_policy_reason(sampling: Any, train_constrained: bool = False) -> str | None:
    """Why a sample drawn with `sampling` cannot be trained (None: it can), as the policy's
    own or, when `train_constrained`, a constrained one as distillation from its grammar."""
    if sampling is None:
        return None
    if not isinstance(sampling, dict):
        return "off_policy: unreadable sampling"
    if sampling.get("logit_bias"):
        return "off_policy: logit_bias"
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(sampling.get(name), 0.0)
        if value != 0.0:
            return f"off_policy: {name}"
    if _number(sampling.get("repetition_penalty"), 1.0) != 1.0:
        return "off_policy: repetition_penalty"
    if is_constrained(sampling) and not train_constrained:
        return "off_policy: constrained decoding"
    if "temperature" in sampling and sampling["temperature"] is None:
        return "off_policy: temperature unknown"
    temperature = _number(sampling.get("temperature"), 1.0)
    if temperature is None or not 0.0 <= temperature <= MAX_TEMPERATURE:
        return "off_policy: temperature"
    return None


def behaviour_temperature(sampling: Any) -> float:
    """The temperature a sample's rollout logprobs are at, which the trainer recomputes its
    logprobs at: the recorded temperature, or 1 for a greedy turn (the engines return the
    untempered logprobs for the argmax) or one with no sampling recorded."""
    if not isinstance(sampling, dict):
        return 1.0
    temperature = _number(sampling.get("temperature"), 1.0)
    top_k = sampling.get("top_k")
    if temperature is None or temperature < GREEDY_TEMPERATURE or top_k == 1:
        return 1.0
    return temperature

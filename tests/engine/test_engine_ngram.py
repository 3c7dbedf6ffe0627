"""Speculative decoding from n-gram drafts (clawrl/engine/ngram.py, the scheduler's
`_speculate`): the same greedy tokens and logprobs as one token per step, fewer forwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from enginerun import run_to_end
from tokenizers import Tokenizer

from clawrl.engine.ngram import NgramDraft
from clawrl.engine.runtime import load_model
from clawrl.engine.scheduler import SamplingParams, Scheduler, Sequence

MODEL = Path(__file__).resolve().parents[2] / "clawrl" / "world" / "prebuilt" / "tinyworld-ci"


def test_drafts_follow_the_longest_tail_seen_before() -> None:
    drafts = NgramDraft(num_draft_tokens=3, max_n=2)
    drafts.learn([1, 2, 3, 4, 5, 6])
    assert drafts.draft([9, 2, 3], limit=8) == [4, 5, 6]   # tail (2, 3)
    assert drafts.draft([9, 9, 5], limit=8) == [6]          # tail (5,) only
    assert drafts.draft([9, 9, 3], limit=2) == [4, 5]       # the caller's limit
    assert drafts.draft([7, 8], limit=8) == []
    drafts.learn([2, 3, 7])                                  # the latest continuation wins
    assert drafts.draft([2, 3], limit=8) == [7]
    small = NgramDraft(num_draft_tokens=2, max_n=1, capacity=3)
    small.learn([10, 11, 12, 13, 14])
    assert small.draft([10], limit=8) == [] and small.draft([13], limit=8) == [14]
    with pytest.raises(ValueError):
        NgramDraft(num_draft_tokens=0)


def _generate(scheduler: Scheduler, ids: list[int], **params: object) -> Sequence:
    seq = Sequence(rid="r", input_ids=ids, params=SamplingParams(**params),  # type: ignore[arg-type]
                   return_logprob=True, top_logprobs_num=3)
    return run_to_end(scheduler, seq, timeout_s=120)


def test_speculative_greedy_decoding_writes_what_one_token_per_step_writes() -> None:
    torch.manual_seed(0)
    model = load_model(MODEL, device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    prompts = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
               for q in ("Where does Ada live?", "What is Ada's job?", "Where does Ada live?",
                         "Which colour does Bruno like?", "What is Ada's job?")]
    drafts = NgramDraft(num_draft_tokens=6)
    plain = Scheduler(model, eos_ids={2}, decode=tok.decode, weight_version="v0")
    fast = Scheduler(model, eos_ids={2}, decode=tok.decode, weight_version="v0", drafts=drafts)
    plain.start()
    fast.start()
    try:
        for ids in prompts * 2:
            a = _generate(plain, ids, temperature=0.0, max_new_tokens=40)
            b = _generate(fast, ids, temperature=0.0, max_new_tokens=40)
            assert b.output_ids == a.output_ids and b.finish == a.finish
            assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)
            assert [[t for _, t in top] for top in b.output_top] == \
                [[t for _, t in top] for top in a.output_top]
        # Repeated questions were drafted from the earlier answers, and mostly accepted.
        assert drafts.proposed > 0 and drafts.accepted / drafts.proposed > 0.5
        # A sampled request is never speculated: the drafts are not touched.
        before = drafts.proposed
        _generate(fast, prompts[0], temperature=1.0, max_new_tokens=20, seed=1)
        assert drafts.proposed == before
        # The length limit holds when a draft runs past it.
        short = _generate(fast, prompts[0], temperature=0.0, max_new_tokens=3)
        assert len(short.output_ids) == 3 and short.finish == {"type": "length", "length": 3}
    finally:
        plain.stop()
        fast.stop()

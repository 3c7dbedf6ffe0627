"""The scheduler thread in-process: a failing model step fails its requests, never hangs them."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import torch
from enginerun import run_to_end

from clawrl.engine.scheduler import SamplingParams, Scheduler, Sequence, _sample


class BrokenModel(torch.nn.Module):
    """Injected fault: a causal LM whose forward always raises."""

    config = SimpleNamespace(max_position_embeddings=64)

    def forward(self, **_: Any) -> Any:
        raise RuntimeError("boom")


def test_a_failing_step_aborts_with_500_and_the_thread_serves_on() -> None:
    scheduler = Scheduler(BrokenModel(), eos_ids={2}, decode=lambda ids: "",
                          weight_version="v0")
    scheduler.start()
    try:
        for i in range(2):
            seq = run_to_end(scheduler, Sequence(rid=str(i), input_ids=[1, 2, 3],
                                                 params=SamplingParams(max_new_tokens=3)),
                             timeout_s=60)
            assert seq.finish is not None
            assert seq.finish["type"] == "abort" and seq.finish["status_code"] == 500
            assert "boom" in seq.finish["message"]
    finally:
        scheduler.stop()


def test_sampling_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    gen = torch.Generator().manual_seed(0)
    assert _sample(logits, SamplingParams(temperature=0.0), gen) == 1
    assert _sample(logits, SamplingParams(top_k=1), gen) == 1
    # top_p keeps the smallest prefix reaching the mass: here only the top token.
    assert {_sample(logits, SamplingParams(top_p=0.1), gen) for _ in range(20)} == {1}
    assert {_sample(logits, SamplingParams(top_k=2), gen) for _ in range(50)} <= {1, 3}



def test_a_request_hears_it_finished_only_once_out_of_the_running_batch(
        tiny_model_dir: Any) -> None:
    """A weight update waits for the last request's reader, then requires no KV cache left:
    so when a request learns it finished, the scheduler must already have dropped its rows
    (CI once saw 9 of 12 finished streams still 'running' at the swap)."""
    from clawrl.engine.runtime import load_model

    model = load_model(tiny_model_dir, device="cpu", dtype=torch.float32)
    scheduler = Scheduler(model, eos_ids=set(), decode=lambda ids: "", weight_version="v0")
    still_running: list[bool] = []
    all_done = threading.Event()

    def heard(seq: Sequence) -> None:
        if seq.finish is not None:
            still_running.append(any(s is seq for s in scheduler._running))
            if len(still_running) == 4:
                all_done.set()

    scheduler.start()
    try:
        seqs = [Sequence(rid=str(i), input_ids=[1, 2, 3 + i],
                         params=SamplingParams(max_new_tokens=6 + i % 2, ignore_eos=True))
                for i in range(4)]
        for seq in seqs:
            seq.notify = lambda seq=seq: heard(seq)
            scheduler.submit(seq)
        assert all_done.wait(timeout=60)
    finally:
        scheduler.stop()
    assert [len(s.output_ids) for s in seqs] == [6, 7, 6, 7]
    assert still_running == [False] * 4
    assert scheduler.in_flight() == (0, 0)

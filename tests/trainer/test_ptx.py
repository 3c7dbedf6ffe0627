"""The pretraining-data term (trainer/ptx.py): which tokens it trains, its errors, its step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from clawrl.world.recipe import write_tinyworld_ptx
from trainer.backends.base import BackendError
from trainer.backends.torch import TorchBackend
from trainer.config import TrainerSettings
from trainer.loss import gather_logprobs
from trainer.ptx import (
    PtxBatches,
    PtxDataError,
    PtxExample,
    encode_line,
    load_examples,
    pad_examples,
)

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where does Ada live?"},
        {"role": "assistant", "content": "Ada lives in Porto."},
        {"role": "user", "content": "thanks! and her colour?"},
        {"role": "assistant", "content": "Ada's favourite colour is red."}]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def write_lines(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_chat_trains_exactly_its_assistant_messages(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids, mask = encode_line(tok, {"messages": CHAT})
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode(ids) == rendered
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    # Each assistant content and its end marker; nothing the user or system said.
    assert trained.replace("\n", "") == ("Ada lives in Porto.<|im_end|>"
                                         "Ada's favourite colour is red.<|im_end|>")
    text_ids, text_mask = encode_line(tok, {"text": "Ada lives in Porto."})
    assert tok.decode(text_ids) == "Ada lives in Porto." and all(text_mask)


@pytest.mark.parametrize(("line", "says"), [
    ("{not json", "line 2: Expecting property name"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "line 2: \"messages\" has no assistant"),
    ({"messages": [{"role": "assistant", "content": 3}]}, "line 2: messages.0.content must be"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "line 2: messages.0.role: unknown role"),
    ({"messages": "hi"}, "line 2: \"messages\" must be a non-empty list"),
    ({"text": "", }, "line 2: \"text\" must be a non-empty string"),
    ({"text": "a", "messages": []}, "line 2: expected an object with"),
    ([1, 2], "line 2: expected an object with"),
])
def test_a_bad_line_is_named_in_one_line(tiny_model_dir: Path, tmp_path: Path,
                                         line: object, says: str) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    path = write_lines(tmp_path / "ptx.jsonl", [{"text": "fine"}, line])
    with pytest.raises(PtxDataError, match=f"^ptx_data {tmp_path / 'ptx.jsonl'} ") as err:
        load_examples(path, tok, 512)
    assert says in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PtxDataError, match="No such file"):
        load_examples(tmp_path / "missing.jsonl", tok, 512)


def test_batches_cycle_through_every_example_in_seeded_order(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    texts = [f"line number {i} " * (i + 1) for i in range(5)]
    examples = load_examples(write_lines(tmp_path / "p.jsonl", [{"text": t} for t in texts]),
                             tok, 512)
    first, second = PtxBatches(examples, 5, seed=1), PtxBatches(examples, 5, seed=1)
    ids, attn, mask = first.next()
    assert torch.equal(ids, second.next()[0])  # the same seed, the same order
    seen = {tok.decode(row[: int(a.sum())].tolist()) for row, a in zip(ids, attn, strict=True)}
    assert seen == set(texts)  # one pass: each example once
    assert mask.shape == (5, ids.shape[1] - 1)
    assert torch.equal(mask.sum(1), attn.sum(1).float() - 1)  # every real token but the first


def ptx_nll(b: TorchBackend, examples: PtxBatches) -> float:
    ids, attn, mask = examples.next()
    assert b.model is not None
    with torch.no_grad():
        logits = b.model(input_ids=ids, attention_mask=attn).logits
    return float(-(gather_logprobs(logits, ids) * mask).sum() / mask.sum())


def test_the_step_lowers_the_ptx_loss_and_reports_it(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    from tests.trainer.test_backend import on_policy_batch

    path = write_lines(tmp_path / "ptx.jsonl", [{"messages": CHAT}] * 4)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    probe = PtxBatches(load_examples(path, tok, 512), 4, seed=0)
    results = {}
    for coef in (0.0, 5.0):
        cfg = TrainerSettings(batch_size=4, micro_batch_size=2, kl_coef=0.0, lr=1e-3,
                              device="cpu", ptx_coef=coef, ptx_data=path, ptx_batch_size=4)
        torch.manual_seed(0)
        b = TorchBackend(cfg)
        b.load(tiny_model_dir)
        assert (b.ptx is not None) == (coef > 0)
        before = ptx_nll(b, probe)
        stats = b.train_step(on_policy_batch(b, [1, -1, 1, 0]))
        assert stats.status == "ok"
        results[coef] = (before, ptx_nll(b, probe), stats.extra.get("ptx_nll"))
    (before0, after0, none), (before5, after5, reported) = results[0.0], results[5.0]
    assert none is None and before0 == pytest.approx(before5)
    assert reported == pytest.approx(before5, rel=1e-4)  # the NLL of the batch it trained on
    assert after5 < before5 - 0.05 and after5 < after0 - 0.05


def test_it_needs_data_and_the_torch_backend(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs the torch backend"):
        TrainerSettings(ptx_coef=0.1, backend="megatron")
    b = TorchBackend(TrainerSettings(ptx_coef=0.1, device="cpu", kl_coef=0.0))
    with pytest.raises(BackendError, match="ptx_coef > 0 needs ptx_data"):
        b.load(tiny_model_dir)


def test_the_tiny_world_corpus_holds_no_held_out_question(tmp_path: Path) -> None:
    from clawrl.world.town import World

    path = write_tinyworld_ptx(tmp_path / "ptx.jsonl", 0, examples=300)
    users = [m["content"] for line in path.read_text().splitlines()
             for m in json.loads(line)["messages"] if m["role"] == "user"]
    assert len(users) >= 300
    heldout = [q.text for q in World.build(0).heldout]
    assert not any(q in u for q in heldout for u in users)


def test_tool_calls_in_openai_form_are_trained_and_tool_results_are_not(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from clawrl.world.tools import TOOLS

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    call = {"id": "c0", "type": "function",
            "function": {"name": "lookup", "arguments": '{"person": "Ada", "attribute": "city"}'}}
    chat = [{"role": "user", "content": "Where does Ada live?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c0", "content": "Ada lives in Porto."},
            {"role": "assistant", "content": "Ada lives in Porto."}]
    ids, mask = encode_line(tok, {"messages": chat, "tools": TOOLS})
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m]).replace("\n", "")
    assert trained == ('<tool_call>{"name": "lookup", "arguments": {"person": "Ada", '
                       '"attribute": "city"}}</tool_call><|im_end|>Ada lives in Porto.<|im_end|>')
    assert "<tools>" in tok.decode(ids)  # the tools were offered in the prompt
    with pytest.raises(PtxDataError, match="arguments must be valid JSON"):
        bad = {**call, "function": {"name": "lookup", "arguments": "{oops"}}
        encode_line(tok, {"messages": [chat[0], {"role": "assistant", "tool_calls": [bad]}]})
    with pytest.raises(PtxDataError, match='"tools" must be a list'):
        encode_line(tok, {"messages": chat, "tools": "lookup"})

    rows = [json.loads(line) for line in write_tinyworld_ptx(
        tmp_path / "ptx.jsonl", 0, examples=200, tool_share=0.5).read_text().splitlines()]
    with_tools = [r for r in rows if "tools" in r]
    assert 60 < len(with_tools) < 140 and all(
        any(m.get("tool_calls") for m in r["messages"]) for r in with_tools)
    assert len(load_examples(write_lines(tmp_path / "few.jsonl", with_tools[:5]), tok, 512)) == 5


def test_replayed_samples_are_trained_and_reported(tiny_model_dir: Path) -> None:
    """A step with accepted samples replayed (trainer/data.py `replay_batch`) raises their
    likelihood more than the same step without, and reports their NLL; without replay_coef,
    replay is ignored."""
    from tests.trainer.test_backend import on_policy_batch

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Where does Ada live?"}], add_generation_prompt=True,
        tokenize=False), add_special_tokens=False)
    response = tok.encode("ada lives in porto.", add_special_tokens=False)
    accepted = [PtxExample(ids=prompt + response,
                           mask=[0] * (len(prompt) - 1) + [1] * len(response))] * 4
    probe = pad_examples(accepted)

    def nll(b: TorchBackend) -> float:
        ids, attn, mask = probe
        assert b.model is not None
        with torch.no_grad():
            logits = b.model(input_ids=ids, attention_mask=attn).logits
        return float(-(gather_logprobs(logits, ids) * mask).sum() / mask.sum())

    results = {}
    for coef in (0.0, 5.0):
        torch.manual_seed(0)
        b = TorchBackend(TrainerSettings(batch_size=4, micro_batch_size=2, kl_coef=0.0,
                                         lr=1e-3, device="cpu", replay_coef=coef))
        b.load(tiny_model_dir)
        before = nll(b)
        stats = b.train_step(on_policy_batch(b, [1, -1, 1, 0]), replay=accepted)
        assert stats.status == "ok"
        results[coef] = (before, nll(b), stats.extra.get("replay_nll"))
    (before0, after0, none), (before5, after5, reported) = results[0.0], results[5.0]
    assert none is None and before0 == pytest.approx(before5)
    assert reported == pytest.approx(before5, rel=1e-4)
    assert after5 < before5 - 0.05 and after5 < after0 - 0.05
    with pytest.raises(ValidationError, match="needs the torch backend"):
        TrainerSettings(replay_coef=0.1, backend="megatron")

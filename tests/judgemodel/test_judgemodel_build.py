"""The judge build's pieces: loss weights on the deciding tokens, and the cached lower
layers giving exactly what the full forward gives (a tiny random Qwen2-style model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clawrl.judgemodel.build import (
    answer_loss,
    cache_lower_layers,
    collate,
    decisive_chars,
    decoder,
    staged_figures,
)
from clawrl.judgemodel.model import ADAPTER_DIR
from judge.prompts import TEMPLATE_DIR


def test_an_agent_stage_run_again_keeps_the_earlier_stages_figures() -> None:
    first = {"final_loss": 0.001, "config": {"turns": 2000}}
    once = staged_figures(first, {"final_loss": 0.07})
    assert once == {**first, "agent_stage": {"final_loss": 0.07}}
    twice = staged_figures(once, {"final_loss": 0.003})
    assert twice == {**first, "agent_stage": {"final_loss": 0.003},
                     "earlier_agent_stages": [{"final_loss": 0.07}]}
    thrice = staged_figures(twice, {"final_loss": 0.001})
    assert thrice["earlier_agent_stages"] == [{"final_loss": 0.07}, {"final_loss": 0.003}]
    # The shipped build.json is of that shape: its second stage beside the first one's.
    shipped = json.loads((ADAPTER_DIR / "build.json").read_text())
    assert [st["final_loss"] for st in (*shipped["earlier_agent_stages"],
                                       shipped["agent_stage"])] == [0.0706, 0.0032]


def test_decisive_chars_point_at_the_score_and_the_hint_marker() -> None:
    answer = "\\boxed{-1} [HINT] Write in lowercase. [/HINT]"
    # the score, the hint marker, the hint's first letter, and where it parts from the
    # canonical hints that begin like it ("Write in plain prose…", "Write the whole reply…")
    assert [answer[i] for i in decisive_chars(answer)] == ["-", "H", "W", "i", "l"]
    assert ["[NO_HINT]"[i] for i in decisive_chars("[NO_HINT]")] == ["N"]
    assert ["\\boxed{1}"[i] for i in decisive_chars("\\boxed{1}")] == ["1"]
    for answer, marks in [("-1 [HINT] Be brief. [/HINT]", ["-", "H", "B"]),
                          ("1 [NO_HINT]", ["1", "N"]), ("0 [NO_HINT]", ["0", "N"])]:
        assert [answer[i] for i in decisive_chars(answer)] == marks  # score first


def test_collate_right_aligns_answers_and_weights_each_row_to_one() -> None:
    rows = [([5, 6, 7, 8, 9], 3, [1]), ([5, 6, 9], 2, [])]
    b = collate(rows, pad_id=0, decisive=4.0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [0, 0, 5, 6, 9]]
    assert b["position_ids"][1].tolist()[2:] == [0, 1, 2]
    assert b["labels"].tolist() == [[7, 8, 9], [-100, 6, 9]]  # the last max(n) tokens
    assert b["weights"].sum(-1).tolist() == pytest.approx([1.0, 1.0])
    assert b["weights"].tolist() == [pytest.approx([1 / 6, 4 / 6, 1 / 6]),
                                     pytest.approx([0, 1 / 2, 1 / 2])]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft 0.21 on transformers 5
def test_cached_lower_layers_give_the_full_forward(tiny_model_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    n = model.config.num_hidden_layers
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                             layers_to_transform=[n - 1], init_lora_weights=False))
    model.eval()
    b = collate([([3, 4, 5, 6, 7, 8], 2, [0]), ([3, 9, 8], 2, [1])], pad_id=0, decisive=4.0)
    with torch.no_grad():
        full = answer_loss(model, b)
        cache_lower_layers(model, [b], n - 1)
        inner = decoder(model)
        layers = inner.layers
        inner.layers = layers[n - 1:]
        try:
            cached = answer_loss(model, b)
        finally:
            inner.layers = layers
    assert "hidden" in b and float(cached) == pytest.approx(float(full), abs=1e-5)


def test_cli_refuses_an_unknown_prompt_version_and_a_missing_adapter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from clawrl.judgemodel.cli import main

    assert main(["build", "--prompt-version", "v9", "--state-dir", str(tmp_path)]) == 1
    assert main(["evaluate", "--adapter", str(tmp_path / "none"),
                 "--state-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"clawrl judge build: no judge template prm_v9.txt in {TEMPLATE_DIR}",
                     f"clawrl judge evaluate: no LoRA adapter in {tmp_path / 'none'} "
                     "(adapter_config.json missing)"]


def test_evaluate_refuses_a_follow_up_file_that_is_not_one_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--rows FILE`: a missing file, a line that is not JSON, a style row without a known
    preference and a fact row without `{fact}` each end the command with one line, before
    any model is merged."""
    from clawrl.judgemodel.cli import main

    good = '{"text": "thanks", "label": "praise", "kind": "praise", "preference": null}'
    bad = {"json": "{oops", "pref": '{"text": "caps", "label": "correction", "kind": "style", '
           '"preference": "purple"}', "fact": '{"text": "no", "label": "correction", '
           '"kind": "fact", "preference": null}'}
    assert main(["evaluate", "--rows", str(tmp_path / "none.jsonl"),
                 "--state-dir", str(tmp_path)]) == 1
    for name, line in bad.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(f"{good}\n\n{line}\n", encoding="utf-8")
        assert main(["evaluate", "--rows", str(path), "--state-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("clawrl judge evaluate: [Errno 2] No such file")
    assert lines[1:] == [f"clawrl judge evaluate: {tmp_path / name}.jsonl:3: not a follow-up "
                         "row (text, label, kind, preference as in "
                         "clawrl/judgemodel/data/README.md)" for name in bad]
    assert not (tmp_path / "models").exists()  # nothing merged

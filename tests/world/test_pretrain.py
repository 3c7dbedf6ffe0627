"""`clawrl tinyworld build --small`: a loadable model dir with a consistent tokenizer, a
report of what it learned, caching, and the data pipeline's masks and schedule."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from clawrl.world import pretrain  # noqa: E402
from clawrl.world.corpus import iter_examples, render_chatml  # noqa: E402
from clawrl.world.town import World  # noqa: E402


def test_small_build_is_a_loadable_model_dir(small_world_dir: Path) -> None:
    marker = json.loads((small_world_dir / pretrain.MARKER).read_text())
    assert marker["key"] == pretrain.build_key(pretrain.SMALL)
    model = AutoModelForCausalLM.from_pretrained(small_world_dir)
    assert model.config.eos_token_id == 2
    hf = AutoTokenizer.from_pretrained(small_world_dir)
    ids = hf.apply_chat_template([{"role": "user", "content": "Where does Ada live?"}],
                                 tokenize=False, add_generation_prompt=True)
    batch = hf(ids, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape[1] > batch["input_ids"].shape[1]


def test_tokenizer_ids_agree_across_load_paths(small_world_dir: Path) -> None:
    raw = Tokenizer.from_file(str(small_world_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(small_world_dir)
    for _, messages in itertools.islice(iter_examples(World.build(0), 7), 60):
        text = hf.apply_chat_template(messages, tokenize=False)
        assert text == render_chatml(messages)[0]
        assert hf(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids


def test_report_says_what_it_learned(small_world_dir: Path) -> None:
    report = json.loads((small_world_dir / pretrain.REPORT).read_text())
    assert set(report) >= {"answers", "base_rates", "hint_following", "judge", "training"}
    assert set(report["base_rates"]) == {"lowercase", "brief", "no_lists", "no_signoff"}
    assert report["training"]["steps_done"] == pretrain.SMALL.steps
    assert report["training"]["final_loss"] < 3.0  # it learned something (random ~6.6)


def test_build_is_cached(small_world_dir: Path) -> None:
    marker = small_world_dir / pretrain.MARKER
    before = marker.stat().st_mtime_ns
    lines: list[str] = []
    pretrain.build(small_world_dir, pretrain.SMALL, log=lines.append)
    assert marker.stat().st_mtime_ns == before
    assert "already built" in lines[0]
    assert not pretrain.is_built(small_world_dir, replace(pretrain.SMALL, seed=1))


def test_loss_mask_covers_assistant_tokens_only(small_world_dir: Path) -> None:
    tok = Tokenizer.from_file(str(small_world_dir / "tokenizer.json"))
    messages = [{"role": "user", "content": "Where does Ada live?"},
                {"role": "assistant", "content": "Ada lives in Porto."}]
    ids, mask = pretrain.encode(tok, messages)
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m],
                         skip_special_tokens=False)
    assert trained == "Ada lives in Porto.<|im_end|>"


def test_batches_are_unshifted_and_padded(small_world_dir: Path) -> None:
    tok = Tokenizer.from_file(str(small_world_dir / "tokenizer.json"))
    config = replace(pretrain.SMALL, batch_size=4, seq_len=256)
    stats: dict[str, int] = {}
    ids, masks = next(pretrain.iter_batches(World.build(0), tok, config, stats))
    batch = pretrain.to_tensors(ids, masks, config.seq_len, pad_id=0)
    assert batch["input_ids"].shape == (4, 256)
    labels, inputs = batch["labels"], batch["input_ids"]
    kept = labels != -100
    # HF shifts labels itself: labels must equal the inputs where they are kept.
    assert torch.equal(labels[kept], inputs[kept])
    assert not kept[batch["attention_mask"] == 0].any()
    assert stats["examples"] >= 4


def test_lr_schedule_warms_up_and_anneals_by_steps_or_time() -> None:
    c = replace(pretrain.FULL, lr=1.0, warmup=10, steps=110)
    assert pretrain.lr_at(0, c) == pytest.approx(0.1)
    assert pretrain.lr_at(10, c) == pytest.approx(1.0)
    assert pretrain.lr_at(109, c) == pytest.approx(0.1, abs=1e-3)
    assert pretrain.lr_at(20, c, time_progress=1.0) == pytest.approx(0.1)


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert pretrain.build_main([str(tmp_path / "m"), "--small", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_training_is_reproducible_from_a_seed() -> None:
    torch.set_num_threads(1)
    world = World.build(0)
    config = replace(pretrain.SMALL, steps=3, batch_size=4, tokenizer_examples=300)
    tok = pretrain.train_world_tokenizer(world, config)
    assert tok.to_str() == pretrain.train_world_tokenizer(world, config).to_str()
    first, _ = pretrain.train_model(world, tok, config, None, lambda _: None)
    second, _ = pretrain.train_model(world, tok, config, None, lambda _: None)
    other, _ = pretrain.train_model(world, tok, replace(config, seed=1), None, lambda _: None)
    a, b, c = (m.state_dict() for m in (first, second, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_shipped_build_is_copied_not_retrained(small_world_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A first `clawrl up` copies the build the package ships for the same key (seconds);
    `--force` pretrains anyway."""
    shipped = tmp_path / "prebuilt"
    shutil.copytree(small_world_dir, shipped / "tinyworld-small")
    monkeypatch.setattr(pretrain, "PREBUILT_DIR", shipped)
    lines: list[str] = []
    out = pretrain.build(tmp_path / "model", pretrain.SMALL, log=lines.append)
    assert pretrain.is_built(out, pretrain.SMALL)
    assert any("copied the shipped build tinyworld-small" in line for line in lines), lines
    assert (out / "model.safetensors").read_bytes() == \
        (small_world_dir / "model.safetensors").read_bytes()
    # another config has no shipped build: it is not copied
    assert pretrain.prebuilt(replace(pretrain.SMALL, steps=3)) is None
    # --force pretrains even when a shipped build matches
    lines.clear()
    monkeypatch.setattr(pretrain, "train_model", _refuse_training)
    with pytest.raises(RuntimeError, match="pretraining started"):
        pretrain.build(tmp_path / "forced", pretrain.SMALL, log=lines.append,
                       use_prebuilt=False)


def _refuse_training(*args: object, **kwargs: object) -> None:
    raise RuntimeError("pretraining started")


def test_the_shipped_builds_match_the_current_corpus() -> None:
    """The package ships the full and CI-sized builds for the corpus as it is now: a change
    to the corpus or build config (a new key) must come with a rebuilt prebuilt folder, or a
    fresh clone's first `make up` would pretrain for minutes again."""
    for config in (pretrain.FULL, pretrain.CI):
        shipped = pretrain.prebuilt(config)
        assert shipped is not None, (
            f"no shipped build for key {pretrain.build_key(config)}; run `clawrl tinyworld "
            f"build clawrl/world/prebuilt/<name> --force` and commit it")
        assert (shipped / "model.safetensors").stat().st_size < 8_000_000

"""The megatron backend on CPU, in this process: mapping, parity with HF and the torch backend,
export → engine reload, resume, and the bad inputs (unsupported model, layout, checkpoint).

Multi-process layouts (TP=2, DP=2, PP=2) are in test_megatron_parallel.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

pytest.importorskip("megatron.core")

from clawrl.base.engine_client import EngineClient  # noqa: E402
from trainer.backends import megatron_compat as compat  # noqa: E402
from trainer.backends.megatron import MegatronBackend  # noqa: E402
from trainer.backends.megatron_checkpoint import (  # noqa: E402
    CheckpointMismatchError,
    check_shape,
    model_shape,
)
from trainer.backends.megatron_mapping import (  # noqa: E402
    UnsupportedModelError,
    check_supported,
    gather_tp,
    hf_to_megatron,
    pack_qkv,
    unpack_qkv,
)
from trainer.backends.megatron_run import synthetic_batch  # noqa: E402
from trainer.backends.torch import TorchBackend  # noqa: E402
from trainer.config import TrainerSettings  # noqa: E402
from trainer.export import write_version  # noqa: E402

torch.set_num_threads(1)

# lr large enough that one Adam step visibly moves every weight (~lr per element).
SETTINGS = dict(lr=1e-3, micro_batch_size=3, kl_coef=0.05, entropy_coef=0.01, grad_clip=1.0)


def settings(**kw: object) -> TrainerSettings:
    return TrainerSettings(**{**SETTINGS, "backend": "megatron", **kw})  # type: ignore[arg-type]


@pytest.fixture
def megatron(tiny_model_dir: Path) -> Iterator[MegatronBackend]:
    backend = MegatronBackend(settings())
    backend.load(tiny_model_dir)
    yield backend
    backend.close()


def base_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# --------------------------------------------------------------------------- pure mapping


def test_qkv_is_interleaved_per_key_value_group() -> None:
    hf = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=8)
    q, k, v = torch.arange(8.0), 100 + torch.arange(4.0), 200 + torch.arange(4.0)
    packed = pack_qkv(hf, q, k, v)
    # group 0: its 2 query heads (head_dim 2), its key head, its value head; then group 1
    assert packed.tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert all(torch.equal(a, b) for a, b in zip(unpack_qkv(hf, packed), (q, k, v), strict=True))


def test_tensor_parallel_shards_gather_back_exactly() -> None:
    hf = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=8,
                         model_type="qwen2")
    p = "model.layers.0."
    state = {p + "mlp.gate_proj.weight": torch.randn(6, 8), p + "mlp.up_proj.weight": torch.randn(6, 8),
             p + "self_attn.o_proj.weight": torch.randn(8, 8)}
    for x, rows in (("q", 8), ("k", 4), ("v", 4)):
        state[f"{p}self_attn.{x}_proj.weight"] = torch.randn(rows, 8)
        state[f"{p}self_attn.{x}_proj.bias"] = torch.randn(rows)
    names = ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.self_attention.linear_proj.weight",
             "decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.0.self_attention.linear_qkv.bias"]
    full = hf_to_megatron(hf, state, names, 0)
    shards = [hf_to_megatron(hf, state, names, 0, tp=2, rank=r) for r in (0, 1)]
    # each rank's fc1 is [gate_r; up_r], not a plain half of [gate; up]
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"][:3],
                       state[p + "mlp.gate_proj.weight"][3:])
    assert shards[0]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (8, 4)
    for name in names:
        assert torch.equal(gather_tp(name, [s[name] for s in shards]), full[name])


# --------------------------------------------------------------------------- parity


def test_megatron_logits_equal_hugging_face(megatron: MegatronBackend, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, vocab(tiny_model_dir), (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).expand(2, -1)
    with torch.no_grad(), compat.megatron_context():
        ours = megatron.model.module(ids.to(megatron.device), pos.to(megatron.device), None).cpu()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_training_steps_match_the_torch_backend(
    megatron: MegatronBackend, tiny_model_dir: Path
) -> None:
    batch = synthetic_batch(vocab(tiny_model_dir), samples=5, seq=20)
    ref = TorchBackend(settings(backend="torch"))
    ref.load(tiny_model_dir)
    lp_m, lp_t = megatron.compute_logprobs(batch), ref.compute_logprobs(batch)
    assert ((lp_m - lp_t) * batch.loss_mask).abs().max().item() <= 1e-5
    for _ in range(2):  # step 2 has a non-zero KL term (the policy moved from the reference)
        ours, theirs = megatron.train_step(batch), ref.train_step(batch)
        assert ours.status == theirs.status == "ok"
        assert ours.num_tokens == theirs.num_tokens
        assert theirs.loss is not None and ours.loss == pytest.approx(theirs.loss, abs=1e-5)
        for field in ("pg_loss", "kl", "entropy", "ratio_mean", "grad_norm"):
            assert getattr(ours, field) == pytest.approx(getattr(theirs, field), abs=1e-5), field
    assert theirs.kl and theirs.kl > 0
    exported = megatron.hf_state_dict()
    trained = ref._model().state_dict()
    base = base_weights(tiny_model_dir)
    for name, tensor in exported.items():
        assert (tensor - trained[name].cpu()).abs().max().item() <= 1e-4, name
        assert not torch.equal(tensor, base[name]), f"{name} did not train"


async def test_export_reload_in_the_engine_serves_megatrons_logprobs(
    megatron: MegatronBackend, tiny_model_dir: Path, tmp_path: Path, engine_factory
) -> None:
    url = engine_factory(tiny_model_dir)
    batch = synthetic_batch(vocab(tiny_model_dir), samples=3, seq=16, seed=3)
    before = megatron.compute_logprobs(batch)
    assert megatron.train_step(batch).status == "ok"
    after = megatron.compute_logprobs(batch)
    path = write_version(tmp_path / "weights", 1, megatron.export, tiny_model_dir)
    response = httpx.post(f"{url}/update_weights_from_disk",  # noqa: ASYNC210
                          json={"model_path": str(path), "weight_version": "1"}, timeout=120)
    assert response.status_code == 200, response.text
    async with EngineClient(url) as engine:
        for b in range(batch.size):
            cols = batch.loss_mask[b].nonzero().flatten()
            start, end = int(cols[0]) + 1, int(cols[-1]) + 2
            ids = batch.input_ids[b].tolist()
            served = torch.tensor(await engine.token_logprobs(ids[:start], ids[start:end]))
            assert (served - after[b, cols]).abs().max().item() <= 1e-4
            assert (served - before[b, cols]).abs().max().item() > 1e-4  # the new weights


def test_untied_llama_logits_and_export_match(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False, rope_theta=500000.0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path / "llama"))
    backend = MegatronBackend(settings(kl_coef=0.0))
    try:
        backend.load(tmp_path / "llama")
        ids = torch.randint(0, 128, (2, 12))
        with torch.no_grad(), compat.megatron_context():
            ours = backend.model.module(ids, torch.arange(12).expand(2, -1), None)
        with torch.no_grad():
            assert (ours - hf(input_ids=ids).logits).abs().max().item() <= 1e-5
        backend.export(tmp_path / "out")
    finally:
        backend.close()
    exported, base = load_file(str(tmp_path / "out" / "model.safetensors")), \
        load_file(str(tmp_path / "llama" / "model.safetensors"))
    assert "lm_head.weight" in exported and exported.keys() == base.keys()
    assert all(torch.equal(exported[k], base[k]) for k in base)


def test_export_is_bit_exact_hugging_face(megatron: MegatronBackend, tiny_model_dir: Path,
                                          tmp_path: Path) -> None:
    from safetensors.torch import load_file

    megatron.export(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    exported, base = load_file(str(tmp_path / "out" / "model.safetensors")), base_weights(tiny_model_dir)
    assert exported.keys() == base.keys()
    assert all(torch.equal(exported[k], base[k]) for k in base)


def test_resume_from_distributed_checkpoint_continues_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    batch = synthetic_batch(vocab(tiny_model_dir), samples=4, seq=16, seed=5)
    first = MegatronBackend(settings())
    first.load(tiny_model_dir)
    first.train_step(batch)
    first.export(tmp_path / "v1")
    first.save_state(tmp_path / "v1" / "trainer_state")
    continuous = first.train_step(batch)
    first.close()

    resumed = MegatronBackend(settings())
    resumed.load(tmp_path / "v1", reference_dir=tiny_model_dir)
    resumed.load_state(tmp_path / "v1" / "trainer_state")
    again = resumed.train_step(batch)
    resumed.close()
    assert again.loss == pytest.approx(continuous.loss, abs=1e-7)
    assert again.grad_norm == pytest.approx(continuous.grad_norm, abs=1e-7)


# --------------------------------------------------------------------------- bad input


def _other_model(path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(str(path))
    return path


def test_checkpoint_of_another_model_shape_is_refused(
    megatron: MegatronBackend, tmp_path: Path
) -> None:
    megatron.save_state(tmp_path / "state")
    megatron.close()
    other = MegatronBackend(settings())
    try:
        other.load(_other_model(tmp_path / "other"))
        with pytest.raises(CheckpointMismatchError, match=r"different model.*hidden_size 64 vs 32"):
            other.load_state(tmp_path / "state")
        with pytest.raises(CheckpointMismatchError, match="not a megatron trainer checkpoint"):
            other.load_state(tmp_path)
    finally:
        other.close()


def test_unsupported_architecture_is_refused_before_reading_weights(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(str(tmp_path))  # no weights
    backend = MegatronBackend(settings())
    try:
        with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2'.*missing a weight mapping"):
            backend.load(tmp_path)
    finally:
        backend.close()


def test_unsupported_features_are_named() -> None:
    from transformers import LlamaConfig

    llama = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    check_supported(LlamaConfig(**llama))  # plain Llama is fine
    scaled = LlamaConfig(**llama, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="rope scaling 'linear'"):
        check_supported(scaled)
    with pytest.raises(UnsupportedModelError, match=r"o_proj bias"):
        check_supported(LlamaConfig(**llama, attention_bias=True))
    with pytest.raises(UnsupportedModelError, match="activation 'gelu'"):
        check_supported(LlamaConfig(**llama, hidden_act="gelu"))


@pytest.mark.parametrize(("tp", "what"), [(3, r"attention heads \(4\)"),
                                          (4, r"key/value heads \(2\)")])
def test_tensor_parallel_size_must_divide_heads_and_vocabulary(tp: int, what: str) -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UnsupportedModelError, match=f"tensor parallel size {tp} does not divide the {what}"):
        check_supported(config, tp=tp)
    with pytest.raises(UnsupportedModelError, match=r"vocabulary size \(97\)"):
        check_supported(Qwen2Config(**{**config.to_dict(), "vocab_size": 97}), tp=2)


def test_world_size_must_match_the_layout() -> None:
    with pytest.raises(ValueError, match=r"world size 1 does not match the parallel layout tp 2"):
        MegatronBackend(settings(tp=2))
    # nothing is left half-initialised: a correct backend starts afterwards
    MegatronBackend(settings()).close()


def test_checkpoint_of_another_parallel_layout_is_refused(tmp_path: Path) -> None:
    from transformers import Qwen2Config

    hf = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "megatron.json").write_text(json.dumps({"shape": model_shape(hf), "tp": 2,
                                                        "pp": 1}))
    check_shape(tmp_path, hf, tp=2, pp=1)
    with pytest.raises(CheckpointMismatchError, match=r"tp 2 × pp 1, this run is tp 1 × pp 2"):
        check_shape(tmp_path, hf, tp=1, pp=2)


def test_lora_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="LoRA is not supported by the megatron"):
        MegatronBackend(settings(lora={"enabled": True}))


def test_sharded_hugging_face_checkpoints_are_read(tiny_model_dir: Path, tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    from trainer.backends.megatron_checkpoint import HFWeights

    base = base_weights(tiny_model_dir)
    save_torch_state_dict(base, str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    weights = HFWeights(tmp_path)
    assert set(weights) == set(base)
    assert all(torch.equal(weights[k], base[k]) for k in base)

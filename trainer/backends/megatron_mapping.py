"""Hugging Face Llama / Qwen2 ⇄ megatron-core GPTModel: config, model and exact weight mapping.

The mapping is a pure reshape, no arithmetic, so HF → Megatron → HF is bit-exact:

| HF (per layer `model.layers.i.`)            | Megatron (`decoder.layers.i.`)               |
|---------------------------------------------|----------------------------------------------|
| `input_layernorm.weight`                    | `input_layernorm.weight`                     |
| `self_attn.{q,k,v}_proj.{weight,bias}`      | `self_attention.linear_qkv.{weight,bias}`    |
| `self_attn.o_proj.weight`                   | `self_attention.linear_proj.weight`          |
| `post_attention_layernorm.weight`           | `pre_mlp_layernorm.weight`                   |
| `mlp.{gate,up}_proj.weight`                 | `mlp.linear_fc1.weight` = `[gate; up]`       |
| `mlp.down_proj.weight`                      | `mlp.linear_fc2.weight`                      |
| `model.embed_tokens.weight`                 | `embedding.word_embeddings.weight`           |
| `model.norm.weight`                         | `decoder.final_layernorm.weight`             |
| `lm_head.weight` (absent when tied)         | `output_layer.weight` (absent when tied)     |

`linear_qkv` is not `[Q; K; V]`: megatron groups rows per key/value head, so for each of
the `g` KV groups it holds that group's `h/g` query heads, then its key head, then its value
head (each `head_dim` rows). The Qwen2 qkv bias is laid out the same way.

Tensor parallelism splits column-parallel weights (qkv, fc1, embedding, output layer) along
rows and row-parallel weights (proj, fc2) along columns. Since whole KV groups are
contiguous in `linear_qkv`, its rows split into `tp` equal blocks of whole groups. `fc1` is
the exception: each rank holds `[gate_r; up_r]`, so gate and up are split separately.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.backends.base import BackendError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class UnsupportedModelError(BackendError, ValueError):
    """The HF model (or the parallel layout asked for) cannot be mapped to megatron-core."""


def _rope_theta(hf: Any) -> float:
    """rope_theta from transformers 4.x (`rope_theta`) or 5.x (`rope_parameters`)."""
    params = getattr(hf, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf, "rope_theta", 10000.0))


def _rope_type(hf: Any) -> str:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def kv_heads(hf: Any) -> int:
    return int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)


def has_qkv_bias(hf: Any) -> bool:
    return hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))


def check_supported(hf: Any, tp: int = 1, pp: int = 1) -> None:
    """Refuse, before any weights are loaded, a model or layout the mapper cannot handle.

    Raises UnsupportedModelError naming the missing piece.
    """
    arch = ",".join(getattr(hf, "architectures", None) or [])
    where = f"{arch} (model_type {hf.model_type!r})" if arch else f"model_type {hf.model_type!r}"
    missing: list[str] = []
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        missing.append(
            f"a weight mapping for model_type {hf.model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    else:
        if getattr(hf, "hidden_act", "silu") != "silu":
            missing.append(f"activation {hf.hidden_act!r} (only silu)")
        if _rope_type(hf) != "default":
            missing.append(f"rope scaling {_rope_type(hf)!r} (only default rope)")
        if hf.model_type == "llama" and getattr(hf, "attention_bias", False):
            missing.append("o_proj bias (attention_bias=True)")
        if getattr(hf, "mlp_bias", False):
            missing.append("MLP bias (mlp_bias=True)")
        if getattr(hf, "use_sliding_window", False):
            missing.append("sliding-window attention")
    if missing:
        raise UnsupportedModelError(
            f"cannot train {where} with the megatron backend: missing {'; '.join(missing)}"
        )
    heads, groups = hf.num_attention_heads, kv_heads(hf)
    for name, value in (
        ("attention heads", heads),
        ("key/value heads", groups),
        ("vocabulary size", hf.vocab_size),
        ("intermediate size", hf.intermediate_size),
    ):
        if value % tp != 0:
            raise UnsupportedModelError(
                f"tensor parallel size {tp} does not divide the {name} ({value}) of {where}"
            )
    if hf.num_hidden_layers % pp != 0:
        raise UnsupportedModelError(
            f"pipeline parallel size {pp} does not divide the {hf.num_hidden_layers} layers "
            f"of {where}"
        )


def transformer_config(hf: Any, tp: int = 1, pp: int = 1, fused: bool = False) -> Any:
    """megatron TransformerConfig equivalent to the HF config (fp32 unless `fused` on GPU)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported(hf, tp, pp)
    dtype = torch.bfloat16 if fused else torch.float32
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=kv_heads(hf),
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf),
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=fused,
        use_cpu_initialization=not fused,
        perform_initialization=False,  # every weight is overwritten by the HF checkpoint
        # Fused paths need CUDA. SwiGLU and bias-dropout-add fusions are megatron's own jit
        # kernels; the fused causal softmax needs megatron's compiled extension; RoPE fusion,
        # persistent layer norm and fused wgrad accumulation need Apex / Transformer Engine,
        # which the local spec does not use.
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused and _has_module("scaled_upper_triang_masked_softmax_cuda"),
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def build_model(hf: Any, config: Any) -> Any:
    """This rank's GPTModel stage (local spec, no Transformer Engine)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf),
    )
    mark_tensor_parallel(model)
    pad = getattr(hf, "pad_token_id", None)
    if model.pre_process and pad is not None:
        no_grad_through_padding_row(model.embedding.word_embeddings, int(pad))
    return model


def no_grad_through_padding_row(embedding: torch.nn.Module, pad_id: int) -> None:
    """HF's `nn.Embedding(padding_idx=pad_token_id)` semantics for megatron's embedding.

    Llama / Qwen2 build `embed_tokens` with `padding_idx`, so a lookup of the pad token sends
    no gradient to its row (the tied output layer still does). megatron's embedding has no
    such option; detaching the looked-up vectors of pad tokens gives the same gradients.
    """

    def hook(module: torch.nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        is_pad = (inputs[0] == pad_id).unsqueeze(-1)  # [b, s, 1], output [b, s, h]
        return torch.where(is_pad, output.detach(), output)

    embedding.register_forward_hook(hook)


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Tag split weights with megatron's tensor-parallel attributes.

    megatron-core 0.16 sets `tensor_model_parallel` only inside its weight initialisers,
    which `perform_initialization=False` skips (we overwrite every weight from the HF
    checkpoint). Untagged, a split weight counts as a replicated duplicate: its gradient is
    left out of the global grad norm on every rank but 0, and clipping under TP goes wrong.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        dim = parallel_dim(name)
        if dim is not None and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, dim, 1)


# ---------------------------------------------------------------- QKV layout (full tensors)


def pack_qkv(hf: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """[Q; K; V] rows (weights [out, in] or biases [out]) → megatron per-group layout."""
    g, d = kv_heads(hf), head_dim(hf)
    per = hf.num_attention_heads // g
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )
    return grouped.reshape(g * (per + 2) * d, *rest)


def unpack_qkv(hf: Any, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of pack_qkv."""
    g, d = kv_heads(hf), head_dim(hf)
    per = hf.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (
        q.reshape(g * per * d, *rest),
        k.reshape(g * d, *rest),
        v.reshape(g * d, *rest),
    )


# ---------------------------------------------------------------- per-parameter mapping


def _split(t: Tensor, dim: int, tp: int, rank: int) -> Tensor:
    return torch.chunk(t, tp, dim=dim)[rank].clone()


# Megatron local-name suffix → the dimension tensor parallelism splits (None = replicated).
PARALLEL_DIMS: dict[str, int | None] = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "decoder.final_layernorm.weight": None,
    "input_layernorm.weight": None,
    "pre_mlp_layernorm.weight": None,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}


def parallel_dim(name: str) -> int | None:
    """The tensor-parallel split dimension of a megatron parameter name."""
    for suffix, dim in PARALLEL_DIMS.items():
        if name.endswith(suffix):
            return dim
    raise UnsupportedModelError(f"no tensor-parallel rule for megatron parameter {name!r}")


def hf_to_megatron(
    hf: Any,
    hf_state: Mapping[str, Tensor],
    names: list[str],
    layer_offset: int,
    tp: int = 1,
    rank: int = 0,
) -> dict[str, Tensor]:
    """The megatron tensors for `names` (this stage's parameter names), sharded for `rank`.

    `layer_offset` is the global index of this pipeline stage's first layer.
    """
    out: dict[str, Tensor] = {}
    for name in names:
        full = _hf_full_tensor(hf, hf_state, name, layer_offset)
        if name.endswith("mlp.linear_fc1.weight") and tp > 1:
            gate, up = full.chunk(2, dim=0)
            out[name] = torch.cat([_split(gate, 0, tp, rank), _split(up, 0, tp, rank)])
            continue
        dim = parallel_dim(name)
        out[name] = full.clone() if dim is None or tp == 1 else _split(full, dim, tp, rank)
    return out


# Per-layer parameters that map one-to-one (megatron suffix -> HF suffix), both directions.
_SAME_SHAPE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _layer(name: str, layer_offset: int) -> tuple[str, str]:
    """`decoder.layers.3.mlp…` → (`model.layers.{3+offset}.`, `mlp…`)."""
    _, _, index, rest = name.split(".", 3)
    return f"model.layers.{int(index) + layer_offset}.", rest


def _hf_full_tensor(hf: Any, s: Mapping[str, Tensor], name: str, offset: int) -> Tensor:
    if name == "embedding.word_embeddings.weight":
        return s["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return s.get("lm_head.weight", s["model.embed_tokens.weight"])
    if name == "decoder.final_layernorm.weight":
        return s["model.norm.weight"]
    if not name.startswith("decoder.layers."):
        raise UnsupportedModelError(f"no HF weight maps to megatron parameter {name!r}")
    p, rest = _layer(name, offset)
    if rest in _SAME_SHAPE:
        return s[p + _SAME_SHAPE[rest]]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return pack_qkv(
            hf, *(s[f"{p}self_attn.{x}_proj.{kind}"] for x in ("q", "k", "v"))
        )
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]])
    raise UnsupportedModelError(f"no HF weight maps to megatron parameter {name!r}")


def gather_tp(name: str, shards: list[Tensor]) -> Tensor:
    """Reassemble one megatron parameter from its tensor-parallel shards (rank order)."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        pairs = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs])
    dim = parallel_dim(name)
    return shards[0] if dim is None else torch.cat(shards, dim=dim)


def megatron_to_hf(
    hf: Any, name: str, full: Tensor, layer_offset: int
) -> dict[str, Tensor]:
    """The HF tensors for one full (TP-gathered) megatron parameter."""
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": full}
    if name == "output_layer.weight":
        return {} if hf.tie_word_embeddings else {"lm_head.weight": full}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    p, rest = _layer(name, layer_offset)
    if rest in _SAME_SHAPE:
        return {p + _SAME_SHAPE[rest]: full}
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = unpack_qkv(hf, full)
        return {f"{p}self_attn.{x}_proj.{kind}": t for x, t in zip("qkv", (q, k, v), strict=True)}
    if rest == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
    raise UnsupportedModelError(f"no HF weight for megatron parameter {name!r}")

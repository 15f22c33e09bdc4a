"""Hugging Face DeepSeek-V3 <-> megatron-fp4: config fields and weight names (``DeepseekV3ForCausalLM``).

The weights share Qwen3-MoE's layout (`qwen3_moe.hf_tensors` / `qwen3_moe.checked_tensors`): the
router ``mlp.gate.weight``, its bias ``mlp.gate.e_score_correction_bias`` (our
``mlp.router.expert_bias`` buffer), experts per expert ("checkpoint": ``mlp.experts.{e}.gate_proj``
...) or fused as transformers 5 holds them (``mlp.experts.gate_up_proj`` [E, 2F, H] gate then up,
``mlp.experts.down_proj`` [E, H, F], i.e. our w13 / w2 as they are), dense layers'
``mlp.{gate,up,down}_proj``; everything else is ``model.`` + our name, except

    ours                                   HF
    layers.{i}.mlp.shared_expert.*         model.layers.{i}.mlp.shared_experts.*
    layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
                          kv_a_layernorm, kv_b_proj, o_proj}   the same names

Every conversion is a rename or a view, so ``from-hf`` then ``to-hf`` gives the same bits. The
multi-token-prediction layer of the released checkpoint (``model.layers.61``, which transformers
also ignores) is not read: convert a checkpoint without it.
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_fp4.config import ModelConfig
from megatron_fp4.integrations.hf import qwen3_moe
from megatron_fp4.integrations.hf.config_fields import bool_field, config_dict, float_field, int_field, rope_fields

HF_MODEL_TYPE = "deepseek_v3"
HF_ARCHITECTURE = "DeepseekV3ForCausalLM"

# DeepseekV3Config's defaults (transformers 5.10) for optional fields a config.json may omit.
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
                "tie_word_embeddings": False, "initializer_range": 0.02, "n_shared_experts": 1,
                "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                "norm_topk_prob": True, "intermediate_size": 18432, "num_experts_per_tok": 8,
                "q_lora_rank": 1536, "v_head_dim": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "kv_lora_rank": 512}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
             "n_routed_experts")
_SHARED_OURS, _SHARED_HF = ".mlp.shared_expert.", ".mlp.shared_experts."


def _rename(name: str) -> str:
    return name.replace(_SHARED_OURS, _SHARED_HF)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def hf_config_from_ours(m: ModelConfig) -> dict:
    """The `transformers.DeepseekV3Config` fields (a config.json dict) of our DeepSeek-V3 `ModelConfig`."""
    if m.family != HF_MODEL_TYPE:
        raise ValueError(f"model.family={m.family!r} cannot be written as DeepSeek-V3")
    k = len(m.dense_layers)
    if sorted(m.dense_layers) != list(range(k)):
        raise ValueError(f"model.dense_layers={m.dense_layers}: DeepSeek-V3 (first_k_dense_replace) has its dense "
                         f"layers first; use [0, ..., k-1]")
    return {
        "model_type": HF_MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads, "intermediate_size": m.dense_ffn_hidden_size,
        "moe_intermediate_size": m.moe_ffn_hidden_size, "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.top_k, "n_shared_experts": m.num_shared_experts, "first_k_dense_replace": k,
        "n_group": m.moe_n_group, "topk_group": m.moe_topk_group,
        "routed_scaling_factor": float(m.moe_routed_scaling_factor), "norm_topk_prob": bool(m.norm_topk_prob),
        "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "hidden_act": "silu",
        "rms_norm_eps": float(m.norm_eps), "rope_theta": float(m.rope_theta),
        "rope_parameters": {"rope_theta": float(m.rope_theta), **(m.rope_scaling or {"rope_type": "default"})},
        "rope_interleave": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",  # vLLM reads both
        "max_position_embeddings": m.max_seq_len, "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": float(m.init_std),
    }


_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")


def ours_config_from_hf(hf_cfg) -> ModelConfig:
    """Our DeepSeek-V3 `ModelConfig` from a config.json dict (or a `DeepseekV3Config`); optional
    fields take DeepseekV3Config's defaults, features our layers do not implement raise ValueError
    naming the field."""
    d = config_dict(hf_cfg, "DeepSeek-V3", _REQUIRED)
    unsupported = {
        "attention_bias": (d.get("attention_bias", False) is not False, "our latent attention has no biases"),
        "rope_interleave": (d.get("rope_interleave", True) is not True, "only HF's interleaved rotary layout "
                            "(rope_interleave=true, the DeepSeek-V3 default) is implemented"),
        "hidden_act": (d.get("hidden_act", "silu") != "silu", "our experts are SwiGLU (silu)"),
        "scoring_func": (d.get("scoring_func", "sigmoid") != "sigmoid", "DeepSeek-V3 routes by sigmoid scores"),
        "topk_method": (d.get("topk_method", "noaux_tc") != "noaux_tc", "only group-limited top-k with the "
                        "e_score_correction_bias ('noaux_tc') is implemented"),
        "quantization_config": (bool(d.get("quantization_config"))  # our FP4 recipe block: high-precision weights
                                and not (isinstance(d["quantization_config"], Mapping)
                                         and d["quantization_config"].get("quant_method") == "megatron_fp4"),
                                "only full-precision (bf16/fp32) weights are read; dequantize the FP8 release first"),
    }
    bad = [f"{k}={d.get(k)!r:.60} ({why})" for k, (is_bad, why) in unsupported.items() if is_bad]
    if bad:
        raise ValueError("HF config has unsupported DeepSeek-V3 settings: " + "; ".join(bad))
    num_layers, num_heads = int_field(d, "num_hidden_layers"), int_field(d, "num_attention_heads")
    num_kv_heads = int_field(d, "num_key_value_heads", num_heads)
    if num_kv_heads != num_heads:
        raise ValueError(f"HF config num_key_value_heads={num_kv_heads} must equal num_attention_heads={num_heads} "
                         "(latent attention gives every head its own keys)")
    first_dense = int_field(d, "first_k_dense_replace", _HF_DEFAULTS["first_k_dense_replace"])
    if first_dense > num_layers:
        raise ValueError(f"HF config first_k_dense_replace={first_dense} > num_hidden_layers={num_layers}")
    q_lora = d.get("q_lora_rank", _HF_DEFAULTS["q_lora_rank"])
    theta, scaling = rope_fields(d, _HF_DEFAULTS["rope_theta"], "DeepSeek-V3", _YARN_KEYS, strict_yarn=True)
    moe_ffn = int_field(d, "moe_intermediate_size")
    dims = {k: int_field(d, k, _HF_DEFAULTS[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                          "v_head_dim")}
    return ModelConfig(
        family=HF_MODEL_TYPE, vocab_size=int_field(d, "vocab_size"), hidden_size=int_field(d, "hidden_size"),
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_heads,
        head_dim=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"],  # the planner's activation estimate only
        max_seq_len=int_field(d, "max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float_field(d, "rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"], positive=True),
        q_lora_rank=0 if q_lora is None else int_field(d, "q_lora_rank"), **dims,
        num_experts=int_field(d, "n_routed_experts"),
        top_k=int_field(d, "num_experts_per_tok", _HF_DEFAULTS["num_experts_per_tok"]), moe_ffn_hidden_size=moe_ffn,
        norm_topk_prob=bool_field(d, "norm_topk_prob", _HF_DEFAULTS["norm_topk_prob"]),
        num_shared_experts=int_field(d, "n_shared_experts", _HF_DEFAULTS["n_shared_experts"]),
        shared_expert_ffn_hidden_size=moe_ffn, dense_layers=list(range(first_dense)),
        dense_ffn_hidden_size=int_field(d, "intermediate_size", _HF_DEFAULTS["intermediate_size"]),
        moe_n_group=int_field(d, "n_group", _HF_DEFAULTS["n_group"]),
        moe_topk_group=int_field(d, "topk_group", _HF_DEFAULTS["topk_group"]),
        moe_routed_scaling_factor=float_field(d, "routed_scaling_factor", _HF_DEFAULTS["routed_scaling_factor"],
                                              positive=True),
        router_aux_loss_coef=0.0,  # aux-loss-free: DeepSeek-V3 balances by the router bias
        tie_embeddings=bool_field(d, "tie_word_embeddings", _HF_DEFAULTS["tie_word_embeddings"]),
        init_std=float_field(d, "initializer_range", _HF_DEFAULTS["initializer_range"]),
    )


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------
def to_hf_state_dict(model, layout: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 tensors of `model` (detached views): "checkpoint" per-expert tensors as in Hub
    files, "fused" the `DeepseekV3ForCausalLM.state_dict()` names of transformers 5."""
    return qwen3_moe.hf_tensors(model, layout, _rename)


def _checked(model, sd, shard: bool, headers_only: bool) -> dict[str, torch.Tensor]:
    return qwen3_moe.checked_tensors(model, sd, shard, headers_only, _rename, "DeepSeek-V3", HF_ARCHITECTURE)


def ours_from_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> dict[str, torch.Tensor]:
    """`model`'s parameter (and router-bias) names -> the HF tensors in our layout, checked strictly
    (one ValueError listing every problem); ``shard``: other ranks' tensors are no error."""
    return _checked(model, sd, shard, headers_only=False)


def check_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> None:
    """The checks alone, on file headers when `sd` is lazy (nothing read, `model` may be meta)."""
    _checked(model, sd, shard, headers_only=True)


def from_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> None:
    """Load HF DeepSeek-V3 tensors into `model` in place (strict, all checks before any write)."""
    found = ours_from_hf_state_dict(model, sd, shard)
    params = dict(qwen3_moe._weights(model))
    with torch.no_grad():
        for name, t in found.items():
            params[name].copy_(t)

"""Our `Config` <-> Megatron-Core `TransformerConfig` (+ the `GPTModel` arguments).

    kw = to_megatron_transformer_config(cfg)              # flat dict, see below
    tc_kwargs, gpt_kwargs = split_megatron_kwargs(kw)
    TransformerConfig(**tc_kwargs); GPTModel(config=..., transformer_layer_spec=..., **gpt_kwargs)
    cfg2 = from_megatron_transformer_config(kw)           # back to our Config

The dict is flat, like Megatron-LM's argument namespace: TransformerConfig fields plus the few
that Megatron-Core takes as `GPTModel` constructor arguments instead (vocab_size,
max_sequence_length, position_embedding_type, rotary_base, rotary_percent,
share_embeddings_and_output_weights; listed in `GPT_MODEL_KEYS`).

Numerics that line up (checked against megatron-core 0.16 source):
- router: ``moe_router_pre_softmax=False`` is top-k over logits then softmax over the k, i.e. our
  ``norm_topk_prob=True``; ``True`` is softmax then top-k without renormalising (``False``).
  ``moe_router_dtype='fp32'``: our router is always fp32.
- aux loss: ``switch_load_balancing_loss_func`` is E·Σ f_e·P_e with f_e = counts/(T·k), ours;
  the z-loss is mean(logsumexp²) in both.
- ``moe_layer_freq`` as a per-layer list (0 = dense) is our ``dense_layers``.

FP4: Megatron-Core's own FP4 (`fp4='e2m1'`, `fp4_recipe='nvfp4'`) wraps *every* linear of a
transformer layer in Transformer Engine's NVFP4BlockScaling autocast and has no residual
compensation. So:
- ``fp4_backend='moeresq'`` (default) writes ``fp4=None``: the FP4 linears are our MoEResQ
  linears placed by the layer-spec helper (`specs.py`), scope and mode from our `FP4Config`.
- ``fp4_backend='te_nvfp4'`` writes mcore's native NVFP4 fields; it is accepted only for what it
  can express: ``fp4.format='nvfp4'``, ``fp4.scope='experts+attention'``, ``fp4.train_mode='fp4'``
  (TE's recipe is close to, not bit-identical with, ours: see integrations/transformer_engine).

Megatron-Core's *runtime* (GPTModel forward, its distributed optimizer, TE layers, the alltoall
dispatcher) needs CUDA; only the config and the module construction run on CPU. This module
imports nothing from megatron-core except in `build_transformer_config`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from megatron_fp4.config import Config, FP4Config, ModelConfig
from megatron_fp4.config.choices import check_choice
from megatron_fp4.integrations.megatron_core.checkpoint import check_family
from megatron_fp4.model.gpt_oss import SWIGLU_LIMIT

GPT_MODEL_KEYS = ("vocab_size", "max_sequence_length", "position_embedding_type", "rotary_base", "rotary_percent",
                  "share_embeddings_and_output_weights")
FP4_BACKENDS = ("moeresq", "te_nvfp4")


def _moe_layer_pattern(m: ModelConfig) -> list[int]:
    return [0 if i in m.dense_layers else 1 for i in range(m.num_layers)]


def _te_fp4_fields(cfg: Config) -> dict:
    f = cfg.fp4
    wanted = {"fp4.format": (f.format, "nvfp4"), "fp4.scope": (f.scope, "experts+attention"),
              "fp4.train_mode": (f.train_mode, "fp4")}
    for name, (value, need) in wanted.items():
        if value != need:
            raise ValueError(f"{name}={value!r}: fp4_backend='te_nvfp4' (Megatron-Core's fp4='e2m1') quantizes every "
                             f"linear of each layer with TE's NVFP4 recipe and no MoEResQ compensation, so it needs "
                             f"{name}={need!r}; keep fp4_backend='moeresq' for our scopes and modes")
    return {"fp4": "e2m1", "fp4_recipe": "nvfp4"}


def to_megatron_transformer_config(cfg: Config, fp4_backend: str = "moeresq") -> dict:
    """Flat dict of Megatron-Core TransformerConfig fields + GPTModel arguments for `cfg`."""
    if not isinstance(cfg, Config):
        raise ValueError(f"cfg must be a megatron_fp4 Config, got {type(cfg).__name__}")
    check_choice("fp4_backend", fp4_backend, FP4_BACKENDS)
    check_family(cfg.model)
    m, p = cfg.model, cfg.parallel
    theta = float(m.rope_theta)
    fp4 = _te_fp4_fields(cfg) if fp4_backend == "te_nvfp4" else {"fp4": None}
    bf16 = cfg.dtype == "bf16"
    out: dict[str, Any] = {
        # -- TransformerConfig ----------------------------------------------------------------
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_heads,
        "num_query_groups": m.num_kv_heads,
        "kv_channels": m.head_dim,
        "ffn_hidden_size": m.dense_ffn_hidden_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(m.norm_eps),
        "qk_layernorm": True,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": float(m.init_std),
        "num_moe_experts": m.num_experts,
        "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
        "moe_router_topk": m.top_k,
        "moe_router_pre_softmax": not m.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(m.router_aux_loss_coef),
        "moe_z_loss_coeff": float(m.router_z_loss_coef),
        "moe_router_dtype": "fp32",
        "moe_layer_freq": _moe_layer_pattern(m),
        "moe_shared_expert_intermediate_size": (m.num_shared_experts * m.shared_expert_ffn_hidden_size
                                                if m.num_shared_experts else None),
        "tensor_model_parallel_size": p.tp,
        "sequence_parallel": bool(p.sequence_parallel and p.tp > 1),
        "expert_tensor_parallel_size": p.etp,
        "pipeline_model_parallel_size": p.pp,
        "virtual_pipeline_model_parallel_size": p.virtual_stages if p.virtual_stages > 1 else None,
        "expert_model_parallel_size": p.ep,
        "bf16": bf16,
        "params_dtype": torch.bfloat16 if bf16 else torch.float32,
        "pipeline_dtype": torch.bfloat16 if bf16 else torch.float32,  # mcore requires it when pp > 1
        **fp4,
        # -- GPTModel arguments -----------------------------------------------------------------
        "vocab_size": m.vocab_size,
        "max_sequence_length": m.max_seq_len,
        "position_embedding_type": "rope",
        "rotary_base": int(theta) if theta.is_integer() else theta,
        "rotary_percent": 1.0,
        "share_embeddings_and_output_weights": bool(m.tie_embeddings),
    }
    family = check_family(m)
    if family == "gpt_oss":
        out.update(_gpt_oss_fields(m))
    elif family == "deepseek_v3":
        out.update(_deepseek_v3_fields(m))
    return out


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x·σ(1.702·x)``: Megatron-Core's ``quick_gelu`` (GPT-OSS's gate activation, alpha 1.702)."""
    return x * torch.sigmoid(1.702 * x)


def _gpt_oss_fields(m: ModelConfig) -> dict:
    """GPT-OSS (Megatron-Core's own GPT-OSS settings): biases on every linear, the sinks as a
    learnable softmax offset, sliding-window layers (``window_size=(window − 1, 0)``: a query sees
    itself and the ``window − 1`` keys before it, as HF's mask; ``window_attn_skip_freq`` 1 = a
    sliding layer), the clamped SwiGLU as ``quick_gelu`` with ``glu_linear_offset=1`` and clamp 7,
    top-k over the router logits then softmax over the k, YaRN (``yarn_*``: attributes GPTModel
    reads from the config, set by `build_transformer_config`)."""
    sliding = "sliding_attention" in m.layer_types
    out = {"add_bias_linear": True, "add_qkv_bias": True, "qk_layernorm": False, "softmax_type": "learnable",
           "window_size": (m.sliding_window - 1, 0) if sliding else None,
           "window_attn_skip_freq": [int(t == "sliding_attention") for t in m.layer_types] if sliding else None,
           "activation_func": quick_gelu, "glu_linear_offset": 1.0, "activation_func_clamp_value": SWIGLU_LIMIT,
           "moe_router_pre_softmax": False}
    rs = m.rope_scaling
    if rs is not None:
        out.update({"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": float(rs["factor"]),
                    "yarn_original_max_position_embeddings": int(rs["original_max_position_embeddings"]),
                    "yarn_beta_fast": float(rs.get("beta_fast") or 32), "yarn_beta_slow": float(rs.get("beta_slow") or 1),
                    "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0,
                    "yarn_correction_range_round_to_int": bool(rs.get("truncate", True))})
    return out


def _deepseek_v3_fields(m: ModelConfig) -> dict:
    """DeepSeek-V3 (`MLATransformerConfig`): latent attention with its low ranks (``q_lora_rank``
    None: one q projection) and head dims, the latent norms (``qk_layernorm``), RoPE on the rotary
    part in HF's interleaved layout (Megatron-Core's MLA de-interleaves it as our layers do: the
    weights are renamed, not permuted), plain or YaRN with mscale; sigmoid router with the expert bias, group-limited top-k and the scaling factor
    (Megatron-Core renormalises sigmoid top-k weights: ``norm_topk_prob`` must be true)."""
    if not m.norm_topk_prob:
        raise ValueError("model.norm_topk_prob=false: Megatron-Core's sigmoid router always renormalises the top-k "
                         "weights; the DeepSeek-V3 mapping needs norm_topk_prob=true")
    rs = m.rope_scaling or {}
    out = {"multi_latent_attention": True, "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
           "qk_head_dim": m.qk_nope_head_dim, "qk_pos_emb_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
           "num_query_groups": m.num_heads, "kv_channels": m.qk_nope_head_dim + m.qk_rope_head_dim,
           "qk_layernorm": True, "apply_rope_fusion": False,
           "rope_type": "yarn" if rs else "rope",
           "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
           "moe_router_bias_update_rate": float(m.moe_router_bias_update_rate),
           "moe_router_num_groups": m.moe_n_group, "moe_router_group_topk": m.moe_topk_group,
           "moe_router_topk_scaling_factor": float(m.moe_routed_scaling_factor), "moe_router_pre_softmax": False}
    if rs:
        out.update({"rotary_scaling_factor": float(rs["factor"]),
                    "original_max_position_embeddings": int(rs["original_max_position_embeddings"]),
                    "beta_fast": float(rs.get("beta_fast") or 32), "beta_slow": float(rs.get("beta_slow") or 1),
                    "mscale": float(rs.get("mscale", 1.0)), "mscale_all_dim": float(rs.get("mscale_all_dim", 0.0))})
    return out


def split_megatron_kwargs(kw: Mapping[str, Any]) -> tuple[dict, dict]:
    """(TransformerConfig kwargs, GPTModel kwargs) of a flat dict (the ``yarn_*`` entries stay with
    the config: attributes GPTModel reads from it, not fields; `build_transformer_config` sets them)."""
    return ({k: v for k, v in kw.items() if k not in GPT_MODEL_KEYS},
            {k: v for k, v in kw.items() if k in GPT_MODEL_KEYS})


def build_transformer_config(cfg: Config, fp4_backend: str = "moeresq", **overrides):
    """A real `megatron.core.transformer.TransformerConfig` (needs megatron-core; runs on CPU)."""
    try:
        from megatron.core.activations import quick_gelu as mcore_quick_gelu
        from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    except ImportError as e:
        raise RuntimeError("build_transformer_config needs megatron-core: pip install 'megatron-fp4[megatron]'") from e
    tc_kwargs, _ = split_megatron_kwargs(to_megatron_transformer_config(cfg, fp4_backend))
    tc_kwargs.update(overrides)
    if tc_kwargs.get("activation_func") is quick_gelu:
        tc_kwargs["activation_func"] = mcore_quick_gelu  # the same function; Megatron-Core fuses its own
    attributes = {k: tc_kwargs.pop(k) for k in list(tc_kwargs) if k.startswith("yarn_")}
    config = (MLATransformerConfig if tc_kwargs.get("multi_latent_attention") else TransformerConfig)(**tc_kwargs)
    for key, value in attributes.items():
        setattr(config, key, value)
    return config


# ---------------------------------------------------------------------------------------------
# reverse
# ---------------------------------------------------------------------------------------------
def _as_dict(config) -> dict:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return dict(config)
    raise ValueError(f"expected a TransformerConfig or a dict of its fields, got {type(config).__name__}")


def _is_silu(fn) -> bool:
    return fn is None or fn is F.silu or fn == "silu" or getattr(fn, "__name__", "") == "silu"


def _family_of(d: dict) -> str:
    """The model family a Megatron-Core config describes: MLA is DeepSeek-V3, a learnable softmax
    offset (attention sinks) GPT-OSS, anything else Qwen3-MoE."""
    if d.get("multi_latent_attention"):
        return "deepseek_v3"
    return "gpt_oss" if d.get("softmax_type") == "learnable" else "qwen3_moe"


# the fields each family reads differently from Qwen3-MoE's checks below (its own checks: _FAMILY_CHECKS)
_FAMILY_FIELDS = {
    "gpt_oss": {"add_bias_linear", "add_qkv_bias", "qk_layernorm", "activation_func", "position_embedding_type"},
    "deepseek_v3": {"multi_latent_attention", "moe_router_score_function", "moe_router_enable_expert_bias",
                    "moe_router_topk_scaling_factor", "moe_router_num_groups"},
}


def _family_checks(d: dict, family: str) -> list:
    def get(key, default=None):
        return d.get(key, default)

    if family == "gpt_oss":
        return [
            ("add_bias_linear", not get("add_bias_linear", True), "GPT-OSS's linears have biases; set True"),
            ("add_qkv_bias", not get("add_qkv_bias", False), "GPT-OSS's q/k/v have biases; set True"),
            ("qk_layernorm", bool(get("qk_layernorm", False)), "GPT-OSS has no q/k norm; set False"),
            ("activation_func", getattr(get("activation_func"), "__name__", "") != "quick_gelu",
             "GPT-OSS's gate activation is quick_gelu (x·σ(1.702x))"),
            ("glu_linear_offset", float(get("glu_linear_offset", 0.0) or 0.0) != 1.0, "GPT-OSS's SwiGLU is (up + 1)·…"),
            ("activation_func_clamp_value", get("activation_func_clamp_value") != SWIGLU_LIMIT,
             f"GPT-OSS clamps at {SWIGLU_LIMIT}"),
            ("moe_router_pre_softmax", bool(get("moe_router_pre_softmax", False)),
             "GPT-OSS takes the top-k logits, then the softmax over them"),
            ("position_embedding_type", get("position_embedding_type", "rope") not in ("rope", "yarn"),
             "GPT-OSS uses RoPE or YaRN"),
        ]
    if family == "deepseek_v3":
        return [
            ("moe_router_score_function", get("moe_router_score_function") != "sigmoid",
             "DeepSeek-V3 routes by sigmoid scores"),
            ("moe_router_enable_expert_bias", not get("moe_router_enable_expert_bias", False),
             "DeepSeek-V3's router carries the expert bias (e_score_correction_bias); set True"),
            ("qk_layernorm", not get("qk_layernorm", False), "DeepSeek-V3 normalises the q and kv latents; set True"),
            ("rope_type", get("rope_type", "yarn") not in ("rope", "yarn"), "RoPE or YaRN"),
        ] + [(name, get(name) is None, "latent attention needs it (an MLATransformerConfig field)")
             for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")]
    return []


def _unsupported(d: dict, family: str = "qwen3_moe") -> list[tuple[str, Any, str]]:
    """(field, value, why) for each feature of `d` our decoder (of `family`) does not implement."""
    def get(key, default=None):
        return d.get(key, default)

    checks = [
        ("normalization", get("normalization", "LayerNorm") != "RMSNorm", "our norms are RMSNorm; set 'RMSNorm'"),
        ("gated_linear_unit", not get("gated_linear_unit", False), "our MLPs are SwiGLU; set True"),
        ("activation_func", not _is_silu(get("activation_func")), "our MLPs use silu (SwiGLU)"),
        ("add_bias_linear", bool(get("add_bias_linear", True)), "our linears have no bias; set False"),
        ("add_qkv_bias", bool(get("add_qkv_bias", False)), "our q/k/v projections have no bias; set False"),
        ("qk_layernorm", not get("qk_layernorm", False), "our attention always applies q/k RMSNorm (Qwen3); set True"),
        ("layernorm_zero_centered_gamma", bool(get("layernorm_zero_centered_gamma", False)),
         "our RMSNorm multiplies by the weight itself"),
        ("multi_latent_attention", bool(get("multi_latent_attention", False)), "MLA is not implemented (GQA only)"),
        ("hidden_dropout", float(get("hidden_dropout", 0.0) or 0.0) != 0.0, "our model has no dropout; set 0.0"),
        ("attention_dropout", float(get("attention_dropout", 0.0) or 0.0) != 0.0, "our model has no dropout; set 0.0"),
        ("num_moe_experts", not get("num_moe_experts"), "this is a dense model; we build MoE models only"),
        ("moe_router_score_function", get("moe_router_score_function", "softmax") != "softmax",
         "our router is softmax top-k"),
        ("moe_router_load_balancing_type", get("moe_router_load_balancing_type", "aux_loss") not in ("aux_loss", "none"),
         "only the Switch-style 'aux_loss' (or 'none') balancing loss is implemented"),
        ("moe_aux_loss_coeff", isinstance(get("moe_aux_loss_coeff"), (list, tuple)),
         "one coefficient for one loss type; per-type lists are not supported"),
        ("moe_router_enable_expert_bias", bool(get("moe_router_enable_expert_bias", False)),
         "aux-loss-free expert bias is not implemented"),
        ("moe_router_topk_scaling_factor", get("moe_router_topk_scaling_factor") not in (None, 1.0),
         "routing weights are not rescaled in our router"),
        ("moe_router_num_groups", get("moe_router_num_groups") is not None, "group-limited routing is not implemented"),
        ("moe_shared_expert_gate", bool(get("moe_shared_expert_gate", False)), "our shared expert has no gate"),
        ("moe_router_dtype", get("moe_router_dtype") not in (None, "fp32"), "our router computes in fp32"),
        ("moe_layer_freq", isinstance(get("moe_layer_freq", 1), str),
         "give a per-layer list of 0/1 (or an int) instead of a string pattern"),
        ("position_embedding_type", get("position_embedding_type", "rope") != "rope", "our attention uses RoPE"),
        ("rotary_percent", float(get("rotary_percent", 1.0)) != 1.0, "RoPE rotates the whole head (1.0)"),
        ("rotary_interleaved", bool(get("rotary_interleaved", False)), "our RoPE is rotate-half (not interleaved)"),
        ("context_parallel_size", int(get("context_parallel_size", 1) or 1) != 1, "context parallelism is not implemented"),
        ("fp8", get("fp8") is not None, "FP8 training is not implemented (use our FP4 recipes)"),
        ("fp4", get("fp4") not in (None, "e2m1"), "only fp4='e2m1' exists"),
        ("fp4_recipe", get("fp4") is not None and get("fp4_recipe", "nvfp4") != "nvfp4",
         "only the 'nvfp4' recipe maps to ours ('custom' quantizer factories do not)"),
        ("first_last_layers_bf16", get("fp4") is not None and bool(get("first_last_layers_bf16", False)),
         "per-layer FP4 exclusion is not expressible in our scopes"),
    ]
    skip = _FAMILY_FIELDS.get(family, set())
    checks = [c for c in checks if c[0] not in skip] + _family_checks(d, family)
    return [(name, d.get(name), why) for name, bad, why in checks if bad]


def _gpt_oss_model(d: dict, num_layers: int) -> dict:
    """The GPT-OSS `ModelConfig` fields of a Megatron-Core config (`_gpt_oss_fields` reversed)."""
    skip, window = d.get("window_attn_skip_freq"), d.get("window_size")
    if window is not None and (not isinstance(skip, (list, tuple)) or len(skip) != num_layers):
        raise ValueError(f"window_attn_skip_freq={skip!r}: GPT-OSS's layers are read from a per-layer list of "
                         f"num_layers={num_layers} entries (1 = sliding window)")
    out = {"layer_types": [] if window is None else ["sliding_attention" if v else "full_attention" for v in skip],
           "sliding_window": 0 if window is None else int(window[0]) + 1, "rope_scaling": None}
    if d.get("position_embedding_type") == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": float(d["yarn_rotary_scaling_factor"]),
                               "original_max_position_embeddings": int(d["yarn_original_max_position_embeddings"]),
                               "beta_fast": float(d.get("yarn_beta_fast", 32)), "beta_slow": float(d.get("yarn_beta_slow", 1)),
                               "truncate": bool(d.get("yarn_correction_range_round_to_int", True))}
    return out


def _deepseek_v3_model(d: dict) -> dict:
    """The DeepSeek-V3 `ModelConfig` fields of an `MLATransformerConfig` (`_deepseek_v3_fields` reversed)."""
    out = {"q_lora_rank": int(d.get("q_lora_rank") or 0), "kv_lora_rank": int(d["kv_lora_rank"]),
           "qk_nope_head_dim": int(d["qk_head_dim"]), "qk_rope_head_dim": int(d["qk_pos_emb_head_dim"]),
           "v_head_dim": int(d["v_head_dim"]), "num_kv_heads": int(d["num_attention_heads"]),
           "head_dim": int(d["qk_head_dim"]) + int(d["qk_pos_emb_head_dim"]),
           "moe_n_group": int(d.get("moe_router_num_groups") or 1), "moe_topk_group": int(d.get("moe_router_group_topk") or 1),
           "moe_routed_scaling_factor": float(d.get("moe_router_topk_scaling_factor") or 1.0),
           "moe_router_bias_update_rate": float(d.get("moe_router_bias_update_rate") or 0.0),
           "norm_topk_prob": True, "rope_scaling": None}
    if d.get("rope_type", "yarn") == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": float(d.get("rotary_scaling_factor", 40)),
                               "original_max_position_embeddings": int(d.get("original_max_position_embeddings", 4096)),
                               "beta_fast": float(d.get("beta_fast", 32)), "beta_slow": float(d.get("beta_slow", 1)),
                               "mscale": float(d.get("mscale", 1.0)), "mscale_all_dim": float(d.get("mscale_all_dim", 0.0))}
    return out


def _dense_layers(freq, num_layers: int) -> list[int]:
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq}: must be >= 1")
        return [i for i in range(num_layers) if i % freq != 0]
    pattern = list(freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(f"moe_layer_freq={pattern}: must hold num_layers={num_layers} entries of 0 (dense) or 1 (MoE)")
    return [i for i, v in enumerate(pattern) if v == 0]


def from_megatron_transformer_config(config, gpt_model_kwargs: Optional[Mapping[str, Any]] = None,
                                     fp4_cfg: Optional[FP4Config] = None, base: Optional[Config] = None) -> Config:
    """Our `Config` from a Megatron-Core TransformerConfig (object or dict of fields), merged with
    the GPTModel arguments (`gpt_model_kwargs`, or the same flat dict). Fields with no mcore
    counterpart (optimizer, data, ...) come from `base` (default `Config()`).

    FP4: `fp4_cfg` when given; else mcore's fp4='e2m1' becomes scope 'experts+attention', mode
    'fp4' (what TE's autocast does), and fp4=None becomes scope 'none', mode 'bf16'.
    A feature our decoder lacks raises ValueError naming the field (all of them at once)."""
    d = _as_dict(config)
    d.update(dict(gpt_model_kwargs or {}))
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size") if d.get(k) is None]
    if missing:
        raise ValueError(f"Megatron config lacks {missing}; vocab_size is a GPTModel argument: pass it in "
                         f"gpt_model_kwargs or in the same dict")
    family = _family_of(d)
    bad = _unsupported(d, family)
    if bad:
        lines = "; ".join(f"{name}={value!r} ({why})" for name, value, why in bad)
        read_as = {"deepseek_v3": " (read as model.family=deepseek_v3: multi_latent_attention=True)",
                   "gpt_oss": " (read as model.family=gpt_oss: softmax_type='learnable', the sinks)"}.get(family, "")
        raise ValueError(f"Megatron config{read_as} uses features megatron-fp4 does not support: {lines}")
    num_layers, hidden, heads = int(d["num_layers"]), int(d["hidden_size"]), int(d["num_attention_heads"])
    ffn = int(d.get("ffn_hidden_size") or 4 * hidden)
    shared = d.get("moe_shared_expert_intermediate_size")
    balance = d.get("moe_router_load_balancing_type", "aux_loss")
    theta = float(d.get("rotary_base", 10000))
    model = ModelConfig(
        vocab_size=int(d["vocab_size"]), hidden_size=hidden, num_layers=num_layers, num_heads=heads,
        num_kv_heads=int(d.get("num_query_groups") or heads),
        head_dim=int(d.get("kv_channels") or hidden // heads),
        max_seq_len=int(d.get("max_sequence_length") or ModelConfig.max_seq_len),
        rope_theta=theta, norm_eps=float(d.get("layernorm_epsilon", 1e-5)),
        num_experts=int(d["num_moe_experts"]), top_k=int(d.get("moe_router_topk", 2)),
        moe_ffn_hidden_size=int(d.get("moe_ffn_hidden_size") or ffn),
        norm_topk_prob=not bool(d.get("moe_router_pre_softmax", False)),
        num_shared_experts=1 if shared else 0,
        shared_expert_ffn_hidden_size=int(shared) if shared else ModelConfig.shared_expert_ffn_hidden_size,
        dense_layers=_dense_layers(d.get("moe_layer_freq", 1), num_layers), dense_ffn_hidden_size=ffn,
        router_aux_loss_coef=0.0 if balance == "none" else float(d.get("moe_aux_loss_coeff") or 0.0),
        router_z_loss_coef=float(d.get("moe_z_loss_coeff") or 0.0),
        tie_embeddings=bool(d.get("share_embeddings_and_output_weights", False)),
        init_std=float(d.get("init_method_std", 0.02)),
    )
    if family != "qwen3_moe":
        model = dataclasses.replace(model, family=family, **(_gpt_oss_model(d, num_layers) if family == "gpt_oss"
                                                            else _deepseek_v3_model(d)))
    if fp4_cfg is None:
        if d.get("fp4") == "e2m1":
            fp4_cfg = FP4Config(scope="experts+attention", format="nvfp4", train_mode="fp4", rollout_mode="fp4")
        else:
            fp4_cfg = FP4Config(scope="none", train_mode="bf16", rollout_mode="bf16")
    base = base or Config()
    vpp = d.get("virtual_pipeline_model_parallel_size")
    parallel = dataclasses.replace(
        base.parallel, pp=int(d.get("pipeline_model_parallel_size") or 1), virtual_stages=int(vpp or 1),
        ep=int(d.get("expert_model_parallel_size") or 1), tp=int(d.get("tensor_model_parallel_size") or 1),
        # mcore's expert_tensor_parallel_size=None means tp; ours is etp=1 unless given (the same numbers:
        # where the experts' products run is a layout choice, `parallel/dims.py`)
        etp=int(d.get("expert_tensor_parallel_size") or 1),
        sequence_parallel=bool(d.get("sequence_parallel")) if int(d.get("tensor_model_parallel_size") or 1) > 1
        else base.parallel.sequence_parallel,
        schedule="interleaved_1f1b" if vpp and int(vpp) > 1 else base.parallel.schedule)
    if parallel.schedule == "interleaved_1f1b" and parallel.virtual_stages == 1:
        parallel = dataclasses.replace(parallel, schedule="1f1b")
    return dataclasses.replace(base, model=model, fp4=fp4_cfg, parallel=parallel,
                               dtype="bf16" if d.get("bf16") else "fp32")


__all__ = ["GPT_MODEL_KEYS", "FP4_BACKENDS", "to_megatron_transformer_config", "split_megatron_kwargs",
           "build_transformer_config", "from_megatron_transformer_config", "quick_gelu"]

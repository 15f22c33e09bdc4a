"""The model-family fields of a config (``model.family``, ``layer_types``, ``sliding_window``,
``rope_scaling``) and what each family supports, checked before anything is built.

Torch-free and below `schema` like `validate`, which calls `validate_family`. The families'
builders live in `megatron_fp4.model.registry`; the names are `config.choices.MODEL_FAMILIES`.
"""
from __future__ import annotations

import math

from megatron_fp4.config.choices import MODEL_FAMILIES, ConfigError
from megatron_fp4.config.yaml_io import show

LAYER_TYPES = ("full_attention", "sliding_attention")
YARN_KEYS = {"rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"}
MSCALE_KEYS = {"mscale", "mscale_all_dim"}  # DeepSeek-V3's YaRN attention-scale terms (deepseek_v3 only)


def _require(cond: bool, field: str, value, fix: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={show(value)}: {fix}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_rope_scaling(rs, max_seq_len: int) -> None:
    """``model.rope_scaling``: null or a YaRN mapping with a positive factor and original length."""
    if rs is None:
        return
    field = "model.rope_scaling"
    _require(isinstance(rs, dict), field, rs, "must be null or a mapping {rope_type: yarn, factor: ..., "
             "original_max_position_embeddings: ...}")
    _require(rs.get("rope_type") == "yarn", field + ".rope_type", rs.get("rope_type"),
             "only 'yarn' RoPE scaling is implemented (null: plain RoPE)")
    unknown = sorted(set(rs) - YARN_KEYS - MSCALE_KEYS)
    _require(not unknown, field, rs, f"unknown key(s) {unknown}; YaRN takes {sorted(YARN_KEYS)}")
    _require(_number(rs.get("factor")) and rs["factor"] >= 1, field + ".factor", rs.get("factor"),
             "must be a number >= 1 (the context extension factor, e.g. 32)")
    orig = rs.get("original_max_position_embeddings")
    _require(isinstance(orig, int) and not isinstance(orig, bool) and 0 < orig <= max(max_seq_len, 1 << 24),
             field + ".original_max_position_embeddings", orig, "must be a positive integer (the pretraining "
             "context, e.g. 4096)")
    for key in ("beta_fast", "beta_slow"):
        if rs.get(key) is not None:
            _require(_number(rs[key]) and rs[key] > 0, f"{field}.{key}", rs[key], "must be a number > 0")
    for key in sorted(MSCALE_KEYS & set(rs)):
        _require(_number(rs[key]) and rs[key] >= 0, f"{field}.{key}", rs[key], "must be a number >= 0")
    if rs.get("truncate") is not None:
        _require(isinstance(rs["truncate"], bool), field + ".truncate", rs["truncate"], "must be true or false")


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
GROUP_FIELDS = ("moe_n_group", "moe_topk_group", "moe_routed_scaling_factor")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_deepseek_v3(m) -> None:
    """DeepSeek-V3's latent attention dims and group routing, and what its layers do not implement."""
    why = "the deepseek_v3 family"
    for name in MLA_FIELDS:
        low = 0 if name in ("q_lora_rank", "qk_nope_head_dim") else 1
        _require(_int(getattr(m, name)) and getattr(m, name) >= low, f"model.{name}", getattr(m, name),
                 f"must be an integer >= {low} ({why}'s latent attention; q_lora_rank 0: one q_proj)")
    _require(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", m.qk_rope_head_dim,
             "must be even (rotary embeddings rotate pairs)")
    _require(m.num_kv_heads == m.num_heads, "model.num_kv_heads", m.num_kv_heads,
             f"must equal model.num_heads={m.num_heads}: latent attention gives every head its own keys and values")
    _require(not m.layer_types or set(m.layer_types) == {"full_attention"}, "model.layer_types", m.layer_types,
             f"{why} has full causal attention only; set []")
    E, groups, topk_group = m.num_experts, m.moe_n_group, m.moe_topk_group
    _require(_int(groups) and groups >= 1 and E % groups == 0 and E // groups >= 2, "model.moe_n_group", groups,
             f"must divide model.num_experts={E} into groups of at least 2 experts (a group is scored by its best two)")
    _require(_int(topk_group) and 1 <= topk_group <= groups, "model.moe_topk_group", topk_group,
             f"must be between 1 and model.moe_n_group={groups}")
    _require(m.top_k <= topk_group * (E // groups), "model.top_k", m.top_k,
             f"must be <= moe_topk_group * experts per group = {topk_group * (E // groups)}")
    _require(_number(m.moe_routed_scaling_factor) and m.moe_routed_scaling_factor > 0,
             "model.moe_routed_scaling_factor", m.moe_routed_scaling_factor, "must be a number > 0 (e.g. 2.5)")
    _require(not m.num_shared_experts or m.shared_expert_ffn_hidden_size == m.moe_ffn_hidden_size,
             "model.shared_expert_ffn_hidden_size", m.shared_expert_ffn_hidden_size,
             f"must equal model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} (DeepSeek-V3's shared experts are "
             "num_shared_experts experts of the routed experts' width)")


def validate_family(cfg) -> None:
    """The family fields, and the features and layouts the chosen family does not implement."""
    m, p = cfg.model, cfg.parallel
    _require(m.family in MODEL_FAMILIES, "model.family", m.family, f"must be one of {list(MODEL_FAMILIES)} (the "
             "model families megatron_fp4.model.registry builds; docs/families.md)")
    _require(isinstance(m.layer_types, list) and all(t in LAYER_TYPES for t in m.layer_types), "model.layer_types",
             m.layer_types, f"entries must be among {list(LAYER_TYPES)}")
    _require(not m.layer_types or len(m.layer_types) == m.num_layers, "model.layer_types", m.layer_types,
             f"must name all model.num_layers={m.num_layers} layers, or be empty (every layer full attention)")
    _require(isinstance(m.sliding_window, int) and m.sliding_window >= 0, "model.sliding_window", m.sliding_window,
             "must be an integer >= 0")
    sliding = "sliding_attention" in m.layer_types
    _require(not sliding or m.sliding_window > 0, "model.sliding_window", m.sliding_window,
             "must be > 0 when model.layer_types has sliding_attention layers (the keys each one sees)")
    validate_rope_scaling(m.rope_scaling, m.max_seq_len)
    if m.family != "deepseek_v3":
        mscale = sorted(MSCALE_KEYS & set(m.rope_scaling or {}))
        _require(not mscale, "model.rope_scaling", m.rope_scaling, f"{mscale} are DeepSeek-V3's YaRN terms; only "
                 "model.family=deepseek_v3 reads them")
        for name in MLA_FIELDS + GROUP_FIELDS:
            default = 1 if name in GROUP_FIELDS else 0
            _require(getattr(m, name) == default, f"model.{name}", getattr(m, name), f"only the deepseek_v3 family "
                     f"has latent attention and group-limited routing; set model.family=deepseek_v3 or {default}")
    else:
        return validate_deepseek_v3(m)
    if m.family == "qwen3_moe":
        for name, bad in (("layer_types", sliding), ("rope_scaling", m.rope_scaling is not None)):
            _require(not bad, f"model.{name}", getattr(m, name), "the qwen3_moe family has full attention and "
                     "plain RoPE only; set model.family=gpt_oss for sliding-window layers and YaRN, or drop it")
        return
    # gpt_oss: what its layers do not implement (yet), each refused with the reason
    why = "the gpt_oss family"
    _require(not m.dense_layers, "model.dense_layers", m.dense_layers, f"{why} has MoE in every layer; set []")
    _require(m.num_shared_experts == 0, "model.num_shared_experts", m.num_shared_experts,
             f"{why} has no shared expert; set 0")
    _require(m.moe_router_bias_update_rate == 0, "model.moe_router_bias_update_rate", m.moe_router_bias_update_rate,
             f"{why} has a learned router bias (trained by its gradient), so aux-loss-free balancing's "
             "expert bias is not used: set 0")
    _require(m.moe_capacity_factor is None, "model.moe_capacity_factor", m.moe_capacity_factor,
             f"{why} runs without expert capacity; set null")
    _require(m.hidden_size % p.etp == 0, "model.hidden_size", m.hidden_size,
             f"must be a multiple of parallel.etp={p.etp} for {why}: expert tensor parallel cuts the experts' "
             "output bias b2 along it; choose etp dividing hidden_size")

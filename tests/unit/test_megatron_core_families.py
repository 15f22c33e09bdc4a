"""The Megatron-Core name and config mapping of GPT-OSS and DeepSeek-V3 (beside Qwen3-MoE's in
tests/unit/test_integration_megatron_core.py): one name map read in both directions.

- state dicts: ours → Megatron-Core names → ours, bitwise, for both layer specs and expert layouts
  (DeepSeek-V3 with and without a q low rank);
- GPT-OSS's names, shapes and a strict load against a real Megatron-Core GPTModel built on CPU
  (local spec; DeepSeek-V3's MLA has no local-spec core attention on CPU in megatron-core 0.16.1, so
  its names are checked against `MLASelfAttention`'s submodule names here instead);
- configs: the mapping builds real `TransformerConfig` / `MLATransformerConfig` objects whose fields
  carry the family's settings, and reads back to the same `ModelConfig`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import megatron.core  # noqa: F401 - the test extra installs megatron-core: a missing package fails, never skips

from megatron_fp4.config import Config
from megatron_fp4.integrations.megatron_core import (build_transformer_config, from_mcore_state_dict,
                                                     from_megatron_transformer_config, to_mcore_state_dict,
                                                     to_megatron_transformer_config)
from megatron_fp4.integrations.megatron_core.checkpoint import name_map
from megatron_fp4.model import build_model
from megatron_fp4.model.gpt_oss import clamped_swiglu
from tests.distributed.test_family_layouts import family_cfg
from tests.unit.test_integration_megatron_core import _GPT_SCRIPT, run_result_script


def _cfg(family: str, q_lora_rank=None):
    cfg = family_cfg(family, {})
    cfg.dtype = "fp32"
    m = cfg.model
    if family == "deepseek_v3":
        m.head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim  # as from-hf sets it (the planner's estimate)
        m.rope_scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        if q_lora_rank is not None:
            m.q_lora_rank = q_lora_rank
    else:
        m.rope_scaling = dict(m.rope_scaling, beta_fast=32.0, beta_slow=1.0, truncate=True)
    cfg.validate()
    return cfg


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


@pytest.mark.parametrize("family,q_lora_rank", [("gpt_oss", None), ("deepseek_v3", None), ("deepseek_v3", 0)])
@pytest.mark.parametrize("spec", ["te", "local"])
@pytest.mark.parametrize("experts", ["sequential", "te_grouped"])
def test_state_dict_round_trip_bitwise(family, q_lora_rank, spec, experts):
    cfg = _cfg(family, q_lora_rank)
    ours = build_model(cfg, seed=3).state_dict()
    mc = to_mcore_state_dict(ours, cfg.model, spec, experts)
    back = from_mcore_state_dict(mc, cfg.model, spec, experts)
    assert set(back) == set(ours)
    for key in ours:
        assert back[key].dtype == ours[key].dtype and torch.equal(_bits(back[key]), _bits(ours[key])), key
    # every tensor went somewhere, and the names are the family's Megatron-Core modules
    assert sum(v.numel() for v in mc.values()) == sum(v.numel() for v in ours.values())
    e = "local_experts.1.linear_fc1.{}" if experts == "sequential" else "linear_fc1.{}1"
    moe = "decoder.layers.1.mlp."
    if family == "gpt_oss":
        att = "decoder.layers.0.self_attention."
        assert torch.equal(mc[att + "core_attention.softmax_offset"], ours["layers.0.self_attn.sinks"])
        D, r = cfg.model.head_dim, cfg.model.num_heads // cfg.model.num_kv_heads
        qkv_bias = mc[att + "linear_qkv.bias"]  # group 0: its r query heads, then k head 0, then v head 0
        assert torch.equal(qkv_bias[:r * D], ours["layers.0.self_attn.q_proj.bias"][:r * D])
        assert torch.equal(qkv_bias[r * D:(r + 1) * D], ours["layers.0.self_attn.k_proj.bias"][:D])
        assert torch.equal(mc[moe + "experts." + e.format("bias")], ours["layers.1.mlp.experts.b13"][1])
        assert torch.equal(mc[moe + "router.bias"], ours["layers.1.mlp.router.bias"])
    else:
        att = "decoder.layers.1.self_attention."
        down = "linear_q_down_proj.weight" if cfg.model.q_lora_rank else "linear_q_proj.weight"
        for name in (down, "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "linear_proj.weight"):
            assert att + name in mc, name
        norm = "linear_kv_up_proj.layer_norm_weight" if spec == "te" else "kv_layernorm.weight"
        assert torch.equal(mc[att + norm], ours["layers.1.self_attn.kv_a_layernorm.weight"])
        assert torch.equal(mc[moe + "router.expert_bias"], ours["layers.1.mlp.router.expert_bias"])
        assert torch.equal(mc[moe + "shared_experts.linear_fc1.weight"].chunk(2)[0],
                           ours["layers.1.mlp.shared_expert.gate_proj.weight"])
        assert "decoder.layers.0.mlp.linear_fc1.weight" in mc  # the dense first layer
    with pytest.raises(ValueError, match="lacks"):
        from_mcore_state_dict({k: v for k, v in mc.items() if not k.endswith("linear_proj.weight")}, cfg.model,
                              spec, experts)
    with pytest.raises(ValueError, match="no Megatron-Core name"):
        to_mcore_state_dict(dict(ours, stray=torch.zeros(1)), cfg.model, spec, experts)


def test_one_table_for_both_directions():
    """Every entry names each of its keys once across the table (so the two directions are inverse
    renamings), and the table of a config is what both functions read."""
    for family in ("qwen3_moe", "gpt_oss", "deepseek_v3"):
        cfg = Config() if family == "qwen3_moe" else _cfg(family)
        entries = name_map(cfg.model, "te", "te_grouped")
        ours = [k for e in entries for k in e.ours]
        mcore = [k for e in entries for k in e.mcore]
        assert len(ours) == len(set(ours)) and len(mcore) == len(set(mcore)), family
        assert set(ours) == set(build_model(cfg, seed=0).state_dict()), family


def test_gpt_oss_names_match_a_real_megatron_gpt_model(tmp_path):
    """Megatron-Core's GPTModel of the GPT-OSS config (local spec) on CPU: our names and shapes are
    exactly its state dict, it loads them strictly, and its state dict reads back bitwise."""
    result = run_result_script(tmp_path / "build_gpt_oss.py", _GPT_SCRIPT, base_port=29900, args=("gpt_oss",))
    assert result == {"missing": [], "unexpected": [], "shape_mismatch": [], "load_missing": [], "bitwise": True}


@pytest.mark.parametrize("q_lora_rank", [None, 0])
def test_mla_names_are_megatron_cores_submodules(q_lora_rank):
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    fields = {f.name for f in dataclasses.fields(MLASelfAttentionSubmodules)}
    cfg = _cfg("deepseek_v3", q_lora_rank)
    used = {k.split(".")[4] for k in to_mcore_state_dict(build_model(cfg, seed=0).state_dict(), cfg.model, "local")
            if ".self_attention." in k}
    assert used <= fields and "linear_kv_up_proj" in used, (used - fields, used)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_config_builds_megatron_core_objects_and_reads_back(family):
    cfg = _cfg(family)
    m = cfg.model
    tc = build_transformer_config(cfg)
    if family == "gpt_oss":
        assert type(tc).__name__ == "TransformerConfig"
        assert (tc.add_bias_linear, tc.add_qkv_bias, tc.qk_layernorm, tc.softmax_type) == (True, True, False, "learnable")
        assert tc.window_size == (m.sliding_window - 1, 0)
        assert tc.window_attn_skip_freq == [1, 0, 1, 0]  # 1 = sliding window
        assert (tc.glu_linear_offset, tc.activation_func_clamp_value) == (1.0, 7.0)
        assert tc.yarn_rotary_scaling_factor == m.rope_scaling["factor"]
        # Megatron-Core's gated unit with these settings is our clamped SwiGLU
        g = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 6
        up = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 6
        c = tc.activation_func_clamp_value
        theirs = tc.activation_func(g.clamp(max=c)) * (up.clamp(-c, c) + tc.glu_linear_offset)
        torch.testing.assert_close(theirs, clamped_swiglu(g, up), rtol=1e-6, atol=1e-6)
    else:
        assert type(tc).__name__ == "MLATransformerConfig"
        assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim) == \
            (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
        assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_num_groups,
                tc.moe_router_group_topk, tc.moe_router_topk_scaling_factor) == \
            ("sigmoid", True, m.moe_n_group, m.moe_topk_group, m.moe_routed_scaling_factor)
        assert (tc.rope_type, tc.rotary_scaling_factor, tc.mscale_all_dim) == ("yarn", 4.0, 1.0)
        assert tc.moe_shared_expert_intermediate_size == m.moe_ffn_hidden_size and tc.moe_layer_freq == [0, 1, 1, 1]
    kw = to_megatron_transformer_config(cfg)
    back = from_megatron_transformer_config(kw, fp4_cfg=cfg.fp4)
    assert back.model == m
    back.validate()


@pytest.mark.parametrize("family,field,value,words", [
    ("gpt_oss", "add_qkv_bias", False, "add_qkv_bias=False"),
    ("gpt_oss", "activation_func", F.silu, "quick_gelu"),
    ("deepseek_v3", "moe_router_score_function", "softmax", "multi_latent_attention=True"),
    ("deepseek_v3", "kv_lora_rank", None, "kv_lora_rank=None"),
])
def test_family_config_refusals_name_the_field(family, field, value, words):
    d = to_megatron_transformer_config(_cfg(family))
    d[field] = value
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        from_megatron_transformer_config(d)


def test_deepseek_v3_needs_renormalised_top_k():
    cfg = _cfg("deepseek_v3")
    cfg.model = dataclasses.replace(cfg.model, norm_topk_prob=False)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        to_megatron_transformer_config(cfg)

"""The DeepSeek-V3 family's layers (HF ``DeepseekV3ForCausalLM``), on the shared decoder of `transformer.py`.

What differs from Qwen3-MoE, each as transformers 5.10 computes it:

- multi-head latent attention (MLA): queries through a low-rank ``q_a_proj`` → RMSNorm →
  ``q_b_proj`` (or one ``q_proj`` when ``model.q_lora_rank`` is 0); keys and values from one
  ``kv_a_proj_with_mqa`` giving the compressed kv [kv_lora_rank] and a single rotary key part
  [qk_rope_head_dim] shared by all heads, the compressed kv through RMSNorm and ``kv_b_proj`` into
  per-head non-rotary keys [qk_nope_head_dim] and values [v_head_dim]. RoPE (fp32, as HF's rotary)
  on the rotary part only, with HF's interleave convention (the pair (2i, 2i+1) rotated as
  (i, i + d/2)); softmax scale ``(qk_nope + qk_rope)^-0.5``, times ``mscale(factor, mscale_all_dim)²``
  under YaRN (``model.rope_scaling`` with DeepSeek's ``mscale`` / ``mscale_all_dim``; the inverse
  frequencies are GPT-OSS's `yarn_inv_freq`). The low-rank norms use eps 1e-6 (HF builds them with
  its default eps, not ``rms_norm_eps``).
- the KV cache holds the full per-head keys and values (the simplest correct form; caching the
  compressed latent instead, DeepSeek's memory saving, is not done here);
- the router: sigmoid scores in fp32; the per-expert ``e_score_correction_bias`` (our
  ``router.expert_bias``, the aux-loss-free balancing bias) added for the selection only;
  group-limited top-k (the ``n_group`` groups scored by the sum of their two best biased scores,
  the best ``topk_group`` kept); combine weights the unbiased scores at the chosen experts,
  renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``;
- shared experts (one SwiGLU of ``moe_ffn_hidden_size · num_shared_experts``) and dense first
  layers (``model.dense_layers``, HF's ``first_k_dense_replace``), both as in Qwen3-MoE's decoder.

The routed experts are the shared `GroupedExperts` (FP4 MoEResQ GEMMs, expert parallel, both
dispatchers); the router stays in fp32. At the batch/exact levels every op goes through the level's
kernels (`fp4/invariant.py`): the low-rank projections' tiled/exact GEMMs, their row-local norms,
the blocked/tree attention with its own scale and value dim, the sigmoid by ``exp``, row sums.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fp4.fp4 import Recipe, invariant
from megatron_fp4.model.decoder import DecoderLayer
from megatron_fp4.model.gpt_oss import sigmoid, yarn_inv_freq
from megatron_fp4.model.layers import (Attention, LayerCache, RMSNorm, SwiGLU, _linear, apply_rope, refuse_cp_extras,
                                       with_cache)
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.model.packing import refuse_packed
from megatron_fp4.model.router import Router, replay_topk, router_logits
from megatron_fp4.model.specs import attention_recipe, expert_recipe

LORA_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default eps, which HF's q_a_layernorm / kv_a_layernorm use


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude term (HF ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables_fp32(positions: torch.Tensor, dim: int, theta: float, scaling: Optional[dict], dtype: torch.dtype):
    """cos/sin [B, T, dim] (rotate-half layout) computed in fp32 as HF's rotary does, cast to dtype:
    plain RoPE (`scaling` None) or YaRN, whose cos/sin carry the attention factor
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given (HF
    ``_compute_yarn_parameters``; DeepSeek-V3's 1.0 / 1.0 make it 1)."""
    if scaling is None:
        inv_freq, factor = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device)
                                           .to(torch.float32) / dim)), 1.0
    else:
        inv_freq, factor = yarn_inv_freq(dim, theta, scaling, positions.device)
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            factor = yarn_mscale(scaling["factor"], scaling["mscale"]) / yarn_mscale(scaling["factor"],
                                                                                     scaling["mscale_all_dim"])
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with pairs (2i, 2i+1) -> the even entries then the odd ones (HF's
    ``apply_rotary_pos_emb_interleave`` reorders so before its rotate-half RoPE)."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


class MLAttention(Attention):
    """Multi-head latent attention (a subclass of `Attention` so selective recompute's "attention"
    covers it). Every projection is an FP4 MoEResQ linear under ``fp4.scope: experts+attention``."""

    def __init__(self, cfg, recipe: Optional[Recipe]):
        nn.Module.__init__(self)
        H, hidden = cfg.num_heads, cfg.hidden_size
        self.num_heads = self.num_kv_heads = H
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.head_dim = self.nope_dim + self.rope_dim
        self.kv_lora_rank, self.q_lora_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling
        self.scale = self.qk_dim ** -0.5
        if self.rope_scaling and self.rope_scaling.get("mscale_all_dim"):  # YaRN's softmax correction (HF)
            self.scale *= yarn_mscale(self.rope_scaling["factor"], self.rope_scaling["mscale_all_dim"]) ** 2
        if self.q_lora_rank:
            self.q_a_proj = _linear(hidden, self.q_lora_rank, recipe)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = _linear(self.q_lora_rank, H * self.qk_dim, recipe)
        else:
            self.q_proj = _linear(hidden, H * self.qk_dim, recipe)
        self.kv_a_proj_with_mqa = _linear(hidden, self.kv_lora_rank + self.rope_dim, recipe)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = _linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), recipe)
        self.o_proj = _linear(H * self.v_dim, hidden, recipe)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """As `Attention.forward`: x [B, T, hidden]; positions [B, T]; attention_mask [B, T_total]."""
        refuse_packed(attention_mask, "deepseek_v3")
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_pass, q_rot = q.view(B, T, H, self.qk_dim).transpose(1, 2).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_a, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_a)).view(B, T, H, self.nope_dim + self.v_dim).transpose(1, 2)
        k_pass, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        cos, sin = rope_tables_fp32(positions, self.rope_dim, self.rope_theta, self.rope_scaling, q.dtype)
        q_rot = apply_rope(deinterleave(q_rot), cos, sin)
        k_rot = apply_rope(deinterleave(k_rot.view(B, 1, T, self.rope_dim)), cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        if self.kv_gather is not None:  # context parallel: the whole sequence's keys and values, by position
            refuse_cp_extras(cache, attention_mask)
            # one gather of the per-head [k_pass | v] and the shared rotary part (not expanded over the heads)
            kv_all, k_rot = self.kv_gather(torch.cat((k_pass, v), dim=-1), k_rot)
            k_pass, v = kv_all.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_pass, k_rot.expand(B, H, k_pass.shape[2], self.rope_dim)), dim=-1)
        k, v, past = with_cache(cache, k, v)  # the full per-head keys and values (not the latent)
        if invariant.enabled(self.numerics, q):  # keys by position, fixed blocks / trees (values of their own dim)
            out = invariant.attention(q, k, v, positions, invariant.leading_pad(attention_mask, B, x.device),
                                      self.numerics, scale=self.scale)
        elif self.kv_gather is not None:  # context parallel: queries at their global positions
            mask = torch.arange(k.shape[2], device=x.device) <= positions[:, None, :, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        elif attention_mask is None and past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            T_total = k.shape[2]
            q_idx = torch.arange(past, past + T, device=x.device)[:, None]
            mask = (torch.arange(T_total, device=x.device)[None, :] <= q_idx)[None, None]
            if attention_mask is not None:
                mask = mask & attention_mask[:, None, None, :T_total].bool()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out = torch.nan_to_num(out, nan=0.0)  # a fully masked (padding) query row; never read
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.v_dim))


def group_limited_topk(choice: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """Expert ids [T, top_k] of the selection scores `choice` [T, E] restricted to the `topk_group`
    best of `n_group` equal groups, a group scored by the sum of its two best scores (HF's
    ``DeepseekV3MoE.route_tokens_to_experts``)."""
    T, E = choice.shape
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    keep = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return torch.topk(choice.masked_fill(~keep, float("-inf")), k=top_k, dim=-1).indices


def _row_sum(t: torch.Tensor, numerics) -> torch.Tensor:
    """``t.sum(-1, keepdim=True)``; the level's row-invariant sum at batch/exact."""
    return invariant.last_dim_sum(t, numerics) if invariant.enabled(numerics, t) else t.sum(dim=-1, keepdim=True)


class DeepseekV3Router(Router):
    """Sigmoid scores, group-limited top-k of ``scores + expert_bias``, combine weights from the
    unbiased scores (renormalised when `norm_topk_prob`) times `routed_scaling_factor`. The bias is
    always there (HF's ``e_score_correction_bias``, loaded with the weights); with
    ``model.moe_router_bias_update_rate`` > 0 aux-loss-free balancing moves it after each step.
    ``probs`` (for the auxiliary losses only): the scores normalised over the experts."""

    def __init__(self, cfg):
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, expert_bias=True)
        self.n_group, self.topk_group = cfg.moe_n_group, cfg.moe_topk_group
        self.routed_scaling_factor = cfg.moe_routed_scaling_factor

    def forward(self, x: torch.Tensor, replay: Optional[torch.Tensor] = None):
        nx = self.numerics
        logits = router_logits(x, self.weight, nx)
        scores = sigmoid(logits, nx)
        topk_idx = group_limited_topk(scores + self.expert_bias.to(scores.dtype), self.top_k, self.n_group,
                                      self.topk_group)
        topk_w = scores.gather(1, topk_idx)
        if replay is not None:  # router replay: the replayed ids' own scores (validated as for Qwen3-MoE)
            topk_idx, topk_w = replay_topk(scores, topk_idx, topk_w, replay, self.num_experts)
        if self.norm_topk_prob:
            topk_w = topk_w / (_row_sum(topk_w, nx) + 1e-20)
        probs = scores / _row_sum(scores, nx)
        return logits, probs, topk_idx, topk_w * self.routed_scaling_factor


class DeepseekV3MoE(MoELayer):
    """`MoELayer` (grouped FP4 experts, shared experts, capacity, aux-loss-free bias update) with
    the DeepSeek-V3 router."""

    def __init__(self, cfg, recipe: Recipe):
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_ffn_hidden_size, recipe,
                         cfg.norm_topk_prob, cfg.router_aux_loss_coef, cfg.router_z_loss_coef,
                         cfg.num_shared_experts, cfg.shared_expert_ffn_hidden_size, cfg.moe_router_bias_update_rate,
                         cfg.moe_aux_loss_type, capacity_factor=cfg.moe_capacity_factor,
                         drop_policy=cfg.moe_token_drop_policy)
        self.router = DeepseekV3Router(cfg)


class DeepseekV3DecoderLayer(DecoderLayer):
    """RMSNorm → MLA → RMSNorm → DeepSeek-V3 MoE (or a dense SwiGLU in `model.dense_layers`)."""

    def __init__(self, cfg, fp4_cfg, layer_idx: int):
        nn.Module.__init__(self)
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = MLAttention(cfg, attention_recipe(fp4_cfg))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = layer_idx not in cfg.dense_layers
        recipe = expert_recipe(fp4_cfg)
        self.mlp = DeepseekV3MoE(cfg, recipe or Recipe(mode="bf16")) if self.is_moe else \
            SwiGLU(cfg.hidden_size, cfg.dense_ffn_hidden_size, recipe)

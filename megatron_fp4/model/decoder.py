"""The Qwen3-MoE decoder layer: RMSNorm → GQA attention with q/k-norm → RMSNorm → MoE or dense
SwiGLU, each with a residual. Moved from `model/transformer.py`, which re-exports it; other families'
layers (`model/gpt_oss.py`) keep its forward and replace the modules it calls.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.layers import Attention, LayerCache, RMSNorm, SwiGLU
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.model.specs import attention_recipe, expert_recipe


class DecoderLayer(nn.Module):
    def __init__(self, cfg, fp4_cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps,
                                   cfg.rope_theta, attention_recipe(fp4_cfg))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = layer_idx not in cfg.dense_layers
        recipe = expert_recipe(fp4_cfg)
        if self.is_moe:
            self.mlp = MoELayer(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_ffn_hidden_size,
                                recipe or Recipe(mode="bf16"), cfg.norm_topk_prob, cfg.router_aux_loss_coef,
                                cfg.router_z_loss_coef, cfg.num_shared_experts, cfg.shared_expert_ffn_hidden_size,
                                cfg.moe_router_bias_update_rate, cfg.moe_aux_loss_type,
                                capacity_factor=cfg.moe_capacity_factor, drop_policy=cfg.moe_token_drop_policy)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.dense_ffn_hidden_size, recipe)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[LayerCache] = None, routing_out: Optional[list] = None,
                routing_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        past = cache.length if cache is not None else 0
        h = h + self.self_attn(self.input_layernorm(h), positions, attention_mask, cache)
        x = self.post_attention_layernorm(h)
        if self.is_moe:  # the MoE auxiliary losses count only the real tokens of this step
            valid = None if attention_mask is None else attention_mask[:, past:past + h.shape[1]] != 0  # packed: ids
            return h + self.mlp(x, routing_out, routing_in, valid)
        if routing_out is not None:
            routing_out.append(None)
        return h + self.mlp(x)

"""DeepSeek-V3's attention in the plugin: the trainer's multi-head latent attention (`model.deepseek_v3.
MLAttention`) over vLLM's standard (non-MLA) paged KV cache.

vLLM builds DeepSeek-V3's layers with its MLA attention (`DeepseekV2MLAAttention`: the latent cache,
the CPU_MLA backend) whenever `ModelConfig.use_mla` is true, which it is for every ``deepseek_v3``
config unless the environment sets ``VLLM_MLA_DISABLE=1``; then it builds `DeepseekV2Attention`:
the same projections (``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj``, ``kv_a_proj_with_mqa`` →
``kv_a_layernorm`` → ``kv_b_proj``, ``o_proj``: the plugin's linear method, quant.py), the per-head
keys [qk_nope + qk_rope] and values (zero-padded to the key width) in a plain `Attention` layer's
paged cache, the same order of operations as the trainer's `MLAttention.forward`. The plugin then
replaces what vLLM computes unlike the trainer, per layer (`serve_trainer_mla`):

- `TrainerMLARotary` for ``rotary_emb``: the trainer's RoPE of the decoupled rotary part (HF's
  interleaved pairs de-interleaved, then rotate-half RoPE with the fp32 tables of
  `deepseek_v3.rope_tables_fp32`, YaRN included), which leaves the rotary part in the trainer's
  (de-interleaved) order: the keys' dot products then sum in the trainer's order;
- the low-rank norms' eps: 1e-6, HF's and the trainer's (vLLM uses ``rms_norm_eps``);
- `TrainerMLAImpl` for the attention layer's ``impl``: the trainer's attention (`invariant.attention`
  at the batch-invariant levels, ``F.scaled_dot_product_attention`` at the standard one) with the
  trainer's softmax scale (YaRN's ``mscale²`` included) and values of their own width
  ``v_head_dim``, the requests with the same number of queries in one call over their keys gathered
  from their block tables, by position (`attention.grouped_qkv`).

The cache holds the expanded per-head keys and values, as the trainer's own KV cache does
(`MLAttention`): the latent cache, DeepSeek's memory saving, is vLLM's MLA path, which the plugin
does not serve.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fp4.fp4 import invariant
from megatron_fp4.integrations.vllm.attention import OpaqueRotary, TrainerAttentionImpl
from megatron_fp4.model.deepseek_v3 import LORA_NORM_EPS, MLAttention, deinterleave, rope_tables_fp32
from megatron_fp4.model.layers import apply_rope

MLA_DISABLE_HINT = ("set VLLM_MLA_DISABLE=1 in the environment of the process that builds the engine (vLLM then builds "
                    "DeepseekV2Attention over its standard paged cache, whose attention the plugin replaces by the "
                    "trainer's)")


class TrainerMLARotary(OpaqueRotary):
    """vLLM's ``rotary_emb(positions, q_pe [T, H, r], k_pe [T, 1, r])`` as the trainer's MLA RoPE:
    de-interleave, rotate-half RoPE with fp32 tables (plain or YaRN). Elementwise per token."""

    def __init__(self, rope_dim: int, theta: float, scaling: Optional[dict]):
        super().__init__()
        self.rope_dim, self.theta, self.scaling = int(rope_dim), float(theta), scaling
        self.mfp4_key = None  # set by `opaque.make_layers_opaque`: one op under vLLM's torch.compile

    def _forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = rope_tables_fp32(positions.reshape(1, -1), self.rope_dim, self.theta, self.scaling, q.dtype)

        def rotate(x):  # [T, heads, r] -> the trainer's [1, heads, T, r] and back, contiguous (the opaque
            # op's shape function promises a dense output: inductor reads it so)
            return apply_rope(deinterleave(x.transpose(0, 1)[None]), cos, sin)[0].transpose(0, 1).contiguous()

        return rotate(q), rotate(k)


class TrainerMLAImpl(TrainerAttentionImpl):
    """`TrainerAttentionImpl` for MLA's heads: keys [qk_dim], values [v_dim] (vLLM hands them padded
    to qk_dim and reads the first v_dim of each head's output), the trainer's ``scale``."""

    def __init__(self, num_heads: int, qk_dim: int, v_dim: int, scale: float, numerics):
        super().__init__(num_heads, num_heads, qk_dim, qk_dim ** -0.5, numerics)
        self.v_dim, self.scale = int(v_dim), float(scale)

    def attend(self, q, k, v, positions) -> torch.Tensor:
        pad = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
        if invariant.enabled(self.numerics, q):
            return invariant.attention(q, k, v, positions, pad, self.numerics, scale=self.scale)
        # the trainer's standard path (its cached decode: SDPA under a causal mask, keys by index = position)
        mask = torch.arange(k.shape[2], device=q.device)[None, None, :] <= positions[:, :, None]  # [B, n, Tk]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=self.scale)


def serve_trainer_mla(attn: nn.Module, cfg, numerics, prefix: str) -> None:
    """Make vLLM's `DeepseekV2Attention` ``attn`` (one decoder layer's) compute the trainer's MLA of
    our `ModelConfig` ``cfg`` (module docstring)."""
    if type(attn).__name__ != "DeepseekV2Attention":
        raise ValueError(f"megatron_fp4: {prefix} is vLLM's {type(attn).__name__}, not DeepseekV2Attention (the "
                         f"non-MLA path the plugin serves DeepSeek-V3 on): {MLA_DISABLE_HINT}")
    with torch.device("meta"):
        ref = MLAttention(cfg, None)  # the trainer's dims, scale and RoPE parameters (no weights)
    if (attn.num_local_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim) != \
            (ref.num_heads, ref.nope_dim, ref.rope_dim, ref.v_dim):
        raise ValueError(f"megatron_fp4: {prefix} has (heads, qk_nope, qk_rope, v) = ({attn.num_local_heads}, "
                         f"{attn.qk_nope_head_dim}, {attn.qk_rope_head_dim}, {attn.v_head_dim}), the trainer's "
                         f"({ref.num_heads}, {ref.nope_dim}, {ref.rope_dim}, {ref.v_dim}): the plugin serves one "
                         f"process (tensor_parallel_size=1)")
    for norm in (getattr(attn, "q_a_layernorm", None), attn.kv_a_layernorm):
        if norm is not None:
            norm.variance_epsilon = LORA_NORM_EPS
    attn.rotary_emb = TrainerMLARotary(ref.rope_dim, ref.rope_theta, ref.rope_scaling)
    attn.attn.impl = TrainerMLAImpl(ref.num_heads, ref.qk_dim, ref.v_dim, ref.scale, numerics)
    attn.forward = _mla_forward.__get__(attn)


def _mla_forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, llama_4_scaling=None) -> torch.Tensor:
    """vLLM's `DeepseekV2Attention.forward` without its in-place writes (q and k built by `torch.cat`),
    in the trainer's `MLAttention.forward` order."""
    if llama_4_scaling is not None:
        raise ValueError("megatron_fp4: llama-4 attention scaling is not the trainer's DeepSeek-V3")
    T, H, nope, rope, v_dim = hidden_states.shape[0], self.num_local_heads, self.qk_nope_head_dim, \
        self.qk_rope_head_dim, self.v_head_dim
    if self.q_lora_rank is not None:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)[0]))[0]
    else:
        q = self.q_proj(hidden_states)[0]
    q_nope, q_pe = q.view(T, H, nope + rope).split([nope, rope], dim=-1)
    kv_a, k_pe = self.kv_a_proj_with_mqa(hidden_states)[0].split([self.kv_lora_rank, rope], dim=-1)
    kv = self.kv_b_proj(self.kv_a_layernorm(kv_a))[0].view(T, H, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.reshape(T, 1, rope))
    q = torch.cat((q_nope, q_pe), dim=-1)
    k = torch.cat((k_nope, k_pe.expand(T, H, rope)), dim=-1)
    v = F.pad(v, [0, nope + rope - v_dim])  # the standard cache's width; the impl reads the first v_dim
    out = self.attn(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))
    return self.o_proj(out.view(T, H, nope + rope)[..., :v_dim].reshape(T, H * v_dim))[0]

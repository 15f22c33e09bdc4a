"""The GPT-OSS family's layers (HF ``GptOssForCausalLM``), on the shared decoder of `transformer.py`.

What differs from Qwen3-MoE, each as transformers 5.10 computes it:

- attention: q/k/v/o biases, no q/k-norm, a learned per-head *sink* logit that joins every
  softmax row and is dropped after it (probability mass sent nowhere), layers alternating between
  a sliding window (a query sees its last ``sliding_window`` keys) and full causal attention;
- YaRN RoPE: the inverse frequencies blended between interpolation and extrapolation, cos/sin
  scaled by the attention factor, computed in fp32 as HF does (also in an fp64 model, so its
  verification mode compares with HF's fp64 forward);
- the router: a linear with bias, top-k over the logits, softmax over the selected logits;
- the experts: biases on both GEMMs and the clamped SwiGLU ``(clamp(up, ±limit) + 1) ·
  g·σ(alpha·g)`` with ``g = min(gate, limit)``, alpha 1.702, limit 7.0. Our w13 keeps gate rows
  then up rows (HF interleaves them; `integrations/hf/gpt_oss.py` converts).

Every GEMM is still an FP4 MoEResQ linear where the FP4 scope says so (experts; attention with
``experts+attention``); the router stays in fp32. At the batch/exact levels every op goes through
the level's kernels (`fp4/invariant.py`): biased tiled/exact GEMMs, the blocked/tree attention
with the sliding window and the sinks, row-local softmaxes, the sigmoid by ``exp``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from megatron_fp4.fp4 import MoEResQLinear, Recipe, invariant, moeresq_linear
from megatron_fp4.model.decoder import DecoderLayer
from megatron_fp4.model.experts import GroupedExperts
from megatron_fp4.model.layers import Attention, LayerCache, Linear, RMSNorm, refuse_cp_extras, upcast, with_cache
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.model.packing import refuse_packed
from megatron_fp4.model.router import Router, replay_topk
from megatron_fp4.model.specs import attention_recipe, expert_recipe

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # GptOssExperts' constants (transformers 5.10)


# -- YaRN rotary embeddings ---------------------------------------------------------------------
def yarn_inv_freq(head_dim: int, theta: float, scaling: Optional[dict], device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] in fp32, attention factor) of plain RoPE (`scaling` None)
    or YaRN, as ``transformers.modeling_rope_utils._compute_yarn_parameters`` computes them."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).to(torch.float32) / head_dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations):
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def rope_half_tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype):
    """cos/sin [B, T, head_dim/2] for positions [B, T], in fp32 (HF's rotary runs in fp32), cast to dtype."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return (freqs.cos() * attention_factor).to(dtype), (freqs.sin() * attention_factor).to(dtype)


def apply_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by halves (HF GPT-OSS's ``_apply_rotary_emb``); cos/sin [B, T, D/2]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


# -- attention ----------------------------------------------------------------------------------
def _biased_linear(in_f: int, out_f: int, recipe: Optional[Recipe]) -> nn.Module:
    return Linear(in_f, out_f, bias=True) if recipe is None else MoEResQLinear(in_f, out_f, bias=True, recipe=recipe)


class GptOssAttention(Attention):
    """GQA attention with biases, per-head sinks, an optional sliding window and YaRN RoPE (a
    subclass of `Attention` so selective recompute's "attention" covers it)."""

    def __init__(self, cfg, recipe: Optional[Recipe], layer_idx: int):
        nn.Module.__init__(self)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        hidden, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = _biased_linear(hidden, q_dim, recipe)
        self.k_proj = _biased_linear(hidden, kv_dim, recipe)
        self.v_proj = _biased_linear(hidden, kv_dim, recipe)
        self.o_proj = _biased_linear(q_dim, hidden, recipe)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        kind = cfg.layer_types[layer_idx] if cfg.layer_types else "full_attention"
        self.sliding_window = cfg.sliding_window if kind == "sliding_attention" else 0

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """As `Attention.forward`: x [B, T, H]; positions [B, T]; attention_mask [B, T_total]."""
        refuse_packed(attention_mask, "gpt_oss")
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        inv_freq, factor = yarn_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, x.device)
        cos, sin = rope_half_tables(positions, inv_freq, factor, q.dtype)
        q, k = apply_half_rope(q, cos, sin), apply_half_rope(k, cos, sin)
        if self.kv_gather is not None:  # context parallel: the whole sequence's keys, queries at their positions
            refuse_cp_extras(cache, attention_mask)
            k, v = self.kv_gather(k, v)
        k, v, past = with_cache(cache, k, v)
        if invariant.enabled(self.numerics, q):  # keys by position, fixed blocks / trees, the sink a logit of its own
            out = invariant.attention(q, k, v, positions, invariant.leading_pad(attention_mask, B, x.device),
                                      self.numerics, scale=self.head_dim ** -0.5, window=self.sliding_window,
                                      sinks=self.sinks)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        T_total = k.shape[2]
        if self.kv_gather is not None:  # [B, 1, T, 1]: each query's global position
            q_idx = positions[:, None, :, None]
        else:
            q_idx = torch.arange(past, past + T, device=x.device)[None, None, :, None]
        k_idx = torch.arange(T_total, device=x.device)
        visible = k_idx <= q_idx
        if self.sliding_window:
            visible = visible & (k_idx > q_idx - self.sliding_window)
        if attention_mask is not None:
            visible = visible & attention_mask[:, None, None, :T_total].bool()
        out = sink_attention(q, k, v, visible, self.sinks, self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """GPT-OSS's attention at the standard level (HF's eager order): q [B, H, T, D], k/v [B, KV, Tk, D],
    ``visible`` [B|1, 1, T, Tk] (causal, window, padding), ``sinks`` [H]; returns [B, H, T, D]. The
    sink joins each row's softmax and is dropped after it: a padding row (all keys masked) puts all
    its mass on the sink and attends to nothing (zeros, no NaN)."""
    B, H, T, _ = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    logits = torch.cat([scores, sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(B, -1, T, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


# -- router and experts -------------------------------------------------------------------------
class GptOssRouter(Router):
    """Logits ``x·Wᵀ + b`` in fp32, top-k over the logits, softmax over the selected logits (the
    combine weights). ``probs`` (softmax over all experts) feed the auxiliary losses only."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__(hidden, num_experts, top_k, norm_topk_prob=False)
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor, replay: Optional[torch.Tensor] = None):
        nx = self.numerics
        logits = invariant.linear(upcast(x), upcast(self.weight), upcast(self.bias), nx)
        probs = invariant.softmax(logits, nx)
        top_logits, topk_idx = torch.topk(logits, self.top_k, dim=-1)
        if replay is not None:  # router replay: the replayed ids' own logits (validated as for Qwen3-MoE)
            topk_idx, _ = replay_topk(probs, topk_idx, top_logits, replay, self.num_experts)
            top_logits = logits.gather(1, topk_idx)
        return logits, probs, topk_idx, invariant.softmax(top_logits, nx)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, numerics=None) -> torch.Tensor:
    """GPT-OSS's activation, as ``GptOssExperts._apply_gate`` computes it; at a row-invariant level
    the sigmoid as ``1 / (1 + exp(−z))`` (ATen's sigmoid rounds a vector tail differently, see
    `fp4/invariant.py`)."""
    gate = gate.clamp(min=None, max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * sigmoid(gate * SWIGLU_ALPHA, numerics))


def sigmoid(z: torch.Tensor, numerics=None) -> torch.Tensor:
    """``torch.sigmoid``; ``1 / (1 + exp(−z))`` at a row-invariant level (position-independent bits)."""
    return 1 / (1 + torch.exp(-z)) if invariant.enabled(numerics, z) else torch.sigmoid(z)


class GptOssExperts(GroupedExperts):
    """`GroupedExperts` with biases b13 [E, 2F] (gate, then up) and b2 [E, H] and the clamped
    SwiGLU; always the per-expert loop (each expert one MoEResQ linear per GEMM, bias included)."""

    grouped = False

    def __init__(self, num_experts: int, hidden: int, ffn: int, recipe: Recipe, *, expert_offset: int = 0,
                 num_local_experts: Optional[int] = None):
        super().__init__(num_experts, hidden, ffn, recipe, expert_offset=expert_offset,
                         num_local_experts=num_local_experts)
        self.b13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * ffn))
        self.b2 = nn.Parameter(torch.empty(self.num_local_experts, hidden))
        self.b2_cols = None  # expert-tensor parallel: the hidden columns of b2 this rank holds (`shard_ffn`)

    def shard(self, expert_offset: int, num_local_experts: int) -> "GptOssExperts":
        out = super().shard(expert_offset, num_local_experts)
        lo = expert_offset - self.expert_offset
        for name in ("b13", "b2"):
            old, new = getattr(self, name), getattr(out, name)
            if not old.is_meta:
                with torch.no_grad():
                    new.copy_(old[lo:lo + num_local_experts])
            new.requires_grad_(old.requires_grad)
        return out

    def shard_ffn(self, parts: int, index: int, *, shapes_only: bool = False) -> "GptOssExperts":
        """`GroupedExperts.shard_ffn` with the biases: b13 cut with w13's gate and up rows; b2 (w2
        is row-cut, its partial outputs summed over the etp group) cut along the hidden dim, each
        rank adding its columns to its partial output, so the sum holds every column's bias once
        and each rank's b2 gradient is complete for its columns."""
        if self.hidden % parts:
            raise ValueError(f"GptOssExperts.shard_ffn: model.hidden_size={self.hidden} is not a multiple of "
                             f"parallel.etp={parts} (the expert output bias b2 is cut along it)")
        base = super().shard_ffn(parts, index, shapes_only=shapes_only)  # w13/w2 cut, a GroupedExperts
        with torch.device(self.w13.device):
            out = GptOssExperts(self.num_global_experts, self.hidden, base.ffn, self.recipe,
                                expert_offset=self.expert_offset, num_local_experts=self.num_local_experts)
        out.to(self.w13.dtype)
        out.w13, out.w2 = base.w13, base.w2
        cols = torch.arange(index * base.ffn, (index + 1) * base.ffn)
        h = self.hidden // parts
        out.b2_cols = torch.arange(index * h, (index + 1) * h)
        for name, index_ in (("b13", torch.cat([cols, cols + self.ffn])), ("b2", out.b2_cols)):
            old = getattr(self, name)
            new = nn.Parameter(old.detach().index_select(1, index_.to(old.device)).clone(),
                               requires_grad=old.requires_grad)
            new.__dict__.update(old.__dict__)
            new.etp_shard = (1, index_)
            setattr(out, name, new)
        out.quant_name, out.numerics = self.quant_name, self.numerics
        return out

    def expert_forward(self, e: int, x: torch.Tensor, w13: Optional[torch.Tensor] = None,
                       w2: Optional[torch.Tensor] = None, segments: Optional[list[int]] = None) -> torch.Tensor:
        name = f"{self.quant_name}.{self.expert_offset + e}"
        w13 = self.w13[e] if w13 is None else w13
        w2 = self.w2[e] if w2 is None else w2
        nx = self.numerics
        h = moeresq_linear(x, w13, self.b13[e], recipe=self.recipe, name=name + ".w13", segments=segments,
                           numerics=nx, cut=self.w13_cut)
        gate, up = h.split(self.ffn, dim=-1)
        b2 = self.b2[e]
        if self.b2_cols is not None:  # etp: this rank's columns of the bias, the others' added by them
            b2 = b2.new_zeros(self.hidden).index_copy(0, self.b2_cols.to(b2.device), b2)
        return moeresq_linear(clamped_swiglu(gate, up, nx), w2, b2, recipe=self.recipe, name=name + ".w2",
                              segments=segments, numerics=nx, cut=self.w2_cut)

    def _forward_local(self, x_sorted: torch.Tensor, counts: list[int], segments=None) -> torch.Tensor:
        if not x_sorted.shape[0]:  # no tokens: keep every parameter in the graph (zero gradients)
            return x_sorted.new_zeros(0, self.hidden) + 0 * sum(p.sum() for p in (self.w13, self.w2, self.b13, self.b2))
        return super()._forward_local(x_sorted, counts, segments)


class GptOssMoE(MoELayer):
    """`MoELayer` with the GPT-OSS router and experts (no shared expert, no capacity, no expert bias)."""

    def __init__(self, cfg, recipe: Recipe):
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_ffn_hidden_size, recipe,
                         norm_topk_prob=False, aux_loss_coef=cfg.router_aux_loss_coef,
                         z_loss_coef=cfg.router_z_loss_coef, aux_loss_type=cfg.moe_aux_loss_type)
        self.router = GptOssRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k)
        self.experts = GptOssExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size, recipe)


class GptOssDecoderLayer(DecoderLayer):
    """RMSNorm → GPT-OSS attention → RMSNorm → GPT-OSS MoE (every layer), `DecoderLayer`'s forward."""

    def __init__(self, cfg, fp4_cfg, layer_idx: int):
        nn.Module.__init__(self)
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = GptOssAttention(cfg, attention_recipe(fp4_cfg), layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = True
        self.mlp = GptOssMoE(cfg, expert_recipe(fp4_cfg) or Recipe(mode="bf16"))

"""Decoder building blocks of the Qwen3-MoE family: RMSNorm, RoPE, GQA attention with q/k-norm,
SwiGLU MLP. Knows nothing about parallelism; FP4 enters only through `MoEResQLinear`.

Every module that computes numerics has a ``numerics`` attribute (``fp4.Numerics``: the standard,
unchangeable ``STANDARD`` until the model gives all its modules its own with ``apply_numerics``)
and passes it to the ``invariant`` ops explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fp4.fp4 import STANDARD, MoEResQLinear, Recipe, invariant, tiled
from megatron_fp4.fp4.grad_fusion import claim_fused, fused_grad_of
from megatron_fp4.fp4.tiled import same_values, stamp
from megatron_fp4.model.packing import SequenceLayout, is_packed
# The precision of norms, router, loss and optimizer masters is the FP4 GEMMs' accumulation dtype:
# fp32, or fp64 for an fp64 model (``dtype: fp64``, the verification mode). One definition, in fp4.
from megatron_fp4.fp4.moeresq import _accumulate_dtype as wide_dtype


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`wide_dtype` (never narrows an fp64 tensor to fp32)."""
    return x.to(wide_dtype(x.dtype))


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as HF Qwen3 does) and cast back to the input dtype."""

    numerics = STANDARD

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = upcast(x)
        x = x * torch.rsqrt(invariant.mean_square(x, self.numerics) + self.eps)
        return self.weight * x.to(dtype)


class Embedding(nn.Embedding):
    """``nn.Embedding`` (the same module, parameter and hooks) whose weight gradient, in the plain
    case (no padding_idx, max_norm, scale_grad_by_freq or sparse gradient), goes straight into the
    optimizer's zeroed gradient buffer where it grants the claim (`fp4/grad_fusion.py`): ATen's
    backward builds a zeroed vocab-sized gradient that autograd then adds into that buffer (a fill
    and an add of the whole [vocab, hidden] matrix a step for a few hundred rows, issue 37).
    ``fuse_weight_grad`` False (tied embeddings: the LM head's tiled GEMM claims the shared buffer,
    which a second use would refuse to both): the ordinary path, as ``nn.Embedding``."""

    fuse_weight_grad = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if (self.fuse_weight_grad and torch.is_grad_enabled() and self.weight.requires_grad and self.padding_idx is None
                and self.max_norm is None and not self.scale_grad_by_freq and not self.sparse):
            return _Embedding.apply(tokens, self.weight)
        return super().forward(tokens)


class _Embedding(torch.autograd.Function):
    """``F.embedding(tokens, weight)``; backward ``index_add_`` of the rows' gradients in token
    order, into the claimed buffer or into zeros — ATen's CPU ``embedding_dense_backward`` adds
    them in that order into zeros, and autograd's accumulation into the zeroed buffer adds that to
    0 (the same bits either way: ``0 + g_first + ...``)."""

    @staticmethod
    def forward(ctx, tokens, weight):
        ctx.save_for_backward(tokens)
        ctx.weight_shape = weight.shape
        ctx.fused = fused_grad_of(weight, ctx.needs_input_grad[1])
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, dy):
        (tokens,) = ctx.saved_tensors
        rows, grads = tokens.reshape(-1), dy.reshape(-1, dy.shape[-1])
        dest = claim_fused(ctx)
        if dest is not None:
            dest.index_add_(0, rows, grads)
            return None, None
        if not ctx.needs_input_grad[1]:
            return None, None
        return None, grads.new_zeros(ctx.weight_shape).index_add_(0, rows, grads)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin for integer positions [..., T] -> [..., T, head_dim] (HF's rotate_half layout)."""
    wide = wide_dtype(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).to(wide) / head_dim))
    freqs = positions.to(wide)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


_last_rope: tuple = ()  # (stamp of the positions, head_dim, theta, dtype, (cos, sin)) of the last call


def layer_rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """:func:`rope_cos_sin`, the last answer kept: every layer of a forward (and of a decode step)
    asks with the same positions tensor, so the layers after the first get the first one's tables
    (the same values: the same function of the same positions) while the positions hold the values
    they were built from (``tiled.same_values``: the same object unwritten, or equal values). The
    tables carry no autograd history (positions are integers). Only read."""
    global _last_rope
    last = _last_rope
    if last and last[1:4] == (head_dim, theta, dtype) and same_values(last[0], positions):
        return last[4]
    tables = rope_cos_sin(positions, head_dim, theta, dtype)
    _last_rope = (stamp(positions), head_dim, theta, dtype, tables)
    return tables


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos/sin: [B, T, D]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


@dataclass
class LayerCache:
    """Per-layer KV cache of one generation batch: keys/values [B, kv_heads, T_cached, D].

    With ``capacity`` > 0 the cache is static: the first `append` allocates [B, kv_heads,
    capacity, D] buffers and every later one writes its keys in place and returns views of the
    filled prefix (no per-step reallocation and copy of the whole cache). Attention reads the same
    values either way. ``capacity`` 0 grows the tensors by concatenation."""

    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    capacity: int = 0
    filled: int = 0
    blocked: Any = None  # at the batch level: the keys and values by key index (`fp4.tiled.cache_blocks`)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        if not self.capacity:
            self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
            self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
            return self.k, self.v
        end = self.filled + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache of capacity {self.capacity} cannot take {end} positions; build it with "
                             "KVCache.empty(num_layers, capacity=prompt length + max new tokens)")
        if self.k is None:
            B, H, _, D = k.shape
            self.k = k.new_empty(B, H, self.capacity, D)
            self.v = v.new_empty(B, H, self.capacity, v.shape[-1])  # v's dim may differ (DeepSeek-V3 MLA)
        self.k[:, :, self.filled:end] = k
        self.v[:, :, self.filled:end] = v
        self.filled = end
        return self.k[:, :, :end], self.v[:, :, :end]

    @property
    def length(self) -> int:
        if self.capacity:
            return self.filled
        return 0 if self.k is None else self.k.shape[2]


@dataclass
class KVCache:
    layers: list = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int, capacity: int = 0) -> "KVCache":
        """An empty cache; ``capacity`` > 0: static, preallocated for that many positions (`LayerCache`)."""
        return cls([LayerCache(capacity=capacity) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


def with_cache(cache: Optional[LayerCache], k: torch.Tensor, v: torch.Tensor):
    """(keys, values, cached length before them): `k`/`v` appended to `cache` (None: as they are)."""
    if cache is None:
        return k, v, 0
    past = cache.length
    return (*cache.append(k, v), past)


class Linear(nn.Linear):
    """``nn.Linear`` that is batch invariant at a row-invariant ``numerics.invariance`` level (same state dict)."""

    numerics = STANDARD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.linear(x, self.weight, self.bias, self.numerics)


def _linear(in_f: int, out_f: int, recipe: Optional[Recipe]) -> nn.Module:
    """An FP4 MoEResQ linear when a recipe is given, a plain bias-free linear otherwise."""
    if recipe is None:
        return Linear(in_f, out_f, bias=False)
    return MoEResQLinear(in_f, out_f, bias=False, recipe=recipe)


def refuse_cp_extras(cache: Optional[LayerCache], attention_mask: Optional[torch.Tensor]) -> None:
    """Context-parallel attention (a `kv_gather` set) runs whole unpadded sequences only."""
    if cache is not None or attention_mask is not None:
        raise ValueError("context-parallel attention (parallel.cp > 1) takes neither a KV cache nor a padding "
                         "mask: generate and score padded batches with a model built without cp")


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (Qwen3), rotary positions.

    `kv_gather` (None, or set by `parallel/context.py`): context parallelism's hook, ``(k, v) ->
    (k, v)`` of the whole sequence in position order; the queries then sit at their global
    `positions` and attend to the keys at positions <= theirs."""

    numerics = STANDARD
    kv_gather = None

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 rope_theta: float, recipe: Optional[Recipe] = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.q_proj = _linear(hidden, num_heads * head_dim, recipe)
        self.k_proj = _linear(hidden, num_kv_heads * head_dim, recipe)
        self.v_proj = _linear(hidden, num_kv_heads * head_dim, recipe)
        self.o_proj = _linear(num_heads * head_dim, hidden, recipe)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """x [B, T, H]; positions [B, T]; attention_mask [B, T_total] (1 = real token, 0 = padding)
        covering cached + new tokens, or packed rows (values > 1: `model/packing.py`; positions then
        restart with each sequence); cache is appended to in place."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # Without autograd (rollout, scoring) the layers share the last tables (`layer_rope_cos_sin`);
        # under autograd each layer's graph saves its own, as the activation plan counts them
        # (`training/memory_activations.py`). The same values either way.
        rope = rope_cos_sin if torch.is_grad_enabled() else layer_rope_cos_sin
        cos, sin = rope(positions, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if (cache is None or cache.length == 0) and is_packed(attention_mask):  # decode steps skip the check (a sync)
            if cache is not None or self.kv_gather is not None:
                raise ValueError("packed sequences (an attention_mask with values > 1) are for full-sequence "
                                 "forwards: not with a KV cache nor context parallelism (parallel.cp > 1); set "
                                 "rl.max_tokens_per_micro_batch=0 for padded micro-batches there")
            out = self._packed_attention(q, k, v, SequenceLayout.of(attention_mask))
            return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))
        if self.kv_gather is not None:
            refuse_cp_extras(cache, attention_mask)
            k, v = self.kv_gather(k, v)
        k_new, v_new = k, v
        k, v, past = with_cache(cache, k, v)
        T_total = k.shape[2]
        rep = self.num_heads // self.num_kv_heads
        if invariant.enabled(self.numerics, q):  # keys by position, fixed reduction trees, kv heads shared
            pad = invariant.leading_pad(attention_mask, B, x.device)
            # A static cache at the batch level keeps its keys by key index too: a decode step reads
            # them in place (`tiled.BlockedKV`: the same bits as gathering them from the cache).
            blocks = tiled.cache_blocks(cache, k_new, v_new, pad, past) \
                if cache is not None and invariant.tiled(self.numerics, q) and not torch.is_grad_enabled() else None
            out = invariant.attention(q, k, v, positions, pad, self.numerics, kv_blocks=blocks)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        # Decoding: SDPA maps query heads to their kv head itself (enable_gqa) instead of copying
        # the whole cache rep times per step; each head attends to the same values either way.
        gqa = cache is not None and rep > 1
        if not gqa:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.kv_gather is not None:  # context parallel: queries at their global positions
            mask = torch.arange(T_total, device=x.device) <= positions[:, None, :, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif attention_mask is None and past == 0:
            # Plain causal attention (training, unpadded prefill), as HF passes it: SDPA's flash
            # kernel then skips the key blocks above the diagonal instead of reading an explicit
            # mask over all of them. A masked key adds exactly zero in either form, and the bits
            # were the same, fwd and bwd, on the default, AVX2 and AVX512 CPU kernels (not by
            # construction: tests/unit/test_attention_causal.py checks it on the CPU it runs on).
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            # Causal mask offset by the cached length, combined with the key padding mask.
            q_idx = torch.arange(past, past + T, device=x.device)[:, None]
            k_idx = torch.arange(T_total, device=x.device)[None, :]
            mask = (k_idx <= q_idx)[None, None]
            if attention_mask is not None:
                mask = mask & attention_mask[:, None, None, :T_total].bool()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        # A fully masked row (a padding query) gives NaN in SDPA; zero it, it is never read.
        out = torch.nan_to_num(out, nan=0.0)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def _packed_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          layout: SequenceLayout) -> torch.Tensor:
        """Attention of packed rows (q [B, H, T, D], k/v [B, KV, T, D] -> [B, T, H, D]): each sequence
        unpacked into a row of its own, right-padded (`model/packing.py`), through the padded
        batch's attention at this numerics level, and packed back."""
        out = None
        for group in layout.by_length():  # rows of similar length (a row's result depends on the row alone)
            qs, ks, vs = (group.unpack(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v))  # [N, heads, L, D]
            if invariant.enabled(self.numerics, q):  # keys by position (= slot: no leading padding)
                pad = torch.zeros(qs.shape[0], dtype=torch.long, device=q.device)
                o = invariant.attention(qs, ks, vs, group.positions, pad, self.numerics)
            else:  # right padding only: a real query's keys are all real, SDPA's plain causal kernel
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                   enable_gqa=self.num_heads != self.num_kv_heads)
            out = group.repack(o.transpose(1, 2), out)
        return out


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    numerics = STANDARD

    def __init__(self, hidden: int, ffn: int, recipe: Optional[Recipe] = None):
        super().__init__()
        self.gate_proj = _linear(hidden, ffn, recipe)
        self.up_proj = _linear(hidden, ffn, recipe)
        self.down_proj = _linear(ffn, hidden, recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(invariant.silu(self.gate_proj(x), self.numerics) * self.up_proj(x))

"""GPT-OSS's attention in the plugin: the trainer's `model.gpt_oss.GptOssAttention` over vLLM's paged KV cache.

vLLM builds GPT-OSS's layers with `OAIAttention`: one ``qkv_proj`` and ``o_proj`` (with biases; the
plugin's linear method, quant.py), its YaRN ``rotary_emb`` (NeoX halves), and an `Attention` layer
with the per-head ``sinks`` and, on every other layer, a sliding window. The plugin replaces what
vLLM computes unlike the trainer, per layer (`serve_trainer_gpt_oss_attention`):

- `TrainerYarnRotary` for ``rotary_emb``: the trainer's YaRN RoPE (`gpt_oss.yarn_inv_freq`,
  `rope_half_tables` in fp32 with the attention factor, `apply_half_rope`), elementwise per token;
- `TrainerSinkAttentionImpl` for the attention layer's ``impl``: the trainer's attention with the
  layer's sinks (vLLM's parameter, shared: loads and live updates reach it) and its sliding window
  (the trainer's ``layer_types``; vLLM's per-layer window must be the same, since its KV-cache
  manager frees the blocks a sliding layer no longer reads), every request over its keys gathered
  from its block table by position, the requests with the same number of queries in one call
  (`attention.grouped_qkv`): `invariant.attention` at the row-invariant levels (the same
  bits as the trainer's full forward, ground rule 7), `gpt_oss.sink_attention` (the trainer's
  standard path) at the standard one.

Keys a request's queries cannot see (before the earliest query's window) are read as its first
visible key (`attention.grouped_qkv`): a sliding layer's freed blocks (vLLM's null block) are never
read, and the masked slots are finite, so they weigh exactly 0.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_fp4.fp4 import invariant
from megatron_fp4.integrations.vllm.attention import OpaqueRotary, TrainerAttentionImpl
from megatron_fp4.model.gpt_oss import GptOssAttention, apply_half_rope, rope_half_tables, sink_attention, \
    yarn_inv_freq


class TrainerYarnRotary(OpaqueRotary):
    """vLLM's ``rotary_emb(positions, q [T, H·D], k [T, KV·D])`` as the trainer's GPT-OSS RoPE (YaRN
    or plain, rotate-half by halves, fp32 tables). Elementwise per token."""

    def __init__(self, head_dim: int, theta: float, scaling):
        super().__init__()
        self.head_dim, self.theta, self.scaling = int(head_dim), float(theta), scaling
        self.mfp4_key = None  # set by `opaque.make_layers_opaque`: one op under vLLM's torch.compile

    def _forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        inv_freq, factor = yarn_inv_freq(self.head_dim, self.theta, self.scaling, q.device)
        cos, sin = rope_half_tables(positions.reshape(1, -1), inv_freq, factor, q.dtype)  # [1, T, D/2]

        def rotate(x):  # [T, heads·D] -> the trainer's [1, heads, T, D] and back, dense (the opaque op's promise)
            T = x.shape[0]
            heads = x.reshape(T, -1, self.head_dim).transpose(0, 1)[None]
            return apply_half_rope(heads, cos, sin)[0].transpose(0, 1).reshape(T, -1).contiguous()

        return rotate(q), rotate(k)


class TrainerSinkAttentionImpl(TrainerAttentionImpl):
    """`TrainerAttentionImpl` with GPT-OSS's per-head ``sinks`` [H] and sliding ``window`` (0: full)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sinks: torch.Tensor, window: int,
                 numerics):
        super().__init__(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, numerics)
        self.sinks, self.window = sinks, int(window)

    def attend(self, q, k, v, positions) -> torch.Tensor:
        D = self.head_size
        if invariant.enabled(self.numerics, q):
            return invariant.attention(q, k, v, positions, torch.zeros(q.shape[0], dtype=torch.long, device=q.device),
                                       self.numerics, scale=D ** -0.5, window=self.window, sinks=self.sinks)
        # the trainer's standard path (its cached decode: keys by index = position)
        k_idx = torch.arange(k.shape[2], device=q.device)[None, None, :]
        visible = k_idx <= positions[:, :, None]  # [B, n, Tk]
        if self.window:
            visible = visible & (k_idx > positions[:, :, None] - self.window)
        return sink_attention(q, k, v, visible[:, None], self.sinks, D ** -0.5)


def serve_trainer_gpt_oss_attention(attn: nn.Module, cfg, layer_idx: int, numerics, prefix: str) -> None:
    """Make vLLM's `OAIAttention` ``attn`` (decoder layer ``layer_idx``'s) compute the trainer's
    `GptOssAttention` of our `ModelConfig` ``cfg`` (module docstring)."""
    with torch.device("meta"):
        ref = GptOssAttention(cfg, None, layer_idx)  # the trainer's dims, window and RoPE parameters (no weights)
    heads = (attn.num_local_attention_heads, attn.num_local_key_value_heads, attn.head_dim)
    if heads != (ref.num_heads, ref.num_kv_heads, ref.head_dim):
        raise ValueError(f"megatron_fp4: {prefix} has (heads, kv heads, head_dim) = {heads}, the trainer's "
                         f"{(ref.num_heads, ref.num_kv_heads, ref.head_dim)}: the plugin serves one process "
                         f"(tensor_parallel_size=1)")
    served = attn.attn.sliding_window or 0
    if served != ref.sliding_window:
        raise ValueError(f"megatron_fp4: {prefix} is built by vLLM with sliding window {served or None} but the "
                         f"checkpoint's layer_types give the trainer {ref.sliding_window or None} (vLLM slides every "
                         f"other layer from layer 0): serve a checkpoint whose layer_types alternate "
                         f"sliding/full from layer 0")
    attn.rotary_emb = TrainerYarnRotary(ref.head_dim, ref.rope_theta, ref.rope_scaling)
    attn.attn.impl = TrainerSinkAttentionImpl(ref.num_heads, ref.num_kv_heads, ref.head_dim, attn.sinks,
                                              ref.sliding_window, numerics)

"""The trainer's RoPE and attention over vLLM's paged KV cache (the plugin's model class, model.py).

- `TrainerRotary` replaces a decoder layer's `rotary_emb`: the trainer's `model.layers.rope_cos_sin`
  and `apply_rope` on vLLM's [tokens, heads·head_dim] layout (elementwise: the same bits for a token
  whatever the layout or batch).
- `TrainerAttentionImpl` replaces the layer's `Attention.impl` (vLLM's CPU backend keeps building the
  metadata and allocating the cache): keys and values go into the cache with plain indexing (this
  impl reads them back, so it owns the layout inside each block), and every request's queries
  attend with the trainer's row-invariant `fp4.invariant.attention` at the served level over its
  keys gathered from its block table, by position. At `batch` that op reduces fixed key blocks by
  position combined in block order (`fp4.tiled.block_attention`), at `exact` fixed trees indexed by
  key position, so a query gets the same bits in a vLLM decode step, a chunked prefill, any batch,
  and the trainer's full causal forward (ground rule 7); the KV-cache path of the project's rollout
  engine relies on the same property. In a bf16/fp16 model the attention runs in fp32 (`model.layers.upcast`, the
  precision of the fp32 trainer the rollout is scored by; the cache keeps the model dtype): with
  the fp32 residual stream (model.py) the bf16 rollout's only roundings are its GEMMs' and weights'.

Found by `benchmarks/bench_vllm_goals.py --only layers`: with RMSNorm already the trainer's
(ops.py), vLLM's RoPE kernel and CPU attention kernel were the first ops whose bits differed
(~3e-7 in fp32), which then flipped FP4 codes and cascaded through the KV cache.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_fp4.fp4 import invariant
from megatron_fp4.integrations.vllm import opaque
from megatron_fp4.model.layers import apply_rope, rope_cos_sin, upcast

_FORWARD: list = [None, {}]  # [vLLM's ForwardContext of the forward the memo serves, the memo]


def forward_memo(owner, key: tuple, compute):
    """``compute()``, once per vLLM model forward for ``(owner, *key)``: index tensors derived from
    what every layer of one forward shares (the attention metadata, the positions), which vLLM
    does not change within a forward. A forward is vLLM's `ForwardContext` (a new object per model
    forward: `set_forward_context`); the memo holds it and ``owner`` (the metadata or positions
    object) strongly, so neither id is reused while it is kept, and forgets it all when the next
    forward starts. Outside a forward (the tests that drive an impl directly, with or without vLLM
    installed) nothing is kept. The layers then get the same tensors they would compute themselves,
    so the same bits."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:  # this module's pieces run without vLLM too (tests/integration/test_vllm_exact.py)
        return compute()
    if not is_forward_context_available():
        return compute()
    ctx = get_forward_context()
    if _FORWARD[0] is not ctx:
        _FORWARD[0], _FORWARD[1] = ctx, {}
    memo = _FORWARD[1]
    held = memo.get((id(owner), *key))
    if held is None or held[0] is not owner:
        held = memo[(id(owner), *key)] = (owner, compute())
    return held[1]


class OpaqueRotary(nn.Module):
    """vLLM's ``rotary_emb(positions, q, k)`` whose ``_forward`` runs as one opaque op (opaque.py)
    once ``mfp4_key`` is set, so that inductor does not re-fuse it."""

    mfp4_key = None

    def mfp4_opaque(self):
        """(eager function, shape function) for `opaque.make_layers_opaque`."""
        return self._forward, lambda p, q, k: [opaque.like(q), opaque.like(k)]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.mfp4_key is None:
            return self._forward(positions, q, k)
        q, k = opaque.call(self.mfp4_key, positions, q, k)
        return q, k


class TrainerRotary(OpaqueRotary):
    """vLLM's `rotary_emb(positions, q, k)` computed as the trainer's RoPE (full rotary dim, HF's
    rotate-half layout, base ``theta``)."""

    def __init__(self, head_dim: int, theta: float, name: Optional[str] = None):
        super().__init__()
        self.head_dim, self.theta = int(head_dim), float(theta)
        # named (the plugin's model class): one opaque op (opaque.py) that inductor does not re-fuse
        self.mfp4_key = None if name is None else opaque.register(name, *self.mfp4_opaque())

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The trainer's `apply_rope` on vLLM's [T, heads·D] rows viewed as [T, heads, D] (``cos`` and
        ``sin`` [1, T, D] broadcast over the heads): elementwise, so each element's bits are those of
        the trainer's [B, heads, T, D] layout, without its two transposing copies."""
        T = x.shape[0]
        return apply_rope(x.reshape(T, -1, self.head_dim), cos[0], sin[0]).reshape(x.shape)

    def _forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # [1, T, D], computed once per forward for all layers (the same positions object, `forward_memo`)
        cos, sin = forward_memo(positions, ("rope", self.head_dim, self.theta, q.dtype), lambda: rope_cos_sin(
            positions.reshape(1, -1), self.head_dim, self.theta, q.dtype))
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def _cpu_layout(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int):
    """(keys, values) views [blocks, kv_heads, block_size, head_dim] of vLLM's CPU cache tensor
    [blocks, kv_heads, block_size, 2·head_dim] (the layout its CPU backend allocates)."""
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_kv_heads or kv_cache.shape[3] != 2 * head_dim:
        raise NotImplementedError(f"megatron_fp4: the plugin's attention reads vLLM's CPU KV-cache layout "
                                  f"[blocks, {num_kv_heads}, block_size, {2 * head_dim}]; got {tuple(kv_cache.shape)} "
                                  f"(another attention backend): serve with vLLM's CPU build")
    blocks, kv, size, _ = kv_cache.shape
    return kv_cache.view(blocks, kv, 2 * size, head_dim).chunk(2, dim=2)


def attention_step(attn_metadata, output_scale, output_block_scale) -> bool:
    """Whether vLLM's attention call computes something (no metadata: its warm-up / profile run);
    refuses what the plugin's attention does not do (fused output quantization, non-causal)."""
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("megatron_fp4: fused output quantization is not supported")
    if attn_metadata is None:
        return False
    if not getattr(attn_metadata, "causal", True):
        raise NotImplementedError("megatron_fp4: the plugin's attention is causal decoder attention")
    return True


def query_groups(attn_metadata) -> dict:
    """{query count n: [requests with n queries in this step]} (all decodes: one group)."""
    starts = attn_metadata.query_start_loc.tolist()
    groups: dict = {}
    for i in range(len(starts) - 1):
        if starts[i + 1] > starts[i]:
            groups.setdefault(starts[i + 1] - starts[i], []).append(i)
    return groups


def grouped_qkv(query, kv_cache, attn_metadata, num_heads: int, num_kv_heads: int, head_dim: int, window: int = 0):
    """Per group of requests with the same number ``n`` of queries in this step (`query_groups`):
    (rows of ``query`` [B·n], q [B, H, n, D], k, v [B, KV, Tk, D], positions [B, n]), in fp32 — each
    request's queries (the last n positions of its sequence) and its keys and values gathered from
    its block table by position (key index = position), Tk the group's longest sequence. Slots a
    request's queries cannot see hold one of its visible keys, so they weigh exactly 0 and are
    finite (unlike unwritten cache slots): past its sequence (a longer request's), its last key;
    with a sliding ``window``, before the earliest query's window, its first visible key (blocks vLLM
    freed for a sliding layer, its null block, are never read). The attention op's contract (a
    query's bits depend only on its keys up to its position, by position) makes each request's
    result its own alone: the trainer's."""
    keys, _ = _cpu_layout(kv_cache, num_kv_heads, head_dim)
    # the cache's rows [blocks·KV·2·size, D] (per block and kv head: its keys, then its values)
    flat, size = kv_cache.view(-1, head_dim), keys.shape[2]
    plan = forward_memo(attn_metadata, ("gather", size, num_kv_heads, window, query.device), lambda: _gather_plan(
        attn_metadata, size, num_kv_heads, window, query.device))
    for qrows, n, krows, vrows, (B, _, Tk), positions in plan:
        k = upcast(flat.index_select(0, krows).view(B, num_kv_heads, Tk, head_dim))  # bf16/fp16: in fp32
        v = upcast(flat.index_select(0, vrows).view(B, num_kv_heads, Tk, head_dim))
        q = upcast(query.view(-1, num_heads, head_dim).index_select(0, qrows).view(B, n, num_heads, head_dim)
                   .transpose(1, 2))
        yield qrows, q, k, v, positions


def _gather_plan(attn_metadata, size: int, KV: int, window: int, device) -> list:
    """`grouped_qkv`'s index tensors per query group: [(query rows, n, cache rows of the keys, of the
    values, (B, KV, Tk), positions [B, n])], from the metadata alone (once per forward)."""
    starts, lengths = attn_metadata.query_start_loc.tolist(), attn_metadata.seq_lens.tolist()
    plan = []
    for n, reqs in query_groups(attn_metadata).items():
        idx = torch.tensor(reqs, device=device)
        seq = torch.tensor([lengths[i] for i in reqs], device=device)
        j = torch.minimum(torch.arange(int(seq.max()), device=device)[None], seq[:, None] - 1)  # [B, Tk]
        if window:  # the earliest query's first visible key
            j = torch.maximum(j, (seq[:, None] - n - window + 1).clamp(min=0))
        blocks = attn_metadata.block_table.index_select(0, idx).long().gather(1, j // size)
        # one row gather each for keys and values, straight into [B, KV, Tk, D]
        rows = _cache_rows(blocks, j % size, KV, size).reshape(-1)
        qrows = torch.cat([torch.arange(starts[i], starts[i] + n, device=device) for i in reqs])
        plan.append((qrows, n, rows, rows + size, (len(reqs), KV, j.shape[1]),
                     seq[:, None] - n + torch.arange(n, device=device)[None]))
    return plan


def _slot_rows(slot_mapping: torch.Tensor, size: int, KV: int) -> tuple:
    """(the tokens with a slot, None when all have one; the cache rows of their keys [tokens·KV],
    token-major then kv head) of ``slot_mapping`` over blocks of ``size`` slots (the values' rows
    are ``size`` further: each block and kv head holds its keys, then its values)."""
    slots = slot_mapping.long()
    real = slots >= 0
    tokens = None
    if not bool(real.all()):
        tokens = real.nonzero().squeeze(1)
        slots = slots.index_select(0, tokens)
    return tokens, _cache_rows(slots // size, slots % size, KV, size).reshape(-1)


def _cache_rows(blocks: torch.Tensor, offsets: torch.Tensor, KV: int, size: int) -> torch.Tensor:
    """The rows of the flat cache [blocks·KV·2·size, D] (`grouped_qkv`: per block and kv head its
    ``size`` keys, then its values) holding the keys at slot ``offsets`` of cache block ``blocks``
    (both [N, ...]), one per kv head: [N, KV, ...] (the values' rows are ``size`` further)."""
    heads = torch.arange(KV, device=blocks.device).view(1, KV, *([1] * (blocks.dim() - 1)))
    return (blocks.unsqueeze(1) * KV + heads) * (2 * size) + offsets.unsqueeze(1)


class TrainerAttentionImpl:
    """An `AttentionImpl` (vLLM calls `do_kv_cache_update` then `forward`) computing causal decoder
    attention with the trainer's `invariant.attention`, the requests with the same number of
    queries in one call (`grouped_qkv`: B rows, no padding). The families' impls (mla.py,
    gpt_oss.py) override `attend` (and ``window``, ``v_dim``)."""

    window = 0  # a sliding window (gpt_oss.py)
    v_dim = None  # the values' width when below head_dim (mla.py: vLLM pads them to it)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, numerics):
        if abs(scale - head_dim ** -0.5) > 0:
            raise ValueError(f"megatron_fp4: attention scale {scale} is not head_dim ** -0.5 (the trainer's)")
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_dim
        self.numerics = numerics
        self.kv_sharing_target_layer_name = None
        self.supports_quant_query_input = False

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        pass

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Each token's keys and values [T, KV, D] into its slot (padding tokens carry slot -1: none),
        one row copy each into the cache's rows (`grouped_qkv`'s layout), the rows once per forward."""
        keys, _ = _cpu_layout(kv_cache, self.num_kv_heads, self.head_size)
        flat, D = kv_cache.view(-1, self.head_size), self.head_size
        tokens, krows = forward_memo(slot_mapping, ("slots", keys.shape[2], self.num_kv_heads), lambda: _slot_rows(
            slot_mapping, keys.shape[2], self.num_kv_heads))
        size = keys.shape[2]
        k = key[:slot_mapping.shape[0]].reshape(-1, self.num_kv_heads * D)
        v = value[:slot_mapping.shape[0]].reshape(-1, self.num_kv_heads * D)
        if tokens is not None:
            k, v = k.index_select(0, tokens), v.index_select(0, tokens)
        flat.index_copy_(0, krows, k.reshape(-1, D).to(flat.dtype))
        flat.index_copy_(0, krows + size, v.reshape(-1, D).to(flat.dtype))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not attention_step(attn_metadata, output_scale, output_block_scale):  # vLLM's warm-up / profile run
            return output
        H, D = self.num_heads, self.head_size
        Dv = self.v_dim or D
        out_heads = output.view(-1, H, D)
        for qrows, q, k, v, positions in grouped_qkv(query, kv_cache, attn_metadata, H, self.num_kv_heads, D,
                                                     self.window):
            out = self.attend(q, k, v[..., :Dv], positions)  # [B, H, n, Dv]
            out_heads[qrows, :, :Dv] = out.transpose(1, 2).reshape(-1, H, Dv).to(output.dtype)
            if Dv < D:
                out_heads[qrows, :, Dv:] = 0
        return output

    def attend(self, q, k, v, positions) -> torch.Tensor:
        """q [B, H, n, D] at ``positions`` [B, n] over keys and values by position: [B, H, n, Dv]."""
        assert invariant.enabled(self.numerics, q), "the plugin's attention runs a row-invariant level"
        return invariant.attention(q, k, v, positions, torch.zeros(q.shape[0], dtype=torch.long, device=q.device),
                                   self.numerics)

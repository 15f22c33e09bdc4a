"""The plugin's DeepSeek-V3 attention pieces (integrations/vllm/mla.py) against the trainer's MLA.

No vLLM needed (mla.py imports none): the plugin's forward of vLLM's non-MLA `DeepseekV2Attention`
(`mla._mla_forward`, with `TrainerMLARotary` and `TrainerMLAImpl`) over the trainer's projections
and low-rank norms, keys and zero-padded values written into a paged cache
[blocks, heads, block_size, 2·qk_dim] through a slot mapping, a chunked and a batched
prefill of two requests of different lengths then decode steps over scattered blocks, the first v_head_dim of each
head's output read — give every token the bits of the trainer's `MLAttention` run as one left-padded
full forward (how the trainer scores), at the batch-invariant levels; at the standard level (SDPA
over each request's keys vs the trainer's SDPA over the batch) within rounding. YaRN with
mscale_all_dim (the softmax scale's mscale²) and v_head_dim != qk head dim.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.config import ModelConfig
from megatron_fp4.fp4 import Numerics, apply_numerics
from megatron_fp4.integrations.vllm.mla import TrainerMLAImpl, TrainerMLARotary, _mla_forward
from megatron_fp4.model.deepseek_v3 import MLAttention
from tests.integration.paged_attention_step import paged_step

HEADS, NOPE, ROPE, V, HIDDEN, BLOCK = 2, 16, 16, 8, 64, 4
QK = NOPE + ROPE
YARN = dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=4)


def trainer_mla(level: str) -> MLAttention:
    cfg = ModelConfig(vocab_size=32, hidden_size=HIDDEN, num_layers=1, num_heads=HEADS, num_kv_heads=HEADS,
                      head_dim=QK, num_experts=4, top_k=1, moe_ffn_hidden_size=16, family="deepseek_v3",
                      q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                      rope_theta=1e4, rope_scaling=YARN)
    torch.manual_seed(3)
    attn = MLAttention(cfg, None)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    apply_numerics(attn, Numerics(invariance=level, mode="rollout"))
    return attn.eval()


class VllmMLA(torch.nn.Module):
    """The attributes of vLLM's non-MLA `DeepseekV2Attention` that `mla._mla_forward` reads, over the
    trainer module's weights: vLLM's linears return (output, bias), its `Attention` layer writes the
    keys and values into the paged cache (slot mapping) and runs the impl with the step's metadata."""

    def __init__(self, attn, impl, rope, cache, table):
        super().__init__()
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            setattr(self, name, (lambda m: lambda x: (m(x), None))(getattr(attn, name)))
        self.q_a_layernorm, self.kv_a_layernorm, self.rotary_emb = attn.q_a_layernorm, attn.kv_a_layernorm, rope
        self.q_lora_rank, self.kv_lora_rank, self.num_local_heads = attn.q_lora_rank, attn.kv_lora_rank, HEADS
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = NOPE, ROPE, V
        self.impl, self.cache, self.table, self.chunks = impl, cache, table, None

    def attn(self, q, k, v):
        T = q.shape[0]
        return paged_step(self.impl, self.cache, self.table, self.chunks, BLOCK, q, k.view(T, HEADS, QK),
                          v.view(T, HEADS, QK), torch.full((T, HEADS * QK), float("nan")))


def vllm_step(layer: VllmMLA, chunks):
    """One vLLM forward over `chunks` [(request, first position, rows of x)]: the plugin's forward."""
    layer.chunks = chunks
    rows = torch.cat([xs for _, _, xs in chunks])
    positions = torch.cat([torch.arange(p0, p0 + len(xs)) for _, p0, xs in chunks])
    return _mla_forward(layer, positions, rows).split([len(xs) for _, _, xs in chunks])


@pytest.mark.parametrize("level", ["exact", "batch", "standard"])
def test_plugin_mla_over_the_paged_cache_equals_the_trainers_full_forward(level):
    attn = trainer_mla(level)
    impl = TrainerMLAImpl(HEADS, QK, V, attn.scale, attn.numerics)
    rope = TrainerMLARotary(ROPE, attn.rope_theta, attn.rope_scaling)
    assert attn.scale != QK ** -0.5  # YaRN's mscale² is in the scale
    # per vLLM step, the tokens each request runs: request 1's prompt as a chunked prefill (4 then 5),
    # request 0's prefill batched with the second chunk, then decode steps in changing batches
    schedule = [{1: 4}, {0: 5, 1: 5}, {1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1}]
    lengths = [sum(step.get(r, 0) for step in schedule) for r in (0, 1)]
    xs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(10 + i)) for i, n in enumerate(lengths)]
    table = [[5, 2], [0, 6, 3, 1]]
    cache = torch.full((8, HEADS, BLOCK, 2 * QK), float("nan"))  # unwritten slots must never be read
    layer = VllmMLA(attn, impl, rope, cache, table)
    got, done = [[], []], [0, 0]
    with torch.no_grad():
        for step in schedule:
            chunks = [(r, done[r], xs[r][done[r]:done[r] + n]) for r, n in step.items()]
            for (r, _, _), y in zip(chunks, vllm_step(layer, chunks)):
                got[r].append(y)
            for r, n in step.items():
                done[r] += n
        T = max(lengths)
        x, mask = torch.zeros(2, T, HIDDEN), torch.zeros(2, T, dtype=torch.long)
        for i, n in enumerate(lengths):
            x[i, T - n:], mask[i, T - n:] = xs[i], 1
        want = attn(x, (mask.cumsum(-1) - 1).clamp(min=0), mask)
    for i, n in enumerate(lengths):
        mine, ref = torch.cat(got[i]), want[i, T - n:]
        if level == "standard":  # SDPA over other shapes: rounding only
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(mine, ref), f"request {i}: max {(mine - ref).abs().max():.3g}"


def test_the_mla_rope_is_the_trainers_deinterleaved_rope():
    """The rotary part comes back de-interleaved (HF's pairs (2i, 2i+1) as (i, i + r/2)) and roped:
    a position-0 token is only permuted; an interleaved pair rotates together."""
    rope = TrainerMLARotary(ROPE, 1e4, YARN)
    q, k = torch.randn(3, HEADS, ROPE), torch.randn(3, 1, ROPE)
    got_q, got_k = rope(torch.tensor([0, 5, 0]), q, k)
    perm = torch.cat([torch.arange(0, ROPE, 2), torch.arange(1, ROPE, 2)])
    assert torch.equal(got_q[0], q[0][:, perm]) and torch.equal(got_k[2], k[2][:, perm])
    assert got_q.is_contiguous() and got_k.is_contiguous()  # its opaque op's promise (inductor reads it dense)
    assert not torch.allclose(got_q[1], q[1][:, perm])
    norms = lambda t: (t[..., :ROPE // 2] ** 2 + t[..., ROPE // 2:] ** 2)  # noqa: E731
    torch.testing.assert_close(norms(got_q[1]), norms(q[1][:, perm]))  # YaRN mscale ratio 1 here


def test_the_mla_impl_refuses_another_cache_layout():
    impl = TrainerMLAImpl(HEADS, QK, V, 0.1, Numerics(invariance="exact"))
    with pytest.raises(NotImplementedError, match="CPU KV-cache layout"):
        impl.do_kv_cache_update(None, torch.zeros(1, HEADS, QK), torch.zeros(1, HEADS, QK),
                                torch.zeros(2, HEADS, 4, QK), torch.zeros(1, dtype=torch.long))

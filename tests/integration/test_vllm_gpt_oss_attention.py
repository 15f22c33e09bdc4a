"""The plugin's GPT-OSS attention pieces (integrations/vllm/gpt_oss.py) against the trainer's `GptOssAttention`.

No vLLM needed (gpt_oss.py imports none): vLLM's `OAIAttention.forward` order (one qkv projection
split, ``rotary_emb`` = `TrainerYarnRotary`, its `Attention` layer writing keys and values into a
paged cache [blocks, kv_heads, block_size, 2·head_dim] through a slot mapping and running
`TrainerSinkAttentionImpl`, ``o_proj``) over the trainer's projections — a chunked and a batched prefill
of two requests of different lengths, then decode steps over scattered blocks — gives every token
the bits of the trainer's layer run as one left-padded full forward (how the trainer scores), at
the row-invariant levels, for a sliding-window layer (window 3 < block 4 < the sequences; the blocks
it no longer reads freed to a NaN block, as vLLM's KV-cache manager frees them) and a full one, with
sinks, GQA and YaRN; at the standard level (`sink_attention` over each request's keys vs over the
left-padded batch) within rounding.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.config import ModelConfig
from megatron_fp4.fp4 import Numerics, apply_numerics
from megatron_fp4.integrations.vllm.gpt_oss import TrainerSinkAttentionImpl, TrainerYarnRotary
from megatron_fp4.model.gpt_oss import GptOssAttention
from tests.integration.paged_attention_step import paged_step

HEADS, KV, D, HIDDEN, BLOCK, WINDOW, NULL = 4, 2, 16, 32, 4, 3, 7
YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4)


def trainer_attention(level: str, layer_idx: int) -> GptOssAttention:
    cfg = ModelConfig(vocab_size=32, hidden_size=HIDDEN, num_layers=2, num_heads=HEADS, num_kv_heads=KV, head_dim=D,
                      num_experts=4, top_k=1, moe_ffn_hidden_size=16, family="gpt_oss",
                      layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
                      rope_theta=1.5e5, rope_scaling=YARN)
    torch.manual_seed(5)
    attn = GptOssAttention(cfg, None, layer_idx)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    apply_numerics(attn, Numerics(invariance=level, mode="rollout"))
    return attn.eval()


class VllmOAIAttention(torch.nn.Module):
    """vLLM's `OAIAttention` (its forward's order) over the trainer module's weights: vLLM's linears
    return (output, bias), its `Attention` layer writes the keys and values into the paged cache
    (slot mapping) and runs the impl with the step's metadata."""

    def __init__(self, attn, impl, rope, cache, table):
        super().__init__()
        self.qkv_proj = lambda x: (torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1), None)
        self.o_proj = lambda x: (attn.o_proj(x), None)
        self.rotary_emb, self.impl, self.cache, self.table, self.chunks = rope, impl, cache, table, None

    def attn(self, q, k, v):
        T = q.shape[0]
        out = paged_step(self.impl, self.cache, self.table, self.chunks, BLOCK, q.view(T, HEADS, D), k.view(T, KV, D),
                         v.view(T, KV, D), torch.full((T, HEADS, D), float("nan")))
        return out.view(T, HEADS * D)

    def forward(self, hidden_states, positions):  # vLLM's OAIAttention.forward
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([HEADS * D, KV * D, KV * D], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))[0]


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("level", ["exact", "batch", "standard"])
def test_plugin_gpt_oss_attention_over_the_paged_cache_equals_the_trainers_full_forward(level, layer_idx):
    attn = trainer_attention(level, layer_idx)
    window = attn.sliding_window
    assert window == (WINDOW if layer_idx == 0 else 0)
    impl = TrainerSinkAttentionImpl(HEADS, KV, D, attn.sinks, window, attn.numerics)
    rope = TrainerYarnRotary(D, attn.rope_theta, attn.rope_scaling)
    # per vLLM step, the tokens each request runs: request 1's prompt as a chunked prefill (4 then 5),
    # request 0's prefill batched with the second chunk, then decode steps in changing batches
    schedule = [{1: 4}, {0: 5, 1: 5}, {1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1}]
    lengths = [sum(step.get(r, 0) for step in schedule) for r in (0, 1)]
    xs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(10 + i)) for i, n in enumerate(lengths)]
    table = [[5, 2], [0, 6, 3, 1]]
    cache = torch.full((8, KV, BLOCK, 2 * D), float("nan"))  # unwritten slots (and the null block 7) never read
    layer = VllmOAIAttention(attn, impl, rope, cache, table)
    got, done, freed = [[], []], [0, 0], 0
    with torch.no_grad():
        for step in schedule:
            chunks = [(r, done[r], xs[r][done[r]:done[r] + n]) for r, n in step.items()]
            rows = torch.cat([x for _, _, x in chunks])
            positions = torch.cat([torch.arange(p0, p0 + len(x)) for _, p0, x in chunks])
            layer.chunks = chunks
            for (r, _, _), y in zip(chunks, layer(rows, positions).split([len(x) for _, _, x in chunks])):
                got[r].append(y)
            for r, n in step.items():
                done[r] += n
                if window:  # vLLM frees the blocks before the next query's window (its null block)
                    for b in range(len(table[r])):
                        if (b + 1) * BLOCK <= done[r] - window + 1 and table[r][b] != NULL:
                            table[r][b], freed = NULL, freed + 1
        T = max(lengths)
        x, mask = torch.zeros(2, T, HIDDEN), torch.zeros(2, T, dtype=torch.long)
        for i, n in enumerate(lengths):
            x[i, T - n:], mask[i, T - n:] = xs[i], 1
        want = attn(x, (mask.cumsum(-1) - 1).clamp(min=0), mask)
    assert freed == (3 if window else 0)  # the sliding layer's test reads around freed blocks
    for i, n in enumerate(lengths):
        mine, ref = torch.cat(got[i]), want[i, T - n:]
        assert mine.isfinite().all()
        if level == "standard":  # other shapes: rounding only
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(mine, ref), f"request {i}: max {(mine - ref).abs().max():.3g}"


def test_the_gpt_oss_rope_is_the_trainers_yarn_rope():
    """Position 0 is the identity scaled by YaRN's attention factor; another position rotates each
    (i, i + D/2) pair, keeping its norm (times the factor²); the output is dense (its opaque op's promise)."""
    rope = TrainerYarnRotary(D, 1.5e5, YARN)
    q, k = torch.randn(3, HEADS * D), torch.randn(3, KV * D)
    got_q, got_k = rope(torch.tensor([0, 5, 0]), q, k)
    factor = 0.1 * torch.log(torch.tensor(32.0)).item() + 1.0
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q[0], q[0] * factor)
    torch.testing.assert_close(got_k[2], k[2] * factor)
    norms = lambda t: (t.view(-1, D)[:, :D // 2] ** 2 + t.view(-1, D)[:, D // 2:] ** 2)  # noqa: E731
    torch.testing.assert_close(norms(got_q[1]), norms(q[1]) * factor ** 2)
    assert not torch.allclose(got_q[1], q[1] * factor)

"""vLLM + the plugin computes what the trainer computes, bit for bit, at the `batch` level (the
default) and the `exact` level (up to the sampler's log-softmax there).

- unit (no vLLM needed: `integrations/vllm/attention.py` imports none): the plugin's RoPE and
  attention (`TrainerRotary`, `TrainerAttentionImpl`), driven the way vLLM drives them — keys and
  values written into a paged cache through a slot mapping, a batched prefill of two requests of
  different lengths (one in two chunks) then decode steps, blocks scattered over the cache — give
  every token the bits of the trainer's `Attention` module run as one left-padded full forward (how
  the trainer scores), at both levels. Bitwise by construction: both call `invariant.attention` at
  the same level, which reduces keys by position (`batch`: fixed 64-key blocks combined in block
  order; `exact`: fixed trees; tests/unit/test_batch_invariant.py checks that op), on the same
  q/k/v bits.
- end to end (vLLM): plain `vllm.LLM(model=dir)` over a `to-hf` export (the plugin registers its
  model class as vLLM's Qwen3MoeForCausalLM) generates a batch of 8 requests; the trainer's scoring
  of the tokens equals vLLM's log-prob at every position at `batch` (max |Δ| 0, was 4.8e-7 when
  the plugin served `batch` exports at `exact`) and matches within TOL at `exact`. Before the plugin
  ran the trainer's RoPE and attention, rounding differences of ~3e-7 flipped FP4 codes: max |Δ|
  4e-3..3e-2.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_fp4.fp4 import Numerics, apply_numerics
from megatron_fp4.integrations.hf.qwen3_moe import HF_ARCHITECTURE
from megatron_fp4.integrations.vllm.attention import TrainerAttentionImpl, TrainerRotary
from megatron_fp4.model.layers import Attention
from megatron_fp4.model.specs import recipe_from_config
from tests.integration.test_vllm_plugin import (PROMPTS, compare, needs_vllm, tiny_cfg, trainer_scores, vllm_generate,
                                                write_hf)

# vLLM's log-prob is its sampler's fp32 log_softmax of the logits. The trainer's at `batch` is the
# same ATen kernel (0 difference on bit-equal logits); at `exact` a tree-summed denominator: on
# bit-equal logits the two differ by a few fp32 roundings of |log p| + log Σ exp (≲ 30 here):
# ≲ 4 · 30 · 6e-8 ≈ 7e-6, measured 4.8e-7. TOL bounds the `exact` level.
TOL = 1e-5
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, THETA = 4, 2, 32, 64, 1e4


def trainer_attention(mode: str, level: str = "batch") -> Attention:
    cfg = tiny_cfg("experts+attention", rollout_mode=mode)
    torch.manual_seed(5)
    attn = Attention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 1e-6, THETA, recipe_from_config(cfg.fp4, mode))
    apply_numerics(attn, Numerics(invariance=level, mode="rollout"))
    return attn.eval()


class PagedCache:
    """vLLM's CPU cache tensor [blocks, kv_heads, block_size, 2·head_dim] (NaN: unwritten slots must
    never be read) and each request's blocks, scattered over it."""

    def __init__(self, tables, block_size=4, num_blocks=48):
        self.tensor = torch.full((num_blocks, KV_HEADS, block_size, 2 * HEAD_DIM), float("nan"))
        self.tables, self.size = tables, block_size
        self.table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)

    def slots(self, req: int, positions: range) -> list:
        return [self.tables[req][p // self.size] * self.size + p % self.size for p in positions]


def plugin_step(attn, impl, rope, cache, chunks):
    """One vLLM forward over the scheduled `chunks` [(request, first position, rows of x)]: vLLM's
    Qwen3MoeAttention.forward (projections and q/k norms as the trainer's modules, which
    test_vllm_plugin checks bitwise) with the plugin's RoPE and attention over the paged cache."""
    rows = torch.cat([xs for _, _, xs in chunks])
    positions = torch.cat([torch.arange(p0, p0 + len(xs)) for _, p0, xs in chunks])
    T = rows.shape[0]
    q = attn.q_norm(attn.q_proj(rows).view(T, HEADS, HEAD_DIM)).view(T, -1)
    k = attn.k_norm(attn.k_proj(rows).view(T, KV_HEADS, HEAD_DIM)).view(T, -1)
    v = attn.v_proj(rows)
    q, k = rope(positions, q, k)
    slots = torch.tensor(sum((cache.slots(r, range(p0, p0 + len(xs))) for r, p0, xs in chunks), []))
    impl.do_kv_cache_update(None, k.view(T, KV_HEADS, HEAD_DIM), v.view(T, KV_HEADS, HEAD_DIM), cache.tensor, slots)
    starts = [0]
    for _, _, xs in chunks:
        starts.append(starts[-1] + len(xs))
    meta = type("Meta", (), {})()
    meta.causal, meta.query_start_loc = True, torch.tensor(starts, dtype=torch.int32)
    meta.seq_lens = torch.tensor([p0 + len(xs) for _, p0, xs in chunks], dtype=torch.int32)
    meta.block_table = cache.table[[r for r, _, _ in chunks]]
    out = torch.empty(T, HEADS, HEAD_DIM)
    impl.forward(None, q.view(T, HEADS, HEAD_DIM), None, None, cache.tensor, meta, out)
    return attn.o_proj(out.view(T, -1)).split([len(xs) for _, _, xs in chunks])


@pytest.mark.parametrize("level", ["batch", "exact"])
@pytest.mark.parametrize("mode", ["fp4_resq", "bf16"])
@pytest.mark.parametrize("prompt", [[5, 9], [5, 63]], ids=["short", "across_a_key_block"])
def test_plugin_attention_over_the_paged_cache_equals_the_trainers_full_forward(mode, level, prompt):
    """`across_a_key_block`: request 1's prefill fills the batch level's first 64-key block
    (`fp4.tiled.KEY_BLOCK`) and its decode steps read the second (its online-softmax combine)."""
    attn = trainer_attention(mode, level)
    new = 3  # request lengths `prompt`; then `new` decode steps, both requests in each
    lengths = [p + new for p in prompt]
    xs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(10 + i)) for i, n in enumerate(lengths)]
    # each request's blocks scattered over the cache (request 0: 2 blocks, request 1: as many as it needs)
    order = [int(b) for b in torch.randperm(46, generator=torch.Generator().manual_seed(3)) if b not in (2, 5)]
    cache = PagedCache([[5, 2], order[:-(-lengths[1] // 4)]])
    impl = TrainerAttentionImpl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, attn.numerics)
    rope = TrainerRotary(HEAD_DIM, THETA)
    got = [[], []]
    with torch.no_grad():
        # a batched prefill (request 1's prompt in two chunks, the second over the first's cached
        # keys); then request 1 decodes alone once (another batch), then both decode
        cut = prompt[1] // 2 + 1
        steps = [[(0, 0, xs[0][:prompt[0]]), (1, 0, xs[1][:cut])], [(1, cut, xs[1][cut:prompt[1]])],
                 [(1, prompt[1], xs[1][prompt[1]:prompt[1] + 1])]]
        steps += [[(0, prompt[0] + s, xs[0][prompt[0] + s:prompt[0] + s + 1]),
                   (1, prompt[1] + s + 1, xs[1][prompt[1] + s + 1:prompt[1] + s + 2])] for s in range(new - 1)]
        steps.append([(0, lengths[0] - 1, xs[0][-1:])])
        for chunks in steps:
            for (r, _, _), y in zip(chunks, plugin_step(attn, impl, rope, cache, chunks)):
                got[r].append(y)
        # the trainer: one left-padded full forward of both sequences
        T = max(lengths)
        x = torch.zeros(2, T, HIDDEN)
        mask = torch.zeros(2, T, dtype=torch.long)
        for i, n in enumerate(lengths):
            x[i, T - n:], mask[i, T - n:] = xs[i], 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want = attn(x, positions, mask)
    for i, n in enumerate(lengths):
        assert torch.equal(torch.cat(got[i]), want[i, T - n:]), f"request {i}"


def test_the_rope_is_the_trainers():
    attn = trainer_attention("bf16")
    T = 7
    q, k = torch.randn(T, HEADS * HEAD_DIM), torch.randn(T, KV_HEADS * HEAD_DIM)
    positions = torch.tensor([3, 0, 9, 4, 4, 100, 1])
    from megatron_fp4.model.layers import apply_rope, rope_cos_sin

    cos, sin = rope_cos_sin(positions[None], HEAD_DIM, attn.rope_theta, q.dtype)
    got_q, got_k = TrainerRotary(HEAD_DIM, THETA)(positions, q, k)
    want = apply_rope(q.view(1, T, HEADS, HEAD_DIM).transpose(1, 2), cos, sin).transpose(1, 2).reshape(T, -1)
    assert torch.equal(got_q, want)
    assert not torch.equal(got_k, k)


def test_the_attention_refuses_another_cache_layout_and_scale():
    impl = TrainerAttentionImpl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, Numerics(invariance="exact"))
    with pytest.raises(NotImplementedError, match="CPU KV-cache layout"):
        impl.do_kv_cache_update(None, torch.zeros(1, KV_HEADS, HEAD_DIM), torch.zeros(1, KV_HEADS, HEAD_DIM),
                                torch.zeros(2, 8, 4, KV_HEADS, HEAD_DIM), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="head_dim"):
        TrainerAttentionImpl(HEADS, KV_HEADS, HEAD_DIM, 1.0, Numerics(invariance="exact"))


@needs_vllm
def test_bf16_norms_keep_an_fp32_residual():
    """The residual a bf16 model's norms pass on stays fp32 (an addend below bf16's step survives)
    and the norm sees the fp32 sum; only its output is rounded to bf16."""
    from megatron_fp4.integrations.vllm.model import keep_fp32_residual
    from megatron_fp4.model.layers import RMSNorm

    norm = RMSNorm(HIDDEN).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    keep_fp32_residual(norm)
    residual = torch.ones(3, HIDDEN) + 2.0 ** -12  # not a bf16 number
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    out, h = norm(x, residual)
    assert h.dtype == torch.float32 and torch.equal(h, residual + x.float())
    want = RMSNorm.forward(norm, h).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert torch.equal(norm(x), RMSNorm.forward(norm, x.float()).to(torch.bfloat16))


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("level", ["batch", "exact"])
def test_vllm_batch_log_probs_equal_the_trainers_scoring(tmp_path, level):
    """All 8 requests in one vLLM batch vs the trainer's scoring. At `batch` the logits are the same
    bits (every op the trainer's, at that level), and both log-probs are ATen's row-local fp32
    `log_softmax` of them (vLLM's sampler; `fp4.invariant.log_softmax` at `batch`): max |Δ| 0. At
    `exact` the trainer's log-softmax sums in a tree: within TOL (derived above)."""
    cfg = tiny_cfg("experts+attention")  # MoEResQ on experts and q/k/v/o
    cfg.numerics.invariance = level
    hf = write_hf(tmp_path, cfg)
    assert json.loads((hf / "config.json").read_text())["architectures"] == [HF_ARCHITECTURE]  # verl needs one
    out = vllm_generate(hf, tmp_path)  # all 8 requests in one batch (at `batch`: test_vllm_plugin's engine run)
    assert out["plugin"]
    delta, _, _ = compare(out, trainer_scores(hf, cfg, [r["tokens"] for r in out["results"]]))
    print(f"plugin vs trainer ({level}): |dlogp| max {delta.max():.3g} over {delta.numel()} positions")
    assert delta.numel() == len(PROMPTS) * 16 and delta.max() <= (0.0 if level == "batch" else TOL), delta.tolist()


@needs_vllm
def test_the_layers_of_one_vllm_forward_share_its_index_tensors_bitwise():
    """Inside a vLLM forward (its `ForwardContext`) the plugin's RoPE, KV-cache write and attention
    derive their index tensors once from the step's positions, slot mapping and metadata
    (`attention.forward_memo`) and the other layers reuse them: two layers of each forward, over
    their own caches, give the bits each layer computes alone outside a forward (a prefill of two
    requests, then decode steps: each forward's metadata its own, recomputed)."""
    from vllm.config import VllmConfig
    from vllm.forward_context import create_forward_context, override_forward_context

    from megatron_fp4.integrations.vllm import attention

    numerics = trainer_attention("bf16").numerics
    impl = TrainerAttentionImpl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, numerics)
    rope = TrainerRotary(HEAD_DIM, THETA)
    tables = [[5, 2, 7], [9, 1, 3, 4]]
    steps = [[(0, 0, 5), (1, 0, 9)], [(0, 5, 1), (1, 9, 1)], [(1, 10, 1)], [(0, 6, 1), (1, 11, 1)]]
    gen = torch.Generator().manual_seed(11)
    layers = 2
    inputs = [[torch.randn(sum(n for _, _, n in chunks), (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
               for _ in range(layers)] for chunks in steps]
    config = VllmConfig()

    def run(in_forward: bool):
        caches = [PagedCache(tables).tensor for _ in range(layers)]
        outs = []
        for chunks, xs in zip(steps, inputs):
            positions = torch.cat([torch.arange(p0, p0 + n) for _, p0, n in chunks])
            slots = torch.tensor([tables[r][p // 4] * 4 + p % 4 for r, p0, n in chunks for p in range(p0, p0 + n)])
            meta = type("Meta", (), {})()
            meta.causal = True
            meta.query_start_loc = torch.tensor([0] + torch.tensor([n for _, _, n in chunks]).cumsum(0).tolist())
            meta.seq_lens = torch.tensor([p0 + n for _, p0, n in chunks])
            meta.block_table = torch.tensor([tables[r] + [0] * (4 - len(tables[r])) for r, _, _ in chunks])
            ctx = create_forward_context({}, config) if in_forward else None
            with override_forward_context(ctx):
                for x, cache in zip(xs, caches):
                    q, k, v = x.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
                    q, k = rope(positions, q, k)
                    T = x.shape[0]
                    impl.do_kv_cache_update(None, k.view(T, KV_HEADS, HEAD_DIM), v.reshape(T, KV_HEADS, HEAD_DIM),
                                            cache, slots)
                    outs.append(impl.forward(None, q.view(T, HEADS, HEAD_DIM), None, None, cache, meta,
                                             torch.empty(T, HEADS, HEAD_DIM)))
                if in_forward:  # one entry each (RoPE, slots, gather) for both layers: the second reused them
                    assert attention._FORWARD[0] is ctx and len(attention._FORWARD[1]) == 3
        return outs, caches

    with torch.no_grad():
        alone, alone_caches = run(False)
        shared, shared_caches = run(True)
    assert all(torch.equal(a, b) for a, b in zip(shared, alone))
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(shared_caches, alone_caches))

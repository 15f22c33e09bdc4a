"""GPT-OSS and DeepSeek-V3 at the ``batch`` and ``exact`` numerics levels: the rollout engine's
log-probs and routes equal the trainer's scoring, bitwise (0 differing bits, 0 differing routes).

As tests/unit/test_batch_invariant.py for Qwen3-MoE: the engine decodes with a KV cache in one
left-padded batch; the same tokens are re-scored by full forwards in other batch groupings
(`rollout.score`, shuffled, other sizes and padding) and by the trainer's own path
(`PolicyScorer` → `Trainer.forward_rows`, micro-batches of 2). Every op of the families' layers
runs the level's kernels (`fp4/invariant.py`: sliding-window/sink and latent attention by
position over fixed key blocks or exact trees, tiled/exact GEMMs with biases, row-local norms and
softmaxes, sigmoids by ``exp``), so the claim is zero differing bits by construction, FP4 off and
FP4 MoEResQ alike (also attention in FP4 for GPT-OSS). fp32 models.
"""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import KVCache
from megatron_fp4.rl import PolicyScorer, build_rl_batch
from megatron_fp4.rl.algo.grpo import response_values
from megatron_fp4.rollout import RolloutEngine, SamplingParams
from megatron_fp4.training.trainer import Trainer
from tests.distributed.test_family_layouts import FAMILIES
from tests.numerics import single_thread
from tests.unit.test_batch_invariant import TOK, bits, check_rollout_equals_scoring, prompts


def family_trainer(family: str, level: str, mode: str, scope: str = "experts", seed: int = 0) -> Trainer:
    cfg = Config()
    FAMILIES[family](cfg.model)
    m = cfg.model
    m.num_layers, m.vocab_size = 2, TOK.vocab_size
    if family == "gpt_oss":  # a window shorter than prompt + response: the sliding layer drops keys
        m.layer_types, m.sliding_window = ["sliding_attention", "full_attention"], 3
    else:  # values narrower than the keys (qk 8 + 4)
        m.v_head_dim = 10
    cfg.numerics.invariance = level
    cfg.fp4.scope, cfg.fp4.train_mode, cfg.fp4.compile = ("none", "bf16", "off") if mode == "bf16" else \
        (scope, mode, "off")
    cfg.schedule.seed = seed
    cfg.logging.tensorboard_dir, cfg.logging.progress, cfg.checkpoint.dir = None, False, None
    return Trainer(cfg, build_data=False)


CASES = [(family, level, mode, scope) for family in FAMILIES for level in ("batch", "exact")
         for mode, scope in (("bf16", "none"), ("fp4_resq", "experts"))] + \
    [("gpt_oss", "batch", "fp4_resq", "experts+attention")]


@pytest.mark.parametrize("family,level,mode,scope", CASES)
def test_rollout_equals_trainer_scoring_bitwise(family, level, mode, scope):
    seed = 3
    with single_thread():
        trainer = family_trainer(family, level, mode, scope, seed)
        model = copy.deepcopy(trainer.model)
        # the engine (KV cache, one padded batch) vs rollout.score in three other groupings
        check_rollout_equals_scoring(mode, scope, "nvfp4", seed, level, model=model)
        # vs the trainer's scoring path (Trainer.forward_rows, micro-batches of 2)
        engine = RolloutEngine(model, mode=mode, invariance=level)
        gen = engine.generate(prompts(seed + 1, 4), SamplingParams(max_new_tokens=5, temperature=1.0, seed=seed),
                              return_routing=True)
        scorer = PolicyScorer(trainer, micro_batch_size=2, keep_reference=False, invariance=level)
        batch = build_rl_batch(gen, torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, scorer, TOK.pad_id)
    assert torch.equal(bits(response_values(batch, "old_log_probs", gen).float()), bits(torch.cat(gen.log_probs)))
    assert torch.equal(response_values(batch, "train_routing", gen).sort(-1).values,
                       torch.cat(gen.routing).sort(-1).values)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kv_cache_logits_equal_full_forward_bitwise_at_exact(family):
    """Raw logits of a left-padded batch: prefill then one token at a time == the full forward."""
    model = family_trainer(family, "exact", "fp4_resq").model.eval()
    tokens = torch.randint(1, TOK.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), single_thread():  # the model computes at `exact` (fixed when it was built)
        full = model(tokens, pos, mask).logits
        cache = KVCache.empty(len(model.layers))
        steps = [model(tokens[:, :4], pos[:, :4], mask[:, :4], cache).logits]
        steps += [model(tokens[:, t:t + 1], pos[:, t:t + 1], mask[:, :t + 1], cache).logits for t in range(4, 10)]
    got = torch.cat(steps, 1)
    assert torch.equal(bits(got[0, 3:]), bits(full[0, 3:])) and torch.equal(bits(got[1:]), bits(full[1:]))


def _reference_attention(q, k, v, positions, pad, scale, window, sinks):
    """Float64 softmax attention by position, the sink an extra logit dropped after the softmax."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Tq, _ = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    key_pos = torch.arange(k.shape[2])[None, :] - pad[:, None]  # [B, Tk]: slot -> position
    p = positions[:, None, :, None]
    kp = key_pos[:, None, None, :]
    visible = (kp >= 0) & (kp <= p) & ((kp > p - window) if window else True)
    scores = (q @ k.transpose(2, 3) * scale).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, H, 1, 1).expand(B, H, Tq, 1)], -1)
    probs = torch.softmax(scores, -1)[..., :k.shape[2]]
    return probs @ v


@pytest.mark.parametrize("level", ["batch", "exact"])
@pytest.mark.parametrize("window,use_sinks,dv", [(0, False, 12), (3, True, 8), (0, True, 8), (5, False, 6)])
def test_invariant_attention_variants_match_float64_reference(level, window, use_sinks, dv):
    """The families' attention variants in the level's kernels (a sliding window, per-head sinks,
    a scale of their own, values wider or narrower than the keys) against float64 softmax
    attention: within 2e-6 relative to the values' scale (fp32 rounding of a few dozen terms, ~1e-7
    each, summed in fixed trees/blocks)."""
    from megatron_fp4.fp4 import Numerics, invariant

    g = torch.Generator().manual_seed(window + dv)
    B, H, KV, T, D = 3, 4, 2, 11, 8
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, KV, T, D, generator=g)
    v = torch.randn(B, KV, T, dv, generator=g)
    pad = torch.tensor([0, 2, 4])
    positions = (torch.arange(T)[None, :] - pad[:, None]).clamp(min=0)
    sinks = torch.randn(H, generator=g) if use_sinks else None
    got = invariant.attention(q, k, v, positions, pad, Numerics(invariance=level), scale=0.3, window=window,
                              sinks=sinks)
    want = _reference_attention(q, k, v, positions, pad, 0.3, window, sinks)
    for b in range(B):  # the padding queries (before a row's first token) are never read
        err = (got[b, :, pad[b]:].double() - want[b, :, pad[b]:]).abs().max()
        assert err <= 2e-6 * v.abs().max(), (b, float(err))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("level", ["batch", "exact"])
def test_invariant_levels_compute_the_standard_model(family, level):
    """The whole model at the level against the standard kernels (FP4 off, fp32): the same function,
    logits within 1e-4 relative (fp32 rounding through two layers; a wrong window, sink or scale
    moves them by ~1e-1)."""
    model = family_trainer(family, "standard", "bf16").model.eval()
    at_level = family_trainer(family, level, "bf16").model.eval()  # the same seed: the same weights
    tokens = torch.randint(1, TOK.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        want = model(tokens, pos).logits
        got = at_level(tokens, pos).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), float((got - want).abs().max())

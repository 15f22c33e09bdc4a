"""Row-invariant numerics (``fp4/invariant.py``): rollout log-probs == trainer log-probs, bitwise.

The rollout engine decodes with a KV cache in one left-padded batch; ``rollout.scoring.score``
re-scores the same tokens in full forwards, in other batches (shuffled, of other sizes, so other
padding). At the ``batch`` and ``exact`` levels every op on the path has a per-row reduction
order fixed by construction (``batch``: fixed-shape GEMM tiles and key blocks; ``exact``: exact
GEMMs, index-anchored reduction trees), so the claim is *zero* differing bits and identical
expert choices: on any CPU and kernel set (these tests run under ``tools/check_portability.sh``),
not a measured tolerance. Without the mode the
same comparison differs in the last bits of ~20-30 % of tokens (measured here; not asserted, it is
machine dependent).
"""
from __future__ import annotations

import random
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from megatron_fp4.config import Config
from megatron_fp4.fp4 import Numerics, apply_numerics, invariant
from megatron_fp4.model import KVCache, build_model
from megatron_fp4.rollout import RolloutEngine, SamplingParams, score
from megatron_fp4.training.data import ArithmeticTokenizer
from tests.numerics import single_thread

TOK = ArithmeticTokenizer()


def tiny_model(seed: int, scope: str = "experts", fmt: str = "nvfp4", level: Optional[str] = None,
               mode: Optional[str] = None):
    """The test model; with `level` / `mode` built at that numerics level / FP4 mode (fixed at build)."""
    cfg = Config()
    cfg.model.vocab_size = TOK.vocab_size
    cfg.model.num_layers = 2
    cfg.fp4.scope, cfg.fp4.format = scope, fmt
    model = build_model(cfg, seed=seed)
    if mode is not None:
        model.set_fp4_mode(mode)
    if level is not None:
        apply_numerics(model, Numerics(invariance=level))
    return model


def prompts(seed: int, n: int):
    rng = random.Random(seed)
    return [TOK.encode(f"{rng.randint(0, 10 ** rng.randint(1, 4))}{rng.choice('+-*')}{rng.randint(0, 99)}=",
                       add_eos=False) for _ in range(n)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("level,mode,scope,fmt,seed", [
    ("batch", "bf16", "experts", "nvfp4", 0), ("batch", "bf16", "experts", "nvfp4", 1),
    ("batch", "fp4", "experts", "nvfp4", 5),
    ("batch", "fp4_resq", "experts", "nvfp4", 0), ("batch", "fp4_resq", "experts", "nvfp4", 1),
    ("batch", "fp4_resq", "experts+attention", "nvfp4", 3), ("batch", "fp4_resq", "experts", "mxfp4", 4),
    ("exact", "bf16", "experts", "nvfp4", 0), ("exact", "fp4_resq", "experts", "nvfp4", 2),
    ("exact", "fp4_resq", "experts+attention", "nvfp4", 3), ("exact", "fp4_resq", "experts", "mxfp4", 4),
])
def test_batch_invariant_rollout_equals_scoring_bitwise(level, mode, scope, fmt, seed):
    # One intra-op thread only for speed on a shared machine (tiny ops, OpenMP spin under load); the
    # bits do not depend on it (each kernel call has one shape; exact sums; elementwise trees).
    with single_thread():
        check_rollout_equals_scoring(mode, scope, fmt, seed, level)


def test_batch_level_rollout_equals_scoring_bitwise_with_two_threads():
    """The ``batch`` level's fixed shapes hold with several intra-op threads too (a lone tile and
    a batch of tiles would split a GEMM differently were they one batched call)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_rollout_equals_scoring("fp4_resq", "experts+attention", "nvfp4", 6, "batch")
    finally:
        torch.set_num_threads(before)


def check_rollout_equals_scoring(mode, scope, fmt, seed, level="batch", model=None):
    """`model` (default: the tiny Qwen3-MoE of scope/fmt; tests/unit/test_family_numerics_levels.py
    passes the other families')."""
    model = tiny_model(seed, scope, fmt) if model is None else model
    engine = RolloutEngine(model, mode=mode, invariance=level)
    ps = prompts(seed, 7)
    out = engine.generate(ps, SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed), return_routing=True)
    order = list(range(len(ps)))
    random.Random(seed).shuffle(order)
    for batch in (order[:3], order[3:4], order[4:]):  # other batch sizes, other padding, other order
        sc = score(model, [out.prompt_ids[i] for i in batch], [out.response_ids[i] for i in batch], mode=mode,
                   return_routing=True, invariance=level)
        for j, i in enumerate(batch):
            assert torch.equal(bits(sc["log_probs"][j]), bits(out.log_probs[i])), (i, sc["log_probs"][j], out.log_probs[i])
            assert torch.equal(sc["routing"][j].sort(-1).values, out.routing[i].sort(-1).values)
    alone = engine.generate([ps[order[0]]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed))
    assert alone.response_ids[0] == out.response_ids[order[0]]  # same tokens sampled alone ...
    assert torch.equal(bits(alone.log_probs[0]), bits(out.log_probs[order[0]]))  # ... from the same bits


@pytest.mark.parametrize("mode,scope", [("bf16", "none"), ("fp4_resq", "experts+attention")])
def test_batch_level_at_onednn_widths_rollout_equals_scoring_bitwise(threads, mode, scope):
    """Hidden 512 (every projection and expert weight ≥ ``row_calls.ONEDNN_MIN_ELEMENTS``): where
    this machine's oneDNN passed the probe, the engine (a rollout-mode model: its GEMMs read oneDNN's
    packed weights, kept in its weight cache) and ``score`` (a train-mode model: the dense weights)
    compute every row with oneDNN's tiles' bits, so they agree bit for bit, at one and two threads
    (the plans are per thread count); elsewhere the same test runs on ``mm``."""
    from megatron_fp4.fp4 import row_calls
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim = TOK.vocab_size, 1, 512, 8, 8, 64
    m.num_experts, m.top_k, m.moe_ffn_hidden_size = 4, 2, 512
    cfg.fp4.scope = scope
    model = build_model(cfg, seed=7)
    if mode != "bf16":
        model.set_fp4_mode(mode)
    apply_numerics(model, Numerics(invariance="batch"))
    kernels = {row_calls.row_plan(512, n, torch.float32, torch.device("cpu")).kernel for n in (512, 1024)}
    if row_calls._onednn_usable():
        assert kernels == {"onednn"}, kernels
    check_rollout_equals_scoring(mode, scope, "nvfp4", 7, "batch", model=model)
    engine = RolloutEngine(model, mode=mode, invariance="batch")
    engine.generate(prompts(8, 2), SamplingParams(max_new_tokens=2, temperature=1.0, seed=1))
    tags = {k[-1] for k in engine._weight_cache}
    packed = tags & {"oneDNN pack", "row-stream pack"}
    assert bool(packed) == row_calls._onednn_usable()
    # a decode step's few rows run the row-streaming kernel where this machine's probe kept it (one
    # thread: `RowPlan.stream`), its packed weights in the same cache, the bits still the trainer's
    streams = row_calls.row_plan(512, 1024, torch.float32, torch.device("cpu")).stream
    assert ("row-stream pack" in tags) == bool(streams), (tags, streams)
    assert not streams or threads == 1


@pytest.mark.parametrize("level", ["batch", "exact"])
def test_batch_invariant_kv_cache_logits_equal_full_forward_bitwise(level):
    """Raw logits: a 5-token prefill then one token at a time == the full causal forward, for
    rows of a batch with left padding (FP4 attention, so FP4 operands sit on both paths)."""
    model = tiny_model(5, "experts+attention", level=level, mode="fp4_resq").eval()
    tokens = torch.randint(1, TOK.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # row 0 left-padded by 3
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), single_thread():
        full = model(tokens, pos, mask).logits
        cache = KVCache.empty(len(model.layers))
        steps = [model(tokens[:, :5], pos[:, :5], mask[:, :5], cache).logits]
        steps += [model(tokens[:, t:t + 1], pos[:, t:t + 1], mask[:, :t + 1], cache).logits for t in range(5, 12)]
    got = torch.cat(steps, 1)
    assert torch.equal(bits(got[0, 3:]), bits(full[0, 3:])) and torch.equal(bits(got[1:]), bits(full[1:]))


def test_batch_invariant_transcendentals_do_not_depend_on_position():
    """The elementwise functions the mode relies on give an element the same bits at any offset
    of a tensor (vector body or tail) and alone; F.silu is the counterexample the mode avoids on
    vector CPUs (checked only where it occurs: not asserted)."""
    x = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 4
    num = Numerics(invariance="batch")
    fns = {"exp": torch.exp, "log": lambda t: torch.log(t.abs() + 1e-3), "cos": torch.cos, "sin": torch.sin,
           "rsqrt": lambda t: torch.rsqrt(t.abs() + 1e-3), "silu": lambda t: invariant.silu(t, num)}
    for name, f in fns.items():
        full = f(x)
        for off in (1, 5, 17, 33):
            assert torch.equal(bits(f(x[off:off + 45].clone())), bits(full[off:off + 45])), name
        alone = torch.cat([f(x[i:i + 1].clone()) for i in range(200)])
        assert torch.equal(bits(alone), bits(full[:200])), name
    torch.testing.assert_close(invariant.silu(x), F.silu(x), rtol=4e-7, atol=1e-30)  # same function, ~1 ulp


def test_batch_invariant_tree_sum_ignores_trailing_zeros_and_matches_sum():
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 7, 16, 33):
        x = torch.randn(5, n, generator=g)
        ref = invariant.tree_sum(x)
        for extra in (1, 4, 30):
            assert torch.equal(bits(invariant.tree_sum(F.pad(x, (0, extra)))), bits(ref))
        # a sum of n terms in any order: within γ_{n-1}·Σ|x| of the float64 sum
        err = (ref.double() - x.double().sum(-1)).abs()
        assert (err <= n * 2.0 ** -24 * x.double().abs().sum(-1) + 1e-45).all()


def test_batch_invariant_mode_is_off_by_default_and_off_for_float64():
    x, num = torch.randn(3, 32), Numerics()
    assert not invariant.enabled(num, x) and not invariant.enabled(None, x)
    for level in ("batch", "exact"):
        at = Numerics(invariance=level)
        assert invariant.enabled(at, x) and not invariant.enabled(at, x.double())
        assert invariant.exact(at, x) == (level == "exact") and invariant.tiled(at, x) == (level == "batch")
    assert not invariant.enabled(Numerics(invariance="standard"), x)
    with pytest.raises(ValueError, match="invariance"):
        Numerics(invariance=True)
    w = torch.randn(8, 32)
    assert torch.equal(invariant.linear(x, w), F.linear(x, w))
    assert torch.equal(invariant.linear(x, w, None, num), F.linear(x, w))


def test_invariance_config_field_defaults_to_batch_and_overrides():
    from megatron_fp4.config import ConfigError, load_config

    assert Config().numerics.invariance == "batch"
    for level in ("standard", "exact"):
        assert load_config(overrides=[f"numerics.invariance={level}"]).validate().numerics.invariance == level
    with pytest.raises(ConfigError, match="numerics.invariance"):
        load_config(overrides=["numerics.invariance=maybe"]).validate()
    with pytest.raises(ConfigError, match="numerics.batch_invariant was replaced by numerics.invariance"):
        load_config(overrides=["numerics.batch_invariant=true"])

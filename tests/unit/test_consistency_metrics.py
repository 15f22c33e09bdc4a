"""Consistency metrics against hand-written float64 (numpy) references."""
import numpy as np
import pytest
import torch

from megatron_fp4.rollout.consistency import consistency_metrics, expert_agreement, kl_exact, kl_k3, pearson

RNG = np.random.default_rng(0)


def test_pearson_and_abs_diffs_match_numpy():
    a = RNG.normal(size=200)
    b = a + 0.1 * RNG.normal(size=200)
    m = consistency_metrics(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32))
    a32, b32 = np.float32(a).astype(np.float64), np.float32(b).astype(np.float64)
    assert m["pearson"] == pytest.approx(np.corrcoef(a32, b32)[0, 1], abs=1e-12)
    assert m["mean_abs_diff"] == pytest.approx(np.abs(a32 - b32).mean(), abs=1e-12)
    assert m["max_abs_diff"] == pytest.approx(np.abs(a32 - b32).max(), abs=1e-12)
    assert m["num_tokens"] == 200 and m["kl_method"] == "k3"
    assert np.isnan(pearson(torch.ones(4), torch.arange(4.0)))


def test_expert_agreement_compares_sets_per_token_and_layer():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [N=2, L=2, k=2]
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [7, 6]]])  # same set (order differs), differ, same, same
    assert expert_agreement(a, b) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="routing shapes differ"):
        expert_agreement(a, b[:1])


def test_kl_exact_and_k3_match_float64_references():
    logits_p, logits_q = RNG.normal(size=(50, 18)), RNG.normal(size=(50, 18))
    lp = logits_p - np.log(np.exp(logits_p).sum(-1, keepdims=True))
    lq = logits_q - np.log(np.exp(logits_q).sum(-1, keepdims=True))
    ref = (np.exp(lp) * (lp - lq)).sum(-1).mean()
    assert kl_exact(torch.tensor(lp), torch.tensor(lq)) == pytest.approx(ref, abs=1e-12)
    # k3 from samples of p is unbiased for KL(p||q): check against the exact value by Monte Carlo
    idx = np.array([RNG.choice(18, size=4000, p=np.exp(row)) for row in lp])  # [50, 4000]
    rl = np.take_along_axis(lp, idx, 1).ravel()
    tl = np.take_along_axis(lq, idx, 1).ravel()
    est = kl_k3(torch.tensor(rl), torch.tensor(tl))
    r = np.exp(tl - rl)
    assert est == pytest.approx((r - 1 - np.log(r)).mean(), abs=1e-12)
    assert est == pytest.approx(ref, rel=0.05)  # 200k samples: MC error ~1% of KL here


def test_metrics_with_routing_and_distributions_and_shape_errors():
    lp = torch.log_softmax(torch.randn(6, 18, dtype=torch.float64), -1)
    tok = lp.argmax(-1)
    picked = lp.gather(-1, tok[:, None]).squeeze(-1)
    r = torch.randint(0, 8, (6, 3, 2))
    m = consistency_metrics(picked, picked, r, r, lp, lp)
    assert m["pearson"] == pytest.approx(1.0) and m["max_abs_diff"] == 0 and m["expert_agreement"] == 1.0
    assert m["kl"] == pytest.approx(0.0, abs=1e-15) and m["kl_method"] == "exact"
    with pytest.raises(ValueError, match="log-prob shapes differ"):
        consistency_metrics(picked, picked[:3])


PROMPTS = [[1, 5, 6], [1, 7], [2, 3, 4, 5], [9]]


def bf16_rollout_and_fp4_scorer(return_routing: bool):
    """A tiny model's bf16 rollout engine's generation of `PROMPTS` (with distributions, and routes
    when `return_routing`) and the model itself as the scoring side (fp4, `batch` level, fixed at build)."""
    import copy

    from megatron_fp4.config import Config
    from megatron_fp4.fp4 import Numerics, apply_numerics
    from megatron_fp4.model import build_model
    from megatron_fp4.rollout import RolloutEngine, SamplingParams

    cfg = Config()
    cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_experts = 32, 32, 2, 4
    cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.moe_ffn_hidden_size = 2, 1, 16
    model = build_model(cfg)
    engine = RolloutEngine(copy.deepcopy(model), mode="fp4", pad_id=0, dtype=torch.bfloat16)
    model.set_fp4_mode("fp4")  # the scoring side: its mode and level fixed at build, as a trainer's
    apply_numerics(model, Numerics(invariance="batch"))
    gen = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, seed=3),
                          return_routing=return_routing, return_distributions=True)
    return gen, model


def test_rescore_maps_each_batch_back_to_its_requests():
    """`rescore` in reversed batches of 2 gives the one-forward metrics bit for bit (batch-invariant
    scoring does not depend on batch composition), so every re-scored token sits at its own request."""
    from megatron_fp4.rollout.consistency import compare_generation, rescore

    gen, model = bf16_rollout_and_fp4_scorer(return_routing=True)
    flat = {k: getattr(gen, k) for k in ("prompt_ids", "response_ids", "log_probs", "routing", "distributions")}
    whole = compare_generation(gen, model, 0, "fp4")
    assert rescore(model, flat, 0, "fp4", batch_size=2, reverse=True) == whole
    assert whole["max_abs_diff"] > 0 and whole["expert_agreement"] <= 1  # a bf16 rollout: a real gap to map

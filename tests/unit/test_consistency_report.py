"""tools/consistency_report.py: table structure, and that the modelled engine gap is real.

Tolerances. With no gap the rollout (KV-cache decode, fp32) and the trainer (full forward, fp32) run
the same code in the batch-invariant numerics mode (on by default on both sides), so every row of
that table is exact by construction: Pearson 1, KL 0, expert agreement 1, no differing log-prob
(test_batch_invariant.py). A bf16
rollout engine rounds weights and activations to 8 mantissa bits (2^-9 relative), which moves
log-probs by ~1e-3 on this model: the BF16 row's Pearson must drop below 1 and its mean |Δ| rise
at least 100x above the no-gap one (measured ~1e4x).
"""
import math

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.rollout import RolloutEngine
from megatron_fp4.training.data import ArithmeticTokenizer
from tools.consistency_report import (COLUMNS, NO_GAP, SCOPES, SETTINGS, Gap, ablation, markdown, ordering,
                                      plot)

TOK = ArithmeticTokenizer()
KW = dict(num_prompts=3, max_new_tokens=5, rollout_batch=2, train_batch=2, seed=0)


def tiny():
    cfg = Config()
    cfg.model.vocab_size = TOK.vocab_size
    cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_experts = 32, 2, 4
    cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.head_dim = 2, 1, 16
    cfg.model.moe_ffn_hidden_size = 32
    return cfg, build_model(cfg, seed=3).state_dict()


@pytest.fixture(scope="module")
def rows():
    cfg, weights = tiny()
    return ablation(cfg, weights, TOK, Gap("bf16"), **KW) + ablation(cfg, weights, TOK, NO_GAP, **KW)


def pick(rows, gap, scope, setting="BF16 both"):
    (r,) = [r for r in rows if r["gap"] == gap.label and r["scope"] == scope and r["setting"] == setting]
    return r


def test_table_structure(rows, tmp_path):
    assert len(rows) == 2 * len(SCOPES) * len(SETTINGS)
    for r in rows:
        assert all(isinstance(r[c], float) and math.isfinite(r[c]) for c in COLUMNS), r
        assert r["num_tokens"] > 0 and r["kl_method"] == "exact"
    md = markdown(rows).splitlines()
    assert f"### {Gap('bf16').label}" in md and f"### {NO_GAP.label}" in md
    table_lines = [line for line in md if line.startswith("|")]
    assert len(table_lines) == 2 * (2 + len(SCOPES) * len(SETTINGS))
    assert all(line.count("|") == len(COLUMNS) + 6 for line in table_lines)
    assert len(ordering(rows)) == 2 * len(SCOPES)
    plot(rows, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000


@pytest.mark.parametrize("scope", SCOPES)
def test_no_gap_bf16_row_is_consistent_and_bf16_rollout_is_not(rows, scope):
    exact, gapped = pick(rows, NO_GAP, scope), pick(rows, Gap("bf16"), scope)
    assert exact["pearson"] >= 0.9999 and exact["expert_agreement"] == 1.0
    assert exact["max_abs_diff"] == 0.0
    assert gapped["pearson"] < exact["pearson"] and gapped["pearson"] < 1.0
    assert gapped["mean_abs_diff"] > 100 * exact["mean_abs_diff"]


def test_no_gap_rows_are_exact_in_every_setting(rows):
    """Batch-invariant numerics on both sides: KL exactly 0, no differing log-prob, same experts, in
    every scope and FP4 setting (rollout-only compensation excepted: its two sides differ on purpose)."""
    for r in rows:
        if r["gap"] == NO_GAP.label and r["train_mode"] == r["rollout_mode"]:
            assert r["max_abs_diff"] == 0.0 and r["kl"] == 0.0 and r["expert_agreement"] == 1.0, r


def test_engine_noise_opens_a_gap_in_fp32():
    cfg, weights = tiny()
    noisy = ablation(cfg, weights, TOK, Gap("fp32", 1e-2), scopes=["experts"], settings=SETTINGS[:1], **KW)[0]
    assert noisy["pearson"] < 1.0 and noisy["mean_abs_diff"] > 1e-5


def test_bf16_engine_keeps_router_fp32_and_accepts_fp32_weights():
    cfg, weights = tiny()
    engine = RolloutEngine(build_model(cfg), mode="fp4_resq", dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in engine.model.named_parameters()}
    assert all((d == torch.float32) == (".router." in n) for n, d in dtypes.items()), dtypes
    engine.load_weights(weights, version=1)  # fp32 from the trainer, rounded on copy
    name = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(engine.model.state_dict()[name], weights[name].to(torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({**weights, name: weights[name][:1]}, version=2)
    fp32_engine = RolloutEngine(build_model(cfg))  # default: exact dtypes still required
    with pytest.raises(ValueError, match="dtype"):
        fp32_engine.check_weights({n: (tuple(t.shape), torch.bfloat16) for n, t in weights.items()})

"""Packed GRPO micro-batches (``rl.max_tokens_per_micro_batch``): scoring and the policy update.

- Scoring: the old and reference log-probs and the routes of packed micro-batches equal the padded
  ones bitwise at the ``batch`` and ``exact`` levels (the model's packed forward gives every token
  the padded forward's bits: tests/unit/test_packed_batches.py).
- The update: a packed step's loss is the token-mean over the minibatch, as the padded step's when
  the minibatch is one micro-batch. The losses are sums of the same terms in another order (other
  micro-batches), and the backward's GEMMs reduce over another token count, so the comparison runs
  in float64 at the ``standard`` level, FP4 off in the update (an FP4 weight gradient quantizes
  blocks of tokens, whose make-up depends on the layout): |Δloss| <= 1e-12 (a few hundred O(1) terms, 2^-53 each),
  and the weights after one AdamW step within lr · 1e-9 (the first Adam step moves a weight by
  lr · g/(|g| + eps): a relative gradient change δ moves it by at most lr · δ · |g|/eps-scale; the
  gradients agree to ~1e-13 relative here, 1e-9 leaves the margin for gradients near eps).
- GRPO with packing is deterministic: two runs, the same float.hex losses and weights.
"""
from __future__ import annotations

import hashlib
import random

import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.rl import loop, make_rollout, switch_to_rl
from megatron_fp4.rl.algo.grpo import build_rl_batch, policy_update
from megatron_fp4.rl.algo.is_correction import RolloutCorrection
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.rl.algo.scorer import PolicyScorer
from megatron_fp4.rl.tasks.catalog import ArithmeticTask
from megatron_fp4.training.trainer import Trainer
from tests.numerics import single_thread

TINY = ["logging.tensorboard_dir=null", "checkpoint.dir=null", "model.num_layers=2", "model.hidden_size=32",
        "model.num_heads=2", "model.num_kv_heads=1", "model.moe_ffn_hidden_size=32", "model.num_experts=4",
        "model.vocab_size=32"]


def trainer_for(*overrides):
    return Trainer(load_config(str(default_config_path()), TINY + list(overrides)), build_data=False)


def generation(seed: int, n: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 32) for _ in range(rng.randint(2, 9))] for _ in range(n)]
    responses = [[rng.randrange(1, 32) for _ in range(rng.randint(1, 10))] for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    log_probs = [-torch.rand(len(r), generator=g, dtype=torch.float64).float() * 3 for r in responses]
    return type("Gen", (), {"prompt_ids": prompts, "response_ids": responses, "log_probs": log_probs,
                            "routing": None})()


@pytest.mark.parametrize("level", ["batch", "exact"])
def test_packed_scoring_equals_padded_bitwise(level):
    with single_thread():
        trainer = trainer_for(f"numerics.invariance={level}")
        gen = generation(0, 8)
        padded = PolicyScorer(trainer, 4, keep_reference=True, max_tokens=0)
        packed = PolicyScorer(trainer, 4, keep_reference=True, max_tokens=24)
        want = build_rl_batch(gen, torch.arange(8.0), 4, padded, 0)
        got = build_rl_batch(gen, torch.arange(8.0), 4, packed, 0)
    for key in ("old_log_probs", "ref_log_probs"):
        assert torch.equal(got[key], want[key]), key
    # routes (row t: position t-1's) at real positions; the padded batch routes its padding too
    real = torch.cat([torch.zeros_like(want["attention_mask"][:, :1]), want["attention_mask"][:, :-1]], 1).bool()
    assert torch.equal(got["train_routing"][real], want["train_routing"][real])
    assert (got["train_routing"][~real] == 0).all()
    assert want["old_log_probs"].abs().sum() > 0


@pytest.mark.parametrize("correction", [None, RolloutCorrection(level="sequence", mode="truncate", threshold=1.5)])
def test_packed_update_equals_padded_fp64(correction):
    with single_thread():
        # FP4 off in the update: an FP4 wgrad quantizes the output gradient in blocks along the token
        # dim, whose make-up depends on the micro-batch layout (padding tokens included), packed or not.
        trainers = [trainer_for("dtype=fp64", "numerics.invariance=standard", "fp4.train_mode=bf16")
                    for _ in range(2)]
        for t in trainers:
            switch_to_rl(t, 1e-3, 0.0, 0.0)
        gen = generation(1, 8)
        batch = build_rl_batch(gen, torch.tensor([1.0, 0.0, 2.0, 0.5, 0.0, 1.0, 3.0, 1.0]), 4,
                               PolicyScorer(trainers[0], 8, keep_reference=False), 0)
        batch["ref_log_probs"] = batch["old_log_probs"] - 0.1 * batch["response_mask"]
        loss = PolicyLoss(0.2, None if correction else 2.0, kl_coef=0.05, correction=correction)
        want = policy_update(trainers[0], batch, loss, micro_batch_size=8)  # one padded micro-batch
        got = policy_update(trainers[1], batch, loss, micro_batch_size=8, max_tokens=20)
    assert abs(got["loss"] - want["loss"]) <= 1e-12 and want["loss"] != 0
    assert abs(got["kl"] - want["kl"]) <= 1e-12
    a, b = (dict(t.model.named_parameters()) for t in trainers)
    assert max(float((a[n] - b[n]).detach().abs().max()) for n in a) <= 1e-3 * 1e-9


def test_packed_update_weighting_matters():
    """The check above can fail: packed micro-batches averaged without their token weights give another loss."""
    with single_thread():
        trainers = [trainer_for("dtype=fp64", "numerics.invariance=standard") for _ in range(2)]
        gen = generation(1, 8)
        batch = build_rl_batch(gen, torch.tensor([1.0, 0.0, 2.0, 0.5, 0.0, 1.0, 3.0, 1.0]), 4,
                               PolicyScorer(trainers[0], 8, keep_reference=False), 0)
        loss = PolicyLoss(0.2, 2.0)
        want = policy_update(trainers[0], batch, loss, micro_batch_size=8)

        class Unweighted(PolicyLoss):
            def loss(self, logits, mb):
                mb = {**mb, "token_weight": 1.0}
                return super().loss(logits, mb)
        got = policy_update(trainers[1], batch, Unweighted(0.2, 2.0), micro_batch_size=8, max_tokens=20)
    assert abs(got["loss"] - want["loss"]) > 1e-6


class LengthTask(ArithmeticTask):
    """Rewards that vary inside every group (the completion's length), so advantages are not 0."""

    def reward(self, item, completion: str) -> float:
        return float(len(completion))


def tiny_grpo(overrides: list, max_new_tokens: int):
    """Two steps of the GRPO loop (2 prompts × 4) on a tiny model with `overrides`: (run, trainer)."""
    task = LengthTask(eval_size=4, max_operand=9, ops="+", seed=0)
    cfg = load_config(str(default_config_path()), overrides + [f"model.vocab_size={task.tok.vocab_size}"])
    trainer = Trainer(cfg, build_data=False)
    switch_to_rl(trainer, 1e-2, 0.0, 0.0)
    settings = loop.GRPOSettings(steps=2, num_prompts=2, group_size=4, max_new_tokens=max_new_tokens,
                                 micro_batch_size=8, eval_every=0)
    rollout = make_rollout("engine", trainer, task.tok.pad_id, 1 << 20)
    try:
        return loop.run_grpo(trainer, task, rollout, settings), trainer
    finally:
        rollout.close()


def grpo_run(budget: int):
    run, trainer = tiny_grpo(TINY[:-1] + [f"rl.max_tokens_per_micro_batch={budget}"], 6)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trainer.model.parameters())).hexdigest()
    return [float(h["loss"]).hex() for h in run.history], digest


def test_grpo_with_packing_is_deterministic():
    with single_thread():
        first, second = grpo_run(24), grpo_run(24)
    assert first == second

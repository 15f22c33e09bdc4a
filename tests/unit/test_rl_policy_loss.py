"""The RL update: zero advantages move nothing, and the policy-loss gradient matches a float64
PPO-clip / REINFORCE reference (token mean over the response mask, truncated IS, log-prob of token t
taken from position t-1's logits)."""
import random
from pathlib import Path

import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.model.transformer import ModelOutput
from megatron_fp4.rl import PolicyScorer, build_rl_batch, policy_update, switch_to_rl
from megatron_fp4.rl.algo.is_correction import policy_loss
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.rollout import compute_log_probs, pad_prompt_response
from megatron_fp4.training.data import ArithmeticTokenizer, make_problem
from megatron_fp4.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TOK = ArithmeticTokenizer()
LOSS = PolicyLoss(clip_eps=0.2, tis_cap=2.0, kl_coef=0.0)


def tiny_trainer():
    cfg = load_config(str(default_config_path()),
                      ["logging.tensorboard_dir=null", "checkpoint.dir=null", "model.num_layers=2",
                       f"model.vocab_size={TOK.vocab_size}", "model.hidden_size=32", "model.num_heads=2",
                       "model.num_kv_heads=1", "model.moe_ffn_hidden_size=32", "model.num_experts=4"])
    return Trainer(cfg, build_data=False)


def rl_batch(trainer, advantages):
    rng = random.Random(0)
    prompts = [TOK.encode(make_problem(rng, 9, "+")[0], add_eos=False) for _ in range(4)]
    responses = [[5, 7, TOK.eos_id], [6], [3, 4], [8, 9, 10, 11, TOK.eos_id]]
    gen = type("Gen", (), {"prompt_ids": prompts, "response_ids": responses,
                           "log_probs": [torch.full((len(r),), -1.5) for r in responses]})()
    scorer = PolicyScorer(trainer, micro_batch_size=2, keep_reference=False)
    batch = build_rl_batch(gen, torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, scorer, TOK.pad_id)
    batch["advantages"] = advantages
    return batch


def test_zero_advantages_leave_weights_bit_identical():
    for weight_decay, expect_identical in ((0.0, True), (0.1, False)):
        trainer = tiny_trainer()
        for _ in range(2):  # a few SFT steps: Adam state, non-trivial weights
            trainer.train_step_with_loss([{"tokens": torch.randint(3, 18, (2, 16)),
                                           "labels": torch.randint(3, 18, (2, 16))}])
        switch_to_rl(trainer, lr=1e-3, weight_decay=weight_decay, aux_coef=0.0)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        batch = rl_batch(trainer, torch.zeros(4))
        for _ in range(3):
            result = policy_update(trainer, batch, LOSS, 2)
            assert result["grad_norm"] == 0.0 and not result["skipped"]
            assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())
        same = all(torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
        assert same == expect_identical, f"weight_decay={weight_decay}"
        if expect_identical:  # and nonzero advantages do move them
            policy_update(trainer, rl_batch(trainer, torch.tensor([1.0, -1.0, 1.0, -1.0])), LOSS, 2)
            assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())


def reference_logit_grad(logits, tokens, attention_mask, response_mask, old, rollout, adv, clip_eps, cap):
    """float64 by hand: d loss / d logits for loss = sum_t w_t * max(-A r_t, -A clip(r_t)) / N."""
    logits = logits.double()
    B, T, V = logits.shape
    n = float(response_mask.sum())
    grad = torch.zeros_like(logits)
    for b in range(B):
        for t in range(1, T):
            if not response_mask[b, t]:
                continue
            logp = torch.log_softmax(logits[b, t - 1], -1)  # token t is predicted at position t-1
            lp = logp[tokens[b, t]]
            r = torch.exp(lp - old[b, t].double())
            w = 1.0 if cap is None else min(float(torch.exp(old[b, t].double() - rollout[b, t].double())), cap)
            a = float(adv[b])
            unclipped, clipped = -a * r, -a * r.clamp(1 - clip_eps, 1 + clip_eps)
            in_range = 1 - clip_eps <= r <= 1 + clip_eps
            dloss_dlp = (-a * r if (in_range or unclipped > clipped) else 0.0) * w / n
            onehot = torch.zeros(V, dtype=torch.float64)
            onehot[tokens[b, t]] = 1.0
            grad[b, t - 1] += dloss_dlp * (onehot - logp.exp())  # d logp[tok] / d logits
    return grad


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits are a leaf parameter: the gradient is d loss / d logits."""

    fp4_mode = None

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, tokens, positions, attention_mask, return_routing=False):
        return ModelOutput(logits=self.logits)


def test_policy_loss_gradient_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    batch = pad_prompt_response(prompts, responses, pad_id=0)
    tokens, am, rm = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    B, T, V = tokens.shape[0], tokens.shape[1], 16
    logits0 = torch.randn(B, T, V, generator=g) * 2
    model = FixedLogits(logits0.clone())
    with torch.no_grad():
        cur = compute_log_probs(model, tokens, am, rm).log_probs
    # old log-probs spread so that ratios fall inside, above and below [1-eps, 1+eps]
    shift = torch.tensor([[0.0, 0, 0, 0.5, -0.5, 0.05, -0.05], [0, 0, 0, 0, 0, 0.4, -0.4]])[:, :T]
    old = (cur - shift) * rm
    rollout = (old + torch.randn(B, T, generator=g) * 0.8) * rm  # some TIS weights hit the cap
    for adv in (torch.tensor([1.3, -0.7]), torch.tensor([-2.0, 0.5])):
        for cap in (2.0, None):
            model.logits.grad = None
            lp = compute_log_probs(model, tokens, am, rm).log_probs
            loss, _ = policy_loss(lp, old, adv[:, None], rm, 0.2, rollout, cap)
            loss.backward()
            ref = reference_logit_grad(logits0, tokens, am, rm, old, rollout, adv, 0.2, cap)
            torch.testing.assert_close(model.logits.grad.double(), ref, rtol=1e-5, atol=1e-7)
            assert ref.abs().sum() > 0
    # REINFORCE limit: old == current log-probs, no IS: grad = -A * d logp / N
    model.logits.grad = None
    lp = compute_log_probs(model, tokens, am, rm).log_probs
    adv = torch.tensor([1.0, -1.0])
    policy_loss(lp, lp.detach(), adv[:, None], rm)[0].backward()
    ref = reference_logit_grad(logits0, tokens, am, rm, cur, cur, adv, 0.2, None)
    torch.testing.assert_close(model.logits.grad.double(), ref, rtol=1e-5, atol=1e-7)

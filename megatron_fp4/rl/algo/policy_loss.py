"""The GRPO/PPO policy loss as a training step's loss (`training.step_loss.StepLoss`), so it runs in
every layout: the model reads the micro-batch's tokens, positions and padding mask; the loss, on
the last pipeline stage when there is a pipeline, turns the logits into per-token log-probs and
applies the clipped surrogate with the rollout correction (`is_correction.policy_loss`: `tis_cap` for
token TIS, or any `RolloutCorrection` as `correction`) and, optionally, the k3 KL penalty to a frozen
reference policy (over the loss mask, i.e. without the tokens a rejection rule dropped, as verl).

A micro-batch is a dict of [B, T] tensors in verl's layout: ``input_ids``, ``attention_mask``,
``response_mask``, ``old_log_probs``, ``rollout_log_probs``, ``advantages`` [B] (and
``ref_log_probs`` when ``kl_coef`` is set; ``replay_routing`` [B, T, num_moe_layers, k] under router
replay, the model's ``routing_in``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_fp4.rl.algo.is_correction import (RolloutCorrection, check_clip_eps, policy_loss, resolve_correction,
                                                rollout_correction)
from megatron_fp4.model.packing import segment_positions
from megatron_fp4.rollout.scoring import log_probs_from_logits
from megatron_fp4.training.step_loss import StepLoss

BATCH_KEYS = ("input_ids", "attention_mask", "response_mask", "old_log_probs", "rollout_log_probs", "advantages")


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean k3 estimator of KL(pi || pi_ref) on the sampled tokens: exp(d) - d - 1, d = ref - lp."""
    d = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    k3 = d.exp() - d - 1
    m = mask.to(k3.dtype)
    return (k3 * m).sum() / m.sum().clamp(min=1.0)


@dataclass
class PolicyLoss(StepLoss):
    clip_eps: float = 0.2
    tis_cap: Optional[float] = 2.0
    kl_coef: float = 0.0
    correction: Optional[RolloutCorrection] = None  # set tis_cap=None with it

    def __post_init__(self):
        resolve_correction(self.tis_cap, self.correction)  # both set, or a bad cap: a ValueError here
        check_clip_eps(self.clip_eps)
        if not 0 <= self.kl_coef < float("inf"):
            raise ValueError(f"PolicyLoss.kl_coef={self.kl_coef!r} must be a finite number >= 0 (0: no KL term)")

    @property
    def batch_keys(self) -> tuple:
        """The per-sample tensors a micro-batch must carry."""
        return BATCH_KEYS + (("ref_log_probs",) if self.kl_coef else ())

    def model_inputs(self, mb: dict) -> dict:
        am = mb["attention_mask"]
        inputs = {"tokens": mb["input_ids"], "positions": segment_positions(am), "attention_mask": am}
        if mb.get("replay_routing") is not None:  # router replay (rl/algo/replay.py): the routes to use
            inputs["routing_in"] = mb["replay_routing"]
        return inputs

    def corrections(self, batch: dict) -> dict:
        """The rollout correction of a padded batch as per-token tensors (``loss_mask``, ``is_weights``
        when the correction weights), for packed micro-batches: sequence-level statistics need one
        sequence per row."""
        correction = resolve_correction(self.tis_cap, self.correction)
        if correction is None:
            return {"loss_mask": batch["response_mask"]}
        weights, mask, _ = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"],
                                              batch["response_mask"], correction)
        return {"loss_mask": mask} if weights is None else {"loss_mask": mask, "is_weights": weights}

    def loss(self, logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        """A padded micro-batch: its token-mean. A packed one (``token_slots``, `rl.algo.grpo.packed_updates`):
        per-token advantages and corrections, and its token-mean times ``token_weight`` (its share of
        the minibatch's loss tokens), so the step's loss is the token-mean over the whole minibatch."""
        lp, _ = log_probs_from_logits(logits, mb["input_ids"], mb["response_mask"])
        packed = "token_slots" in mb
        advantages = mb["advantages"] if packed else mb["advantages"][:, None]
        corrected = (mb.get("is_weights"), mb["loss_mask"]) if packed else None
        loss, metrics = policy_loss(lp, mb["old_log_probs"], advantages, mb["response_mask"],
                                    self.clip_eps, mb["rollout_log_probs"], self.tis_cap, self.correction, corrected)
        if self.kl_coef:
            mask = mb["response_mask"]
            if packed:
                mask = mb["loss_mask"]
            elif self.correction is not None and self.correction.rejection:
                mask = rollout_correction(mb["old_log_probs"], mb["rollout_log_probs"], mask, self.correction)[1]
            kl = kl_k3(lp, mb["ref_log_probs"], mask)
            loss, metrics = loss + self.kl_coef * kl, {**metrics, "kl": float(kl.detach())}
        if packed:
            weight = mb["token_weight"]
            loss, metrics = loss * weight, {k: v * weight for k, v in metrics.items()}
        return loss, metrics

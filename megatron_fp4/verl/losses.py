"""A verl-style policy loss (`loss_function(model_output, data, dp_group)`) with the rollout-vs-train
truncated IS correction as an option: per token min(pi_old / pi_rollout, tis_cap)."""
from __future__ import annotations

from typing import Optional

from megatron_fp4.rl.algo.is_correction import policy_loss


def make_policy_loss_fn(clip_eps: float = 0.2, tis_cap: Optional[float] = 2.0):
    """Loss for `MegatronFP4Engine.train_batch`. Reads `old_log_probs`, `advantages` ([B, R], or [B]
    per sequence), `response_mask` and, when `tis_cap` is set, `rollout_log_probs` from the batch."""

    def loss_function(model_output, data, dp_group=None):
        log_probs = model_output["log_probs"]
        adv = data["advantages"]
        if adv.dim() == 1:
            adv = adv[:, None]
        rollout = data["rollout_log_probs"] if tis_cap is not None else None
        loss, metrics = policy_loss(log_probs, data["old_log_probs"], adv, data["response_mask"], clip_eps,
                                    rollout, tis_cap)
        return loss, {f"actor/{k}": v for k, v in metrics.items()}

    return loss_function

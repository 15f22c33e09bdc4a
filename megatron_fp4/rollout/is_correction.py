"""Rollout-vs-training importance-sampling correction and the clipped policy-gradient loss.

The rollout sampled tokens from pi_rollout (FP4 inference numerics) but the update is computed for
pi_old (the training-side recomputation). Truncated IS (TIS, Yao et al. 2025; verl's
`rollout_is`) reweights each token by min(pi_old / pi_rollout, C), detached, which bounds the
variance that a rare large mismatch would otherwise add.
"""
from __future__ import annotations

from typing import Optional

import torch


def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """min(exp(old - rollout), cap), detached, in fp32. `cap` is the clip C (> 0)."""
    if not cap > 0:
        raise ValueError(f"truncated IS cap={cap!r} must be > 0 (typical values are 2 to 5)")
    log_ratio = (old_log_probs.detach().float() - rollout_log_probs.detach().float()).clamp(max=20.0)
    return log_ratio.exp().clamp(max=cap)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_eps: float = 0.2, rollout_log_probs: Optional[torch.Tensor] = None,
                tis_cap: Optional[float] = None) -> tuple:
    """PPO/GRPO clipped surrogate, token-mean over the response mask, optionally multiplied per
    token by `truncated_is_weights(old_log_probs, rollout_log_probs, tis_cap)`.
    All tensors [B, T]; advantages broadcast per token. Returns (loss, metrics dict)."""
    ratio = torch.exp((log_probs - old_log_probs.detach()).clamp(-20.0, 20.0))
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    metrics = {"clipfrac": float(masked_mean(((ratio - 1).abs() > clip_eps).float(), response_mask))}
    if tis_cap is not None:
        if rollout_log_probs is None:
            raise ValueError("tis_cap is set but rollout_log_probs is None; pass the rollout's log-probs or tis_cap=None")
        weights = truncated_is_weights(old_log_probs, rollout_log_probs, tis_cap)
        surrogate = surrogate * weights
        metrics["tis_weight_mean"] = float(masked_mean(weights, response_mask))
    loss = masked_mean(surrogate, response_mask)
    metrics["pg_loss"] = float(loss.detach())
    return loss, metrics

"""Rollout-vs-training consistency metrics (the MoEResQ paper's diagnostics).

For the tokens the rollout generated, compare what the rollout engine reported with what the
training side recomputes for the same tokens:

- pearson: correlation of the token log-probs (paper: FP4 0.941 -> MoEResQ 0.994)
- mean_abs_diff / max_abs_diff of the token log-probs
- expert_agreement: fraction of (token, MoE layer) pairs whose top-k expert *sets* agree
- kl: mean over tokens of KL(rollout || train) of the next-token distributions; exact when both
  full distributions are given, else the unbiased k3 estimator E[r - 1 - log r], r = p_train/p_roll
  on the rollout's own tokens (Schulman's estimator; the tokens were sampled from the rollout).

All statistics are computed in float64 from flattened per-token values.

`compute_log_probs`/`score` (the trainer-side recomputation) live in `rollout.scoring` and are
re-exported here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_fp4.rollout.scoring import ScoreOutput, compute_log_probs, score

__all__ = ["consistency_metrics", "compare_generation", "compute_log_probs", "score", "ScoreOutput", "pearson"]


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation in float64; nan when either side is constant."""
    x, y = x.double().flatten(), y.double().flatten()
    xc, yc = x - x.mean(), y - y.mean()
    denom = (xc.pow(2).sum() * yc.pow(2).sum()).sqrt()
    return float((xc * yc).sum() / denom) if denom > 0 else float("nan")


def expert_agreement(routing_a: torch.Tensor, routing_b: torch.Tensor) -> float:
    """routing [N, L, k] expert ids -> fraction of (token, layer) pairs with the same k-set."""
    if routing_a.shape != routing_b.shape:
        raise ValueError(f"routing shapes differ: {tuple(routing_a.shape)} vs {tuple(routing_b.shape)}; "
                         "compare the same tokens and MoE layers on both sides")
    same = (routing_a.sort(-1).values == routing_b.sort(-1).values).all(-1)
    return float(same.double().mean()) if same.numel() else float("nan")


def kl_exact(rollout_dist: torch.Tensor, train_dist: torch.Tensor) -> float:
    """Mean over tokens of KL(p_rollout || p_train); inputs are log-prob rows [N, V]."""
    p = rollout_dist.double()
    return float((p.exp() * (p - train_dist.double())).sum(-1).mean())


def kl_k3(rollout_lp: torch.Tensor, train_lp: torch.Tensor) -> float:
    """k3 estimate of KL(rollout || train) from token log-probs sampled under the rollout."""
    log_r = train_lp.double() - rollout_lp.double()
    return float((log_r.exp() - 1.0 - log_r).mean())


def consistency_metrics(rollout_lp: torch.Tensor, train_lp: torch.Tensor,
                        rollout_routing: Optional[torch.Tensor] = None, train_routing: Optional[torch.Tensor] = None,
                        rollout_dist: Optional[torch.Tensor] = None, train_dist: Optional[torch.Tensor] = None) -> dict:
    """Metrics over N generated tokens: lp [N], routing [N, L, k], dist [N, V] (raw log-softmax)."""
    if rollout_lp.shape != train_lp.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(rollout_lp.shape)} vs {tuple(train_lp.shape)}; "
                         "score exactly the tokens the rollout generated")
    diff = (rollout_lp.double() - train_lp.double()).abs()
    out = {"num_tokens": int(rollout_lp.numel()), "pearson": pearson(rollout_lp, train_lp),
           "mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max())}
    if rollout_routing is not None and train_routing is not None:
        out["expert_agreement"] = expert_agreement(rollout_routing, train_routing)
    if rollout_dist is not None and train_dist is not None:
        out["kl"], out["kl_method"] = kl_exact(rollout_dist, train_dist), "exact"
    else:
        out["kl"], out["kl_method"] = kl_k3(rollout_lp, train_lp), "k3"
    return out


def _cat(xs: Sequence) -> Optional[torch.Tensor]:
    return torch.cat(list(xs)) if xs and xs[0] is not None else None


def compare_generation(generation, model, pad_id: int = 0, mode: Optional[str] = None) -> dict:
    """Score a `GenerationOutput` with `model` in the training-side `mode` (one padded full-sequence
    forward) and return `consistency_metrics` over all its generated tokens."""
    want_routing = generation.routing is not None
    want_dist = generation.distributions is not None
    train = score(model, generation.prompt_ids, generation.response_ids, pad_id, mode, want_routing, want_dist)
    return consistency_metrics(_cat(generation.log_probs), _cat(train["log_probs"]),
                               _cat(generation.routing) if want_routing else None, _cat(train["routing"]),
                               _cat(generation.distributions) if want_dist else None, _cat(train["distributions"]))

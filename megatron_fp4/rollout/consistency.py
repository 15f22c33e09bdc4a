"""Rollout-vs-training consistency metrics (the MoEResQ paper's diagnostics).

For the tokens the rollout generated, compare what the rollout engine reported with what the
training side recomputes for the same tokens:

- pearson: correlation of the token log-probs (paper: FP4 0.941 -> MoEResQ 0.994)
- mean_abs_diff / max_abs_diff of the token log-probs
- expert_agreement: fraction of (token, MoE layer) pairs whose top-k expert *sets* agree
- kl: mean over tokens of KL(rollout || train) of the next-token distributions; exact when both
  full distributions are given, else the unbiased k3 estimator E[r - 1 - log r], r = p_train/p_roll
  on the rollout's own tokens (Schulman's estimator; the tokens were sampled from the rollout).
  `rescore` also returns it per request (``kl_per_request``: each request's summed per-token KL,
  ``tokens_per_request``), for the standard error of the KL by resampling requests
  (`kl_bootstrap`) and an ordering of settings decided beyond that noise (`kl_order`).

All statistics are computed in float64 from flattened per-token values. `rescore` (the trainer
re-scores a rollout's tokens, batched its own way) and `compare_generation` give them for a
generation; `router_margins` measures how close the routers' choices are to flipping;
`add_engine_noise` models an engine gap (tools/consistency_report.py).

The trainer-side recomputation is `rollout.scoring.score` (a bare model: `TokenLogProbs` on one
micro-batch); on a parallel layout the Trainer scores (`rl.algo.scorer.PolicyScorer`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_fp4.rollout.scoring import score

__all__ = ["consistency_metrics", "compare_generation", "rescore", "router_margins", "add_engine_noise",
           "pearson", "kl_tokens", "kl_bootstrap", "kl_order"]


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
    return float(kl_tokens(None, None, rollout_dist, train_dist).mean())


def kl_k3(rollout_lp: torch.Tensor, train_lp: torch.Tensor) -> float:
    """k3 estimate of KL(rollout || train) from token log-probs sampled under the rollout."""
    return float(kl_tokens(rollout_lp, train_lp).mean())


def kl_tokens(rollout_lp: Optional[torch.Tensor], train_lp: Optional[torch.Tensor],
              rollout_dist: Optional[torch.Tensor] = None, train_dist: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token KL(rollout || train) [N], float64: exact from the log-prob rows [N, V] when both
    distributions are given, else the k3 term r - 1 - log r of each sampled token's log-probs [N]."""
    if rollout_dist is not None and train_dist is not None:
        p = rollout_dist.double()
        return (p.exp() * (p - train_dist.double())).sum(-1)
    log_r = train_lp.double() - rollout_lp.double()
    return log_r.exp() - 1.0 - log_r


def kl_bootstrap(kl_sums: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]], resamples: int = 2000,
                 seed: int = 0) -> torch.Tensor:
    """[resamples, settings] bootstrap replicates of each setting's KL (summed KL / tokens over the
    requests), resampling whole requests (their tokens are not independent: a diverged prefix
    carries on) with the same request indices for every setting: the settings ran the same prompts
    and sampling seeds, so differences between them are paired. `kl_sums[s][i]`, `tokens[s][i]`:
    setting s, request i (`rescore`'s ``kl_per_request`` / ``tokens_per_request``)."""
    sums = torch.tensor(kl_sums, dtype=torch.float64)
    counts = torch.tensor(tokens, dtype=torch.float64)
    if sums.dim() != 2 or sums.shape != counts.shape or sums.shape[1] < 2 or resamples < 1:
        raise ValueError(f"kl_bootstrap: want [settings, requests >= 2] sums and token counts of one shape and "
                         f"resamples >= 1, got {tuple(sums.shape)} / {tuple(counts.shape)}, {resamples}")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, sums.shape[1], (resamples, sums.shape[1]), generator=gen)
    return (sums[:, idx].sum(-1) / counts[:, idx].sum(-1).clamp_min(1)).T


def kl_order(replicates: torch.Tensor, level: float = 0.95) -> list:
    """For each neighbouring pair (s, s+1) of settings in `kl_bootstrap`'s replicates: '<' when the
    central `level` percentile interval of the paired difference KL(s+1) - KL(s) lies above 0, '>'
    when it lies below, '?' (unresolved: the difference is within the sampling noise) otherwise."""
    diff = replicates[:, 1:] - replicates[:, :-1]
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(diff, tail, dim=0), torch.quantile(diff, 1.0 - tail, dim=0)
    return ["<" if a > 0 else ">" if b < 0 else "?" for a, b in zip(lo.tolist(), hi.tolist())]


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
    exact = rollout_dist is not None and train_dist is not None
    out["kl"] = float(kl_tokens(rollout_lp, train_lp, rollout_dist, train_dist).mean())
    out["kl_method"] = "exact" if exact else "k3"
    return out


def _cat(xs: Sequence) -> Optional[torch.Tensor]:
    return torch.cat([x.float() if x.is_floating_point() else x for x in xs]) if xs and xs[0] is not None else None


def rescore(model, rollout: dict, pad_id: int, mode: Optional[str] = None, invariance: str = "batch",
            batch_size: Optional[int] = None, reverse: bool = False) -> dict:
    """`consistency_metrics` of a rollout (`rollout`: per request ``prompt_ids``, ``response_ids``,
    ``log_probs`` and optionally ``routing``, ``distributions``) against `model` re-scoring its
    tokens in the training-side `mode`: in batches of `batch_size` (default: one forward), in
    reverse request order with `reverse` (other batch composition and padding than the rollout's)."""
    n = len(rollout["prompt_ids"])
    want_routing, want_dist = rollout.get("routing") is not None, rollout.get("distributions") is not None
    order = list(range(n))[::-1] if reverse else list(range(n))
    step = batch_size or max(n, 1)
    train = {"log_probs": [None] * n, "routing": [None] * n, "distributions": [None] * n}
    for s in range(0, n, step):
        idx = order[s:s + step]
        out = score(model, [rollout["prompt_ids"][i] for i in idx], [rollout["response_ids"][i] for i in idx], pad_id,
                    mode, return_routing=want_routing, return_distributions=want_dist, invariance=invariance)
        for j, i in enumerate(idx):
            for k in train:
                train[k][i] = out[k][j]
    out = consistency_metrics(_cat(rollout["log_probs"]), _cat(train["log_probs"]),
                              _cat(rollout["routing"]) if want_routing else None, _cat(train["routing"]),
                              _cat(rollout["distributions"]) if want_dist else None, _cat(train["distributions"]))
    per = [kl_tokens(rollout["log_probs"][i], train["log_probs"][i], *((rollout["distributions"][i],
                     train["distributions"][i]) if want_dist else ())) for i in range(n)]
    out["kl_per_request"], out["tokens_per_request"] = [float(k.sum()) for k in per], [int(k.numel()) for k in per]
    return out


def compare_generation(generation, model, pad_id: int = 0, mode: Optional[str] = None) -> dict:
    """Score a `GenerationOutput` with `model` in the training-side `mode` (one padded full-sequence
    forward) and return `consistency_metrics` over all its generated tokens."""
    return rescore(model, {k: getattr(generation, k) for k in
                           ("prompt_ids", "response_ids", "log_probs", "routing", "distributions")}, pad_id, mode)


def router_margins(probs: torch.Tensor, top_k: int) -> dict:
    """Router statistics of probability rows [N, E]: normalized entropy (1 = uniform), top-k mass and
    the margin p_(k) - p_(k+1) between the last chosen and the first rejected expert (a tiny input
    change flips the choice only when the margin is tiny)."""
    p = probs.double()
    top = p.sort(-1, descending=True).values
    margin = top[:, top_k - 1] - top[:, top_k]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1) / torch.log(torch.tensor(float(p.shape[-1])))
    return {"num_router_rows": int(p.shape[0]), "normalized_entropy": float(entropy.mean()),
            "topk_mass": float(top[:, :top_k].sum(-1).mean()), "median_margin": float(margin.median()),
            "frac_margin_lt_1e-2": float((margin < 1e-2).double().mean()),
            "frac_margin_lt_1e-3": float((margin < 1e-3).double().mean())}


def add_engine_noise(model, eps: float, seed: int) -> list:
    """Forward pre-hooks adding EPS · rms(h) · N(0, 1) (seeded) to every decoder layer's input h.
    Synthetic: a stand-in for kernel/accumulation-order differences between engines. Returns the
    hook handles (``remove()`` them)."""
    gen = torch.Generator().manual_seed(seed)

    def hook(_module, inputs):
        h = inputs[0]
        rms = h.float().pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.randn(h.shape, generator=gen) * rms * eps
        return (h + noise.to(h.dtype),) + tuple(inputs[1:])

    return [layer.register_forward_pre_hook(hook) for layer in model.layers]

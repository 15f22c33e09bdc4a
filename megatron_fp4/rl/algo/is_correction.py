"""Rollout correction (verl's `algorithm.rollout_correction`) and the clipped policy-gradient loss.

The rollout sampled tokens from pi_rollout (FP4 inference numerics) but the update is computed for
pi_old (the training-side recomputation). With log r = log pi_old - log pi_rollout per token:

- IS weights (`RolloutCorrection.level`): per token r, or per sequence prod r = exp(sum log r) over
  the response, exp of log r clamped to [-20, 20]; `mode="truncate"` is TIS (min(w, threshold), Yao
  et al. 2025), `mode="mask"` is MIS / IcePop (w where lower <= w <= threshold, else 0). Detached.
- Rejection (`Rejection`, verl's `rollout_rs`): drop tokens or whole sequences whose divergence
  statistic (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r; per token, or per sequence sum,
  mean or max) is outside its bound, by zeroing them in the loss mask.
- Mismatch metrics (`mismatch_metrics`): verl's `compute_offpolicy_metrics` (k1 and k3 KL, PPL,
  PPL ratio, chi^2).

Every formula is verl 0.9.1's `trainer/ppo/rollout_corr_helper.py`, op for op (so float32 inputs give
verl's bits; tests/unit/test_rollout_correction.py runs both). The policy losses that apply it are
`rl.algo.policy_loss.PolicyLoss` and the verl adapter's loss; `megatron_fp4.rl.algo.rollout_correction` adds the
batch-level step and verl's config fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

SAFETY_BOUND = 20.0  # verl's: exp of a log-ratio is taken on [-20, 20]
LEVELS = (None, "token", "sequence")
MODES = ("truncate", "mask")
REJECTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return float(value)


def _bounds(owner: str, threshold, lower) -> None:
    _positive(f"{owner}.threshold", threshold)
    if lower is not None and _positive(f"{owner}.lower_threshold", lower) > threshold:
        raise ValueError(f"{owner}.lower_threshold={lower!r} must be <= threshold={threshold!r}")


@dataclass(frozen=True)
class Rejection:
    """One verl `rollout_rs` option: keep a token/sequence while its statistic is in bounds. For k1
    the bounds are on the ratio, [lower_threshold, threshold] (lower defaults to 1 / threshold, as
    verl's single-float spec); for k2/k3 the statistic must be <= threshold (no lower bound)."""
    option: str
    threshold: float
    lower_threshold: Optional[float] = None

    def __post_init__(self):
        if self.option not in REJECTIONS:
            raise ValueError(f"Rejection.option={self.option!r} must be one of {', '.join(REJECTIONS)}")
        if self.option.endswith("k1"):
            lower = 1.0 / _positive("Rejection.threshold", self.threshold) if self.lower_threshold is None \
                else self.lower_threshold
            _bounds("Rejection", self.threshold, lower)
        elif self.lower_threshold is not None:
            raise ValueError(f"Rejection.lower_threshold applies to the k1 options only, not {self.option!r}")
        else:
            _positive("Rejection.threshold", self.threshold)

    @property
    def lower(self) -> Optional[float]:
        if not self.option.endswith("k1"):
            return None
        return 1.0 / float(self.threshold) if self.lower_threshold is None else float(self.lower_threshold)


@dataclass(frozen=True)
class RolloutCorrection:
    """level: None (no IS weights), "token" or "sequence". mode: "truncate" (TIS: min(w, threshold))
    or "mask" (MIS: w inside [lower_threshold, threshold], else 0; no lower bound when None).
    rejection: `Rejection` rules, all of which a token must pass to stay in the loss."""
    level: Optional[str] = "token"
    mode: str = "truncate"
    threshold: float = 2.0
    lower_threshold: Optional[float] = None
    rejection: tuple = ()

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"RolloutCorrection.level={self.level!r} must be 'token', 'sequence' or None")
        if self.mode not in MODES:
            raise ValueError(f"RolloutCorrection.mode={self.mode!r} must be 'truncate' or 'mask'")
        if self.mode == "truncate" and self.lower_threshold is not None:
            raise ValueError("RolloutCorrection.lower_threshold applies to mode='mask' only (truncation has no "
                             "lower bound); drop it or set mode='mask'")
        _bounds("RolloutCorrection", self.threshold, self.lower_threshold)
        if not isinstance(self.rejection, tuple) or not all(isinstance(r, Rejection) for r in self.rejection):
            raise ValueError(f"RolloutCorrection.rejection={self.rejection!r} must be a tuple of Rejection")
        options = [r.option for r in dict.fromkeys(self.rejection)]
        if len(options) != len(set(options)):
            raise ValueError(f"RolloutCorrection.rejection has one option twice with different thresholds "
                             f"({', '.join(options)}); keep one rule per option")

    @classmethod
    def tis(cls, cap: float) -> "RolloutCorrection":
        """Token-level truncated IS with clip C (the `tis_cap` shorthand)."""
        return cls(level="token", mode="truncate", threshold=_positive("tis_cap (truncated IS cap)", cap))


def _msum(x: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    return (torch.where(mask.bool(), x, 0.0) * mask).sum(axis)


def _mmean(x: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """verl's masked mean (values outside the mask never reach the sum)."""
    return _msum(x, mask, axis) / (mask.sum(axis) + 1e-8)


def log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor) -> torch.Tensor:
    """log pi_old - log pi_rollout, detached, in at least fp32."""
    dtype = torch.promote_types(torch.promote_types(old_log_probs.dtype, rollout_log_probs.dtype), torch.float32)
    return old_log_probs.detach().to(dtype) - rollout_log_probs.detach().to(dtype)


def is_weights(lr: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrection) -> tuple:
    """(applied weights, raw weights, log-ratio the level aggregates): verl's
    `compute_rollout_correction_weights`, 0 outside the mask."""
    if cfg.level == "token":
        level_lr = lr
        raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        level_lr = _msum(lr, mask, -1).unsqueeze(-1)
        raw = torch.exp(level_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(lr)
    raw = torch.where(mask.bool(), raw, 0.0)
    if cfg.mode == "truncate":
        return raw.clamp(max=cfg.threshold), raw, level_lr
    keep = raw <= cfg.threshold
    if cfg.lower_threshold is not None:
        keep = keep & (raw >= cfg.lower_threshold)
    return torch.where(keep, raw, torch.zeros_like(raw)), raw, level_lr


def _sequence_stat(stat: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    if how == "sum":
        return _msum(stat, mask, -1)
    if how == "mean":
        return _mmean(stat, mask, -1)
    mx = stat.masked_fill(~mask.bool(), float("-inf")).max(-1).values
    return torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)


def rejection_mask(lr: torch.Tensor, mask: torch.Tensor, rules: tuple) -> tuple:
    """(keep [B, T] in lr's dtype, {option: (its keep, per-token statistic, per-sequence one or None)}):
    verl's `compute_rollout_rejection_mask`."""
    safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": lambda: -safe, "k2": lambda: 0.5 * safe ** 2, "k3": lambda: torch.exp(safe) - 1.0 - safe}
    keep, per_rule = torch.ones_like(lr), {}
    for rule in dict.fromkeys(rules):  # verl drops repeated options
        where, kind = rule.option.rsplit("_", 1)
        stat = seq_stat = stats[kind]()
        if where != "token":
            seq_stat = _sequence_stat(stat, mask, where.split("_")[1])
        if kind == "k1":
            ok = (seq_stat >= math.log(rule.lower)) & (seq_stat <= math.log(rule.threshold))
        else:
            ok = seq_stat <= rule.threshold
        if where == "token":
            per_rule[rule.option] = (ok.to(lr.dtype), stat, None)
        else:
            per_rule[rule.option] = (ok.unsqueeze(-1).expand_as(lr).to(lr.dtype), seq_stat.unsqueeze(-1).expand_as(lr),
                                     seq_stat)
        keep = keep * per_rule[rule.option][0]
    return keep, per_rule


def _clamped_std(x, mask, lo, hi) -> float:
    """verl's spread statistic: the masked std of x clamped to [lo, hi] (0 for at most one token)."""
    if mask.sum() <= 1:
        return 0.0
    c = x.clamp(min=lo, max=hi)
    return torch.sqrt(torch.clamp(_mmean(c.square(), mask) - _mmean(c, mask).square(), min=0.0)).item()


def _seq_summary(prefix: str, seq, ideal: float) -> dict:
    return {f"{prefix}_seq_mean": seq.mean().item(), f"{prefix}_seq_std": seq.std().item() if seq.numel() > 1 else 0.0,
            f"{prefix}_seq_max": seq.max().item(), f"{prefix}_seq_min": seq.min().item(),
            f"{prefix}_seq_max_deviation": (seq - ideal).abs().max().item()}


def _masked_extremes(x, mask) -> tuple:
    pad = ~mask.bool()
    return x.masked_fill(pad, float("-inf")).max().item(), x.masked_fill(pad, float("inf")).min().item()


def _is_metrics(w, raw, level_lr, mask, cfg: RolloutCorrection) -> dict:
    """verl's `compute_is_metrics`: weight mean/max/min/std, threshold fractions, effective sample size,
    per-sequence summaries."""
    upper, lower = cfg.threshold, 1.0 / cfg.threshold if cfg.lower_threshold is None else cfg.lower_threshold
    m = {"rollout_is_mean": _mmean(w, mask).item()}
    if cfg.level == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(level_lr.max(), max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(level_lr.min()).item()
        m["rollout_is_ratio_fraction_high"] = (level_lr > torch.log(torch.tensor(upper))).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (level_lr < torch.log(torch.tensor(lower))).float().mean().item()
    else:
        m["rollout_is_max"], m["rollout_is_min"] = _masked_extremes(w, mask)
        m["rollout_is_ratio_fraction_high"] = _mmean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = _mmean((raw < lower).float(), mask).item()
    m["rollout_is_std"] = _clamped_std(w, mask, 0.0, upper)
    w_ess = w.clamp(min=0.0, max=upper)
    second_moment = _mmean((w_ess / (_mmean(w_ess, mask) + 1e-8)).square(), mask).item()
    m["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment else 0.0  # verl: ZeroDivisionError
    m.update(_seq_summary("rollout_is", _mmean(w, mask, -1), 1.0))
    raw_seq = _mmean(raw, mask, -1)
    m["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq < lower).float().mean().item()
    if cfg.mode == "mask":  # the fraction of tokens whose weight was masked to 0
        out = raw > upper if cfg.lower_threshold is None else (raw < cfg.lower_threshold) | (raw > upper)
        m["rollout_is_oob_ratio"] = _mmean(out.float(), mask).item()
    return m


def _rule_metrics(rule: Rejection, stat, seq_stat, mask) -> dict:
    """verl's `compute_rs_metrics` for one option (the statistic's mean/max/min/std, fractions out of
    bounds, per-sequence summaries); k1 bounds in log space."""
    k1, p = rule.option.endswith("k1"), f"rollout_rs_{rule.option}"
    upper, lower = (math.log(rule.threshold), math.log(rule.lower)) if k1 else (rule.threshold, 0.0)
    seq = (seq_stat if seq_stat is not None else _mmean(stat, mask, -1))[mask.sum(-1) > 0]
    m = {f"{p}_mean": _mmean(stat, mask).item()}
    if seq_stat is not None and seq.numel():
        m[f"{p}_max"], m[f"{p}_min"] = seq.max().item(), seq.min().item()
        m[f"{p}_fraction_high"] = (seq > upper).float().mean().item()
        m[f"{p}_fraction_low"] = (seq < lower).float().mean().item() if k1 else 0.0
    else:
        m[f"{p}_max"], m[f"{p}_min"] = _masked_extremes(stat, mask)
        m[f"{p}_fraction_high"] = _mmean((stat > upper).float(), mask).item()
        m[f"{p}_fraction_low"] = _mmean((stat < lower).float(), mask).item() if k1 else 0.0
    m[f"{p}_std"] = _clamped_std(stat, mask, lower, upper)
    if not seq.numel():
        return {**m, **{f"{p}_seq_{k}": 0.0 for k in ("mean", "std", "max", "min", "max_deviation",
                                                        "fraction_high", "fraction_low")}}
    m.update(_seq_summary(p, seq, 0.0))
    m[f"{p}_seq_fraction_high"] = (seq > upper).float().mean().item()
    if k1:
        m[f"{p}_seq_fraction_low"] = (seq < lower).float().mean().item()
    return m


def _rs_metrics(keep, per_rule, rules, mask) -> dict:
    """verl's rejection metrics: per rule its statistic and the fractions of response tokens and of
    sequences it drops; then those of all rules together."""
    m, valid = {}, mask.bool()
    has_tokens = (mask.sum(-1) > 0).float()
    for rule in dict.fromkeys(rules):
        ok, stat, seq_stat = per_rule[rule.option]
        m.update(_rule_metrics(rule, stat, seq_stat, mask))
        m[f"rollout_rs_{rule.option}_masked_fraction"] = _mmean(1 - ok, mask).item()
        seq_keep = (~((ok <= 0.5) & valid)).all(-1).to(ok.dtype)  # verl: ~(~keep & valid), keep boolean
        seq_dropped = ((1.0 - seq_keep) * has_tokens).sum() / has_tokens.sum() if has_tokens.sum() > 0 else 0.0
        m[f"rollout_rs_{rule.option}_seq_masked_fraction"] = float(seq_dropped)
    m["rollout_rs_masked_fraction"] = _mmean(1 - keep, mask).item()
    m["rollout_rs_seq_masked_fraction"] = (~((keep > 0.5) & valid) & valid).any(-1).float().mean().item()
    return m


def mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> dict:
    """verl's `compute_offpolicy_metrics`: kl = E[log pi_rollout - log pi_old] (k1), k3_kl = E[r - log r - 1],
    per-sequence PPLs and their log difference / ratio (batch means), chi^2 per token and per sequence."""
    old, roll = old_log_probs.detach(), rollout_log_probs.detach()
    mean_old, mean_roll = _mmean(old, mask, -1), _mmean(roll, mask, -1)
    lr = old - roll
    diff = mean_roll - mean_old
    seq_lr = _msum(lr, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"training_ppl": torch.exp(-mean_old).mean().item(), "training_log_ppl": (-mean_old).mean().item(),
            "kl": _mmean(roll - old, mask).item(), "k3_kl": _mmean(torch.exp(lr) - lr - 1, mask).item(),
            "rollout_ppl": torch.exp(-mean_roll).mean().item(), "rollout_log_ppl": (-mean_roll).mean().item(),
            "log_ppl_diff": diff.mean().item(), "log_ppl_abs_diff": diff.abs().mean().item(),
            "log_ppl_diff_max": diff.max().item(), "log_ppl_diff_min": diff.min().item(),
            "ppl_ratio": torch.exp(diff).mean().item(),
            "chi2_token": (_mmean(torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0).item(),
            "chi2_seq": (torch.exp(2.0 * seq_lr).mean() - 1.0).item()}


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       cfg: RolloutCorrection, metrics: bool = False) -> tuple:
    """(IS weights [B, T] or None when cfg.level is None, the loss mask after rejection [B, T] in
    response_mask's dtype, metrics dict (verl's names, empty unless `metrics`)). The one rollout
    correction: every level, mode and rejection rule; weights use the mask before rejection, as verl's."""
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(f"rollout correction: old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs "
                         f"{tuple(rollout_log_probs.shape)} and response_mask {tuple(response_mask.shape)} must match")
    lr = log_ratio(old_log_probs, rollout_log_probs)
    weights, out = None, {}
    if cfg.level is not None:
        weights, raw, level_lr = is_weights(lr, response_mask, cfg)
        if metrics:
            out.update(_is_metrics(weights, raw, level_lr, response_mask, cfg))
    loss_mask = response_mask
    if cfg.rejection:
        keep, per_rule = rejection_mask(lr, response_mask, cfg.rejection)
        loss_mask = (response_mask * keep).to(response_mask.dtype)
        if metrics:
            out.update(_rs_metrics(keep, per_rule, cfg.rejection, response_mask))
    if metrics:
        out.update(mismatch_metrics(old_log_probs, rollout_log_probs, response_mask))
    return weights, loss_mask, out


def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                         cap: float = 2.0) -> torch.Tensor:
    """min(exp(old - rollout), cap), detached, in at least fp32 (log-ratio clamped to [-20, 20]):
    `rollout_correction` with `RolloutCorrection.tis(cap)` on every position."""
    cfg = RolloutCorrection.tis(cap)
    return rollout_correction(old_log_probs, rollout_log_probs, torch.ones_like(old_log_probs, dtype=torch.bool),
                              cfg)[0]


def resolve_correction(tis_cap: Optional[float],
                       correction: Optional[RolloutCorrection]) -> Optional[RolloutCorrection]:
    """The correction a loss applies: `correction`, or the `tis_cap` shorthand; never both."""
    if tis_cap is not None and correction is not None:
        raise ValueError(f"tis_cap={tis_cap!r} and correction are both set; tis_cap=C is shorthand for "
                         "RolloutCorrection.tis(C), so pass tis_cap=None with a correction")
    if correction is not None and not isinstance(correction, RolloutCorrection):
        raise ValueError(f"correction={correction!r} must be a RolloutCorrection")
    return RolloutCorrection.tis(tis_cap) if tis_cap is not None else correction


def check_clip_eps(clip_eps) -> float:
    """`clip_eps` if it is a finite number > 0: the ratio is clamped to [1 - eps, 1 + eps], and an
    eps <= 0 turns that into another objective (eps = -1 clamps to [2, 0]) without an error."""
    return _positive("clip_eps (the PPO clip range)", clip_eps)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_eps: float = 0.2, rollout_log_probs: Optional[torch.Tensor] = None,
                tis_cap: Optional[float] = None, correction: Optional[RolloutCorrection] = None,
                corrected: Optional[tuple] = None) -> tuple:
    """PPO/GRPO clipped surrogate, token-mean over the loss mask, optionally corrected for the rollout
    (`correction`, or `tis_cap` for token TIS): the surrogate is multiplied per token by the IS weights
    and rejected tokens leave the mask, as in verl's `compute_policy_loss_vanilla`.
    All tensors [B, T]; advantages broadcast per token. `corrected`: (IS weights or None, loss mask)
    already computed by `rollout_correction` (packed rows: the sequence-level statistics were taken
    on the padded rows, one sequence each). Returns (loss, metrics dict)."""
    correction = resolve_correction(tis_cap, correction)
    check_clip_eps(clip_eps)
    ratio = torch.exp((log_probs - old_log_probs.detach()).clamp(-20.0, 20.0))
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    metrics, loss_mask = {}, response_mask if corrected is None else corrected[1]
    if correction is not None:
        if rollout_log_probs is None and corrected is None:
            raise ValueError("a rollout correction (tis_cap or correction) is set but rollout_log_probs is None; "
                             "pass the rollout's log-probs or tis_cap=None, correction=None")
        weights, loss_mask = corrected if corrected is not None else \
            rollout_correction(old_log_probs, rollout_log_probs, response_mask, correction)[:2]
        if weights is not None:
            surrogate = surrogate * weights
            metrics["tis_weight_mean"] = float(masked_mean(weights, loss_mask))
        if correction.rejection:
            metrics["rs_masked_fraction"] = float(1 - loss_mask.sum() / response_mask.sum().clamp(min=1))
    metrics["clipfrac"] = float(masked_mean(((ratio - 1).abs() > clip_eps).float(), loss_mask))
    loss = masked_mean(surrogate, loss_mask)
    metrics["pg_loss"] = float(loss.detach())
    return loss, metrics

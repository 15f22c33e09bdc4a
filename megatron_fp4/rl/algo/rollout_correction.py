"""Rollout correction in the RL loop: verl's `algorithm.rollout_correction` fields as a
`RolloutCorrection`, and the batch-level step (weights, rejection and the mismatch metrics of a whole
RL batch, verl's `compute_rollout_correction_and_add_to_batch`).

The math is `megatron_fp4.rl.algo.is_correction` (one implementation); the GRPO loss takes the config as `PolicyLoss(tis_cap=None, correction=cfg)`.
"""
from __future__ import annotations

import re
from typing import Optional

from megatron_fp4.rl.algo.is_correction import (REJECTIONS, Rejection, RolloutCorrection, mismatch_metrics,
                                                rollout_correction)

__all__ = ["RolloutCorrection", "Rejection", "rollout_correction", "mismatch_metrics", "from_verl_config",
           "correct_batch"]


def _number(field: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"rollout_correction.{field}={text!r} is not a number (e.g. 2.0 or '0.5_2.0')") from None


def _pair(field: str, spec) -> tuple:
    """verl's threshold spec: a number (upper) or 'lower_upper' -> (upper, lower or None)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_correction.{field}={spec!r} must be a number or a 'lower_upper' string")
    if isinstance(spec, str) and "_" in spec:
        lower, upper = spec.strip().split("_", 1)
        return _number(field, upper), _number(field, lower)
    return _number(field, spec) if isinstance(spec, str) else float(spec), None


def from_verl_config(cfg) -> RolloutCorrection:
    """A `RolloutCorrection` from verl's fields (a `RolloutCorrectionConfig` or a mapping):
    rollout_is (None | token | sequence), rollout_is_threshold (C: TIS; 'lower_upper': IcePop/MIS),
    rollout_rs (comma-separated options), rollout_rs_threshold (one spec, or one per option).
    bypass_mode and rollout_is_batch_normalize are not supported by this loss (refused)."""
    get = cfg.get
    for field in ("bypass_mode", "rollout_is_batch_normalize"):
        if get(field, False):
            raise ValueError(f"rollout_correction.{field}=True is not supported (the PolicyLoss is decoupled PPO "
                             "with per-micro-batch weights); set it to false")
    level = get("rollout_is", None)
    upper, lower = _pair("rollout_is_threshold", get("rollout_is_threshold", 2.0))
    rules = ()
    rs = get("rollout_rs", None)
    if rs is not None and not isinstance(rs, str):
        raise ValueError(f"rollout_correction.rollout_rs={rs!r} must be None or a string of comma-separated options "
                         f"(e.g. 'token_k1,seq_max_k2'; one of {', '.join(REJECTIONS)})")
    options = [o.strip() for o in (rs or "").split(",") if o.strip()]
    if options:
        spec = get("rollout_rs_threshold", None)
        if spec is None:
            raise ValueError("rollout_correction.rollout_rs is set but rollout_rs_threshold is not")
        specs = [s.strip() for s in spec.split(",") if s.strip()] if isinstance(spec, str) else [spec]
        if len(specs) not in (1, len(options)):
            raise ValueError(f"rollout_correction.rollout_rs_threshold has {len(specs)} values for {len(options)} "
                             "rollout_rs options; give one, or one per option")
        bad = [o for o in options if o not in REJECTIONS]
        if bad:
            raise ValueError(f"rollout_correction.rollout_rs option {bad[0]!r} must be one of {', '.join(REJECTIONS)}")
        rules = tuple(Rejection(o, *_pair("rollout_rs_threshold", s))
                      for o, s in zip(options, specs * len(options) if len(specs) == 1 else specs))
    return RolloutCorrection(level=level, mode="truncate" if lower is None else "mask", threshold=upper,
                             lower_threshold=lower, rejection=rules)


def correct_batch(batch: dict, cfg: Optional[RolloutCorrection]) -> dict:
    """verl's batch step on an RL batch (`build_rl_batch`'s keys): the metrics of the correction and
    of the rollout/trainer mismatch over the whole batch, named 'rollout_corr/<verl name>'. The loss
    applies the same weights and mask per micro-batch (every rule is per row, so they are equal)."""
    cfg = cfg if cfg is not None else RolloutCorrection(level=None)
    _, _, metrics = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
                                       cfg, metrics=True)
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


def add_correction_args(ap) -> None:
    """verl's rollout-correction fields as command-line flags (the GRPO example, the ablation)."""
    ap.add_argument("--rollout-is", choices=["token", "sequence"],
                    help="verl's rollout correction instead of --tis-cap: IS weights per token or per sequence "
                         "(algorithm.rollout_correction.rollout_is)")
    ap.add_argument("--rollout-is-threshold", default="2.0",
                    help="C (TIS: min(w, C)) or 'lower_upper' (MIS: w outside [lower, upper] masked to 0)")
    ap.add_argument("--rollout-rs", help="rejection rules, comma-separated (verl's rollout_rs, e.g. token_k1)")
    ap.add_argument("--rollout-rs-threshold",
                    help="their bounds: one spec, or one per rule (verl's rollout_rs_threshold)")


def check_correction_args(ap, args) -> None:
    """A bad --rollout-* flag: the parser's one-line error (exit 2), before anything runs."""
    try:
        correction_from_args(args)
    except ValueError as err:
        flag = lambda m: "--" + m.group(1).replace("_", "-")  # noqa: E731 - verl's field -> our flag
        ap.error(re.sub(r"rollout_correction\.(\w+)", flag, str(err)))


def correction_from_args(args) -> Optional[RolloutCorrection]:
    """The `RolloutCorrection` of `add_correction_args`' flags, or None when neither --rollout-is nor
    --rollout-rs is given (the loss then keeps its plain token TIS, --tis-cap)."""
    if not (args.rollout_is or args.rollout_rs):
        return None
    return from_verl_config({"rollout_is": args.rollout_is, "rollout_is_threshold": args.rollout_is_threshold,
                             "rollout_rs": args.rollout_rs, "rollout_rs_threshold": args.rollout_rs_threshold})

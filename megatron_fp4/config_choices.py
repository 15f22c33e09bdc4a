"""What config.py and config_validate.py share: the error type and the fields' allowed choices.

config.py imports config_validate.py (for `Config.validate`), so these live here, below both.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the field and the fix."""


_CHOICES = {
    "model.recompute": ("none", "full", "selective"),
    "fp4.scope": ("experts", "experts+attention", "none"),
    "fp4.format": ("nvfp4", "mxfp4"),
    "fp4.train_mode": ("bf16", "fp4", "fp4_resq"),
    "fp4.rollout_mode": ("bf16", "fp4", "fp4_resq"),
    "fp4.grad_rounding": ("nearest", "stochastic"),
    "fp4.compile": ("auto", "on", "off"),
    "parallel.schedule": ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv"),
    "parallel.zero_stage": (0, 1, 2),
    "parallel.expert_dispatcher": ("alltoall", "gcmoe"),
    "schedule.nan_policy": ("stop", "skip"),
    "data.kind": ("arithmetic", "megatron", "numpy"),
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("fp32", "bf16", "fp64"),
}


def choice_for_bool(dotted: str, value: bool):
    """The name a choice field gives a boolean (``fp4.compile``: True -> "on", False -> "off"), or
    None when its choices name none (a bool is then not a valid value there)."""
    names = ("on", "yes", "true") if value else ("off", "no", "false")
    return next((name for name in names if name in _CHOICES.get(dotted, ())), None)

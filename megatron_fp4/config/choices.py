"""Every allowed value of a choice field, defined once, and `ConfigError`: what `schema`, `validate`
and `family` share (the dataclasses, their checks and the family rules all name these values).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the field and the fix."""


def check_choice(what: str, value, choices, hint: str = "") -> None:
    """ValueError ``what=value: must be one of choices (hint)`` unless `value` is one of `choices`:
    the one way an argument that takes a fixed set of values refuses another."""
    if value not in choices:
        raise ValueError(f"{what}={value!r}: must be one of {tuple(choices)}" + (f" ({hint})" if hint else ""))


# Numerics levels (fp4/numerics.py, fp4/invariant.py): the one definition, kept here, torch-free.
INVARIANCE_LEVELS = ("standard", "batch", "exact")
# The allowed values of fields that code below the config checks too (fp4/, model/, parallel/
# import them from here: one definition each).
FP4_MODES = ("bf16", "fp4", "fp4_resq")
FP4_FORMATS = ("nvfp4", "mxfp4")
COMPILE_MODES = ("auto", "on", "off")
TRITON_MODES = ("auto", "off", "interpret")
RECOMPUTE_MODES = ("none", "full", "selective")
RECOMPUTE_MODULES = ("attention", "experts", "mlp", "moe")
MOE_TP_TOKENS = ("whole", "local")

# Model families (megatron_fp4/model/registry.py holds their builders; a test pins the two together).
MODEL_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")

_CHOICES = {
    "model.family": MODEL_FAMILIES,
    "numerics.invariance": INVARIANCE_LEVELS,
    "model.recompute": RECOMPUTE_MODES,
    "fp4.scope": ("experts", "experts+attention", "none"),
    "fp4.format": FP4_FORMATS,
    "fp4.train_mode": FP4_MODES,
    "fp4.rollout_mode": FP4_MODES,
    "fp4.grad_rounding": ("nearest", "stochastic"),
    "fp4.compile": COMPILE_MODES,
    "fp4.triton": TRITON_MODES,
    "parallel.schedule": ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv"),
    "parallel.zero_stage": (0, 1, 2),
    "parallel.expert_dispatcher": ("alltoall", "gcmoe"),
    "parallel.moe_tp_tokens": MOE_TP_TOKENS,
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


# Environment variables that override a config field for the process. They are read here, while
# a config loads (``config.load_config``), and nowhere else: the numerics are the config's values.
_ENV_FIELDS = {
    "MEGATRON_FP4_COMPILE": ("compile", {"1": "on", "true": "on", "yes": "on", "on": "on", "0": "off",
                                         "false": "off", "no": "off", "off": "off", "auto": "auto", "": None}),
    "MEGATRON_FP4_TRITON": ("triton", {"0": "off", "false": "off", "no": "off", "off": "off", "1": "auto",
                                       "true": "auto", "auto": "auto", "": None, "interpret": "interpret"}),
}


def apply_env_overrides(data: dict, environ) -> dict:
    """``fp4.compile`` / ``fp4.triton`` of the config dict ``data`` overridden by
    ``MEGATRON_FP4_COMPILE`` / ``MEGATRON_FP4_TRITON`` where they are set (in place)."""
    for var, (key, values) in _ENV_FIELDS.items():
        raw = environ.get(var)
        if raw is None:
            continue
        if raw.strip().lower() not in values:
            choices = "/".join(_CHOICES[f"fp4.{key}"])
            raise ConfigError(f"{var}={raw!r} is not one of {choices} (or 1/0); unset it or pick one")
        value = values[raw.strip().lower()]
        if value is not None:
            if not isinstance(data.get("fp4", {}), dict):
                raise ConfigError("config section 'fp4' must be a mapping")
            data.setdefault("fp4", {})[key] = value
    return data

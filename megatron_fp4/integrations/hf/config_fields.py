"""Typed, bounded reads of a Hugging Face config.json's fields.

A config.json comes with a downloaded checkpoint, so each field is checked for its type and a
sanity range before anything loops over it or sizes a tensor with it: ``num_hidden_layers=1e12``
or ``vocab_size=[1]`` is one ValueError naming the field, never a hang or a traceback. The limits
are far above any published model (Qwen3-235B: 94 layers, 128 experts, vocab 151936) and only
stop nonsense; the sizes themselves are then checked against the safetensors headers.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

LIMITS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 17, "num_hidden_layers": 1 << 10, "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12, "head_dim": 1 << 12, "moe_intermediate_size": 1 << 20,
    "intermediate_size": 1 << 20, "num_experts": 1 << 14, "num_experts_per_tok": 1 << 14,
    "max_position_embeddings": 1 << 30, "decoder_sparse_step": 1 << 10,
}


def config_dict(hf_cfg, family: str = "", required=()) -> dict:
    """A config.json dict (or a `PretrainedConfig`) as a plain dict, refused unless it is a JSON
    object holding every `required` field (`family` names the expected family in the errors)."""
    d = hf_cfg.to_dict() if hasattr(hf_cfg, "to_dict") else hf_cfg
    what = f" of {family} fields" if family else ""
    if not isinstance(d, Mapping):
        raise ValueError(f"HF config is a {type(d).__name__}, not a JSON object{what}")
    missing = [k for k in required if d.get(k) is None]
    if missing:
        raise ValueError(f"HF config lacks required field(s) {missing}; pass a complete {family} config.json")
    return dict(d)


def int_field(d: Mapping[str, Any], key: str, default=None, alias: str | None = None) -> int:
    """``d[key]`` (or ``d[alias]``, else `default`) as an integer in [1, LIMITS[key]]."""
    hi = LIMITS.get(key, 1 << 30)
    value = d.get(key)
    if value is None and alias is not None:
        key, value = alias, d.get(alias)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
        raise ValueError(f"HF config {key}={value!r:.80}: must be an integer in [1, {hi}]")
    return value


def float_field(d: Mapping[str, Any], key: str, default: float, positive: bool = False) -> float:
    """``d[key]`` (`default` when absent) as a finite, non-negative (or positive) float."""
    value = d.get(key)
    value = default if value is None else value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        raise ValueError(f"HF config {key}={value!r:.80}: must be a finite number {'> 0' if positive else '>= 0'}")
    return float(value)


def bool_field(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key)
    value = default if value is None else value
    if not isinstance(value, bool):
        raise ValueError(f"HF config {key}={value!r:.80}: must be true or false")
    return value


def layer_list(d: Mapping[str, Any], key: str) -> set[int]:
    """``d[key]``: a list of layer indices (those >= num_hidden_layers name no layer, as in transformers)."""
    value = d.get(key) or []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(f"HF config {key}={value!r:.80}: must be a list of layer indices (integers >= 0)")
    return set(value)


def string_list(d: Mapping[str, Any], key: str) -> list:
    value = d.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"HF config {key}={value!r:.80}: must be a list of strings")
    return value


def rope_fields(d: Mapping[str, Any], default_theta: float, family: str, yarn_keys: tuple, absent=None,
                strict_yarn: bool = False) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from transformers-5 ``rope_parameters`` or the Hub's
    ``rope_theta`` + ``rope_scaling``: plain RoPE (None) or YaRN with the family's `yarn_keys`;
    `absent`: the family's scaling when the config names none. `strict_yarn`: an explicit
    ``attention_factor`` is refused and ``factor`` / ``original_max_position_embeddings`` required."""
    theta = float_field(d, "rope_theta", default_theta, positive=True)
    params = d.get("rope_parameters") or d.get("rope_scaling")
    if params is None:
        return theta, None if absent is None else dict(absent)
    if not isinstance(params, Mapping):
        raise ValueError(f"HF config rope_parameters={params!r:.80}: expected a mapping"
                         + (f" like {absent}" if absent else ""))
    theta = float_field(params, "rope_theta", theta, positive=True)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn" or (strict_yarn and params.get("attention_factor") is not None):
        raise ValueError(f"HF config rope_parameters={dict(params)!r:.160}: {family} RoPE is 'default' or 'yarn'"
                         + (" (without an explicit attention_factor)" if strict_yarn else "") + " here")
    scaling = {k: params[k] for k in yarn_keys if params.get(k) is not None}
    if strict_yarn and ("factor" not in scaling or "original_max_position_embeddings" not in scaling):
        raise ValueError(f"HF config rope_parameters={dict(params)!r:.160}: YaRN needs factor and "
                         "original_max_position_embeddings")
    return theta, {"rope_type": "yarn", **scaling}

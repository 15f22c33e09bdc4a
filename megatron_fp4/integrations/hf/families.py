"""The HF side of the model registry: a checkpoint's family is its config.json's ``model_type``.

Each family's module (`qwen3_moe.py`, `gpt_oss.py`, `deepseek_v3.py`) maps the config fields and the weight names;
the functions here pick the module — from the HF config when reading, from ``model.cfg.family``
when writing — so `build_model_from_hf`, `tools/convert_checkpoint.py` and the RL weight sync need
nothing else to be told. The model side of a family is `megatron_fp4.model.registry`.
"""
from __future__ import annotations

import torch

from megatron_fp4.config import ModelConfig
from megatron_fp4.integrations.hf import deepseek_v3, gpt_oss, qwen3_moe
from megatron_fp4.integrations.hf.config_fields import config_dict

BY_MODEL_TYPE = {qwen3_moe.HF_MODEL_TYPE: qwen3_moe, gpt_oss.HF_MODEL_TYPE: gpt_oss,
                 deepseek_v3.HF_MODEL_TYPE: deepseek_v3}
# model.family -> HF module (each family's name is its HF model_type)
BY_FAMILY = {"qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3}


def for_hf_config(hf_cfg):
    """The family module of a config.json dict (or `PretrainedConfig`); absent model_type: Qwen3-MoE
    (the configs this project wrote before families existed)."""
    d = config_dict(hf_cfg)
    model_type = d.get("model_type", qwen3_moe.HF_MODEL_TYPE)
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(f"HF config model_type={model_type!r:.80} is not a supported model family; supported: "
                         f"{sorted(BY_MODEL_TYPE)} (docs/families.md says how a family is added)")
    return BY_MODEL_TYPE[model_type]


def for_model(model_or_cfg):
    """The family module of a model (or its `ModelConfig`), by ``model.family``."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    family = getattr(cfg, "family", "qwen3_moe")
    if family not in BY_FAMILY:
        raise ValueError(f"model.family={family!r:.80} has no Hugging Face mapping; families: {sorted(BY_FAMILY)}")
    return BY_FAMILY[family]


def ours_config_from_hf(hf_cfg) -> ModelConfig:
    """Our `ModelConfig` of a HF config of any supported family."""
    return for_hf_config(hf_cfg).ours_config_from_hf(hf_cfg)


def hf_config_from_ours(model_cfg: ModelConfig) -> dict:
    return for_model(model_cfg).hf_config_from_ours(model_cfg)


def to_hf_state_dict(model, layout: str = "checkpoint", mxfp4_experts: bool = False) -> dict[str, torch.Tensor]:
    """HF tensors of `model` in its family's names. ``mxfp4_experts`` (GPT-OSS only): expert
    weights packed as OpenAI's checkpoints hold them."""
    module = for_model(model)
    if mxfp4_experts:
        if module is not gpt_oss:
            raise ValueError(f"mxfp4_experts: only GPT-OSS checkpoints hold packed MXFP4 experts, not "
                             f"{module.HF_MODEL_TYPE}")
        return module.to_hf_state_dict(model, layout, mxfp4=True)
    return module.to_hf_state_dict(model, layout)


def from_hf_state_dict(model, sd, shard: bool = False) -> None:
    for_model(model).from_hf_state_dict(model, sd, shard)


def ours_from_hf_state_dict(model, sd, shard: bool = False) -> dict[str, torch.Tensor]:
    return for_model(model).ours_from_hf_state_dict(model, sd, shard)


def check_hf_state_dict(model, sd, shard: bool = False) -> None:
    for_model(model).check_hf_state_dict(model, sd, shard)


def hf_architecture(model_or_cfg) -> str:
    return for_model(model_or_cfg).HF_ARCHITECTURE

"""Hugging Face interop: config/weight mapping of every model family (`families.py`: Qwen3-MoE,
GPT-OSS, chosen by config.json's model_type) and safetensors checkpoints."""
from megatron_fp4.integrations.hf.checkpoint import (build_model_from_hf, load_hf_checkpoint, load_hf_shard,
                                                     save_hf_checkpoint)
from megatron_fp4.integrations.hf.families import (check_hf_state_dict, from_hf_state_dict, hf_config_from_ours,
                                                   ours_config_from_hf, ours_from_hf_state_dict, to_hf_state_dict)
from megatron_fp4.integrations.hf.qwen3_moe import LAYOUTS

__all__ = [
    "LAYOUTS", "hf_config_from_ours", "ours_config_from_hf", "to_hf_state_dict", "from_hf_state_dict",
    "ours_from_hf_state_dict", "check_hf_state_dict", "save_hf_checkpoint", "load_hf_checkpoint", "load_hf_shard",
    "build_model_from_hf",
]

"""Hugging Face interop: Qwen3-MoE config/weight mapping and safetensors checkpoints."""
from megatron_fp4.integrations.hf.checkpoint import (build_model_from_hf, load_hf_checkpoint, load_hf_shard,
                                                    save_hf_checkpoint)
from megatron_fp4.integrations.hf.qwen3_moe import (LAYOUTS, from_hf_state_dict, hf_config_from_ours,
                                                    ours_config_from_hf, to_hf_state_dict)

__all__ = [
    "LAYOUTS", "hf_config_from_ours", "ours_config_from_hf", "to_hf_state_dict", "from_hf_state_dict",
    "save_hf_checkpoint", "load_hf_checkpoint", "load_hf_shard", "build_model_from_hf",
]

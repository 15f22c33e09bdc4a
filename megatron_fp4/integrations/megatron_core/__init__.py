"""Megatron-Core interop: config mapping, FP4 layer-spec description, checkpoint names.

Everything here is pure Python/torch and runs on CPU without megatron-core installed; only
`build_transformer_config` and `get_moeresq_layer_spec` (a Megatron-Core layer spec with MoEResQ
linears, moeresq_spec.py) import it. Megatron-Core's runtime (GPTModel forward, TE layers, its
distributed optimizer, the alltoall token dispatcher) needs CUDA, which is why this project runs its
own trainer and keeps this package to *mapping* (see DESIGN.md, ground rule 4).
"""
from megatron_fp4.integrations.megatron_core.checkpoint import (EXPERT_LAYOUTS, SPECS, from_mcore_state_dict,
                                                                interleave_qkv, split_qkv, to_mcore_state_dict)
from megatron_fp4.integrations.megatron_core.config import (FP4_BACKENDS, GPT_MODEL_KEYS, build_transformer_config,
                                                            from_megatron_transformer_config, split_megatron_kwargs,
                                                            to_megatron_transformer_config)
from megatron_fp4.integrations.megatron_core.moeresq_spec import get_moeresq_layer_spec, name_moeresq_linears
from megatron_fp4.integrations.megatron_core.specs import (fp4_layer_plan, fp4_module_names, fp4_submodules,
                                                           is_fp4_parameter)

__all__ = [
    "to_megatron_transformer_config", "from_megatron_transformer_config", "split_megatron_kwargs",
    "build_transformer_config", "GPT_MODEL_KEYS", "FP4_BACKENDS",
    "get_moeresq_layer_spec", "name_moeresq_linears", "fp4_submodules", "fp4_layer_plan", "fp4_module_names", "is_fp4_parameter",
    "interleave_qkv", "split_qkv", "to_mcore_state_dict", "from_mcore_state_dict", "SPECS", "EXPERT_LAYOUTS",
]

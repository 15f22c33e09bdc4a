"""Model: the Qwen3-MoE-family decoder with FP4 (MoEResQ) experts and an fp32 router."""
from megatron_fp4.model.layers import KVCache, LayerCache
from megatron_fp4.model.moe import (AuxLossAutoScaler, Dispatcher, GroupedExperts, LocalDispatcher, MoELayer, Router,
                                    combine_expert_outputs, permute_by_expert)
from megatron_fp4.model.transformer import (DecoderLayer, ModelOutput, MoETransformer, build_model, init_weights,
                                            lm_loss, materialize, param_generator)
from megatron_fp4.model.specs import recipe_from_config

__all__ = [
    "KVCache", "LayerCache", "AuxLossAutoScaler", "Dispatcher", "GroupedExperts", "LocalDispatcher", "MoELayer",
    "Router",
    "combine_expert_outputs", "permute_by_expert", "DecoderLayer", "ModelOutput", "MoETransformer",
    "build_model", "init_weights", "lm_loss", "materialize", "param_generator", "recipe_from_config",
]

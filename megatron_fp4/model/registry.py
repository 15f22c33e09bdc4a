"""The model families: each a decoder layer class, the HF ``model_type`` it corresponds to and
what it supports, chosen by ``model.family`` (torchtitan's train-spec idea, kept small).

`transformer.MoETransformer` asks `get_family(cfg.family).decoder_layer` for its layers; everything
above the model (trainer, pipeline, expert parallel, rollout) sees the shared decoder's interface
(`embed` / `run_layers` / `head`, MoE layers with a router and `GroupedExperts`). The HF config and
name mapping of each family live in `integrations/hf/families.py` (integrations sit above model).
How to add a family: docs/families.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_fp4.config.choices import MODEL_FAMILIES
from megatron_fp4.model.decoder import DecoderLayer
from megatron_fp4.model.deepseek_v3 import DeepseekV3DecoderLayer
from megatron_fp4.model.gpt_oss import GptOssDecoderLayer


@dataclass(frozen=True)
class Family:
    name: str                # model.family
    decoder_layer: type      # (model_cfg, fp4_cfg, layer_idx) -> nn.Module with DecoderLayer's forward
    hf_model_type: str       # config.json's model_type
    numerics: tuple          # numerics.invariance levels it runs at
    tensor_parallel: bool    # whether parallel.tp > 1 is implemented for it (parallel/tensor_parallel.py)
    expert_tensor_parallel: bool  # whether parallel.etp > 1 is (parallel/moe/expert_tensor_parallel.py)
    router_bias_update: bool  # aux-loss-free balancing (model.moe_router_bias_update_rate > 0)


FAMILIES = {
    "qwen3_moe": Family("qwen3_moe", DecoderLayer, "qwen3_moe", ("standard", "batch", "exact"), True, True, True),
    "gpt_oss": Family("gpt_oss", GptOssDecoderLayer, "gpt_oss", ("standard", "batch", "exact"), True, True, False),
    "deepseek_v3": Family("deepseek_v3", DeepseekV3DecoderLayer, "deepseek_v3", ("standard", "batch", "exact"), True, True, True),
}
assert tuple(FAMILIES) == MODEL_FAMILIES, "config.choices.MODEL_FAMILIES must list the registry's families"


def get_family(name: str) -> Family:
    """The family `name`; a ValueError listing the families otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r:.80} is not a model family; the families are {list(FAMILIES)} "
                         "(docs/families.md)")
    return FAMILIES[name]


def numerics_level_for(family: str, wanted: str) -> str:
    """`wanted` (a ``numerics.invariance`` level) when the family runs it, else the family's first
    level: what a config built from a checkpoint alone (``from-hf``, verl) starts with."""
    levels = get_family(family).numerics
    return wanted if wanted in levels else levels[0]

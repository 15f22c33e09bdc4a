"""Which Megatron-Core submodules get FP4 (MoEResQ) under each of our `fp4.scope` values.

Our scopes (`megatron_fp4.model.specs`) in Megatron-Core's module names, per TransformerLayer:

    scope               MoE layer                                        dense layer
    none                -                                                -
    experts             mlp.experts.linear_fc1, mlp.experts.linear_fc2   mlp.linear_fc1, mlp.linear_fc2
                        (+ mlp.shared_experts.linear_fc1/fc2)
    experts+attention   the above + self_attention.linear_qkv, self_attention.linear_proj

Never FP4: mlp.router (fp32), embedding, norms, output_layer. (Dense layers follow our model: their
SwiGLU uses the expert recipe, `DecoderLayer`.) ``mlp.experts.linear_fc1`` stands for every
expert's fc1 (SequentialMLP ``local_experts.{e}.linear_fc1``, TEGroupedMLP ``linear_fc1``).

This is a description, not a Megatron ModuleSpec: swapping these modules for an MoEResQ linear
inside Megatron-Core needs a tensor-parallel-aware linear class and CUDA (Megatron-Core's runtime),
which this project does not ship. `fp4_layer_plan` gives, per layer, the submodule -> `Recipe` map
such an adapter (or a TE custom quantizer factory) would consume; the recipe comes from our
`recipe_from_config`, so the numerics stay the ones defined in `megatron_fp4/fp4/`.
"""
from __future__ import annotations

import re
from typing import Optional

from megatron_fp4.config.choices import check_choice
from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.specs import recipe_from_config

SCOPES = ("none", "experts", "experts+attention")
ATTENTION_SUBMODULES = ("self_attention.linear_qkv", "self_attention.linear_proj")
EXPERT_SUBMODULES = ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")
SHARED_EXPERT_SUBMODULES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
DENSE_MLP_SUBMODULES = ("mlp.linear_fc1", "mlp.linear_fc2")
NEVER_FP4 = ("mlp.router", "input_layernorm", "pre_mlp_layernorm", "self_attention.q_layernorm",
             "self_attention.k_layernorm")


def fp4_submodules(scope: str, is_moe: bool = True, shared_experts: bool = False) -> tuple[str, ...]:
    """Megatron-Core submodule paths (relative to a TransformerLayer) that are FP4 under `scope`."""
    check_choice("fp4 scope", scope, SCOPES)
    if scope == "none":
        return ()
    if is_moe:
        mlp = EXPERT_SUBMODULES + (SHARED_EXPERT_SUBMODULES if shared_experts else ())
    else:
        mlp = DENSE_MLP_SUBMODULES
    return (ATTENTION_SUBMODULES if scope == "experts+attention" else ()) + mlp


def fp4_layer_plan(cfg, mode: Optional[str] = None) -> dict[int, dict[str, Recipe]]:
    """{layer index: {submodule: Recipe}} for a full `Config` (mode default: fp4.train_mode)."""
    m, f = cfg.model, cfg.fp4
    if f.scope == "none":
        return {i: {} for i in range(m.num_layers)}
    recipe = recipe_from_config(f, mode)
    return {i: {sub: recipe for sub in fp4_submodules(f.scope, i not in m.dense_layers, bool(m.num_shared_experts))}
            for i in range(m.num_layers)}


def fp4_module_names(cfg) -> list[str]:
    """Full Megatron-Core module names (``decoder.layers.{i}.<submodule>``) that are FP4."""
    return [f"decoder.layers.{i}.{sub}" for i, subs in fp4_layer_plan(cfg).items() for sub in subs]


def is_fp4_parameter(mcore_name: str, cfg) -> bool:
    """Whether a Megatron-Core *parameter* name belongs to an FP4 linear under `cfg`."""
    from megatron_fp4.integrations.megatron_core.checkpoint import mcore_layer_index

    i = mcore_layer_index(mcore_name)
    if i is None:
        return False
    module, _, param = mcore_name[len(f"decoder.layers.{i}."):].rpartition(".")
    if not re.fullmatch(r"weight\d*", param):  # e.g. TE's fused norm `linear_qkv.layer_norm_weight`
        return False
    module = re.sub(r"\.local_experts\.\d+", "", module)
    return module in fp4_layer_plan(cfg).get(i, {})


__all__ = ["SCOPES", "ATTENTION_SUBMODULES", "EXPERT_SUBMODULES", "SHARED_EXPERT_SUBMODULES", "DENSE_MLP_SUBMODULES",
           "NEVER_FP4", "fp4_submodules", "fp4_layer_plan", "fp4_module_names", "is_fp4_parameter"]

"""Layer specs: which linears are FP4 and with which recipe, from the FP4 config.

The scope decides *where* FP4 applies (router, embeddings, norms and LM head never); the mode
decides *how* (bf16 / fp4 / fp4_resq) and is set separately for the training and rollout forward.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megatron_fp4.fp4 import Numerics, OperandFormat, Recipe


def recipe_from_config(fp4_cfg, mode: Optional[str] = None) -> Recipe:
    """The `Recipe` for FP4 linears under `fp4_cfg`, in `mode` (default: the training mode)."""
    recipe = Recipe.for_format(mode or fp4_cfg.train_mode, fp4_cfg.format,
                               quantize_backward=fp4_cfg.quantize_backward, seed=fp4_cfg.seed,
                               compile=fp4_cfg.compile)
    if fp4_cfg.grad_rounding != recipe.grad_output.rounding:
        recipe = replace(recipe, grad_output=replace(recipe.grad_output, rounding=fp4_cfg.grad_rounding))
    return recipe


def expert_recipe(fp4_cfg, mode: Optional[str] = None) -> Optional[Recipe]:
    return None if fp4_cfg.scope == "none" else recipe_from_config(fp4_cfg, mode)


def attention_recipe(fp4_cfg, mode: Optional[str] = None) -> Optional[Recipe]:
    return recipe_from_config(fp4_cfg, mode) if fp4_cfg.scope == "experts+attention" else None


def numerics_from_config(cfg, mode: str = "train") -> Numerics:
    """The `Numerics` of a model in `mode` ("train": the trainer's model, its training forward and
    scoring; "rollout": an engine's copy) under `cfg` (a `Config`; its environment overrides were
    applied when it loaded): both at `numerics.invariance`, fixed for the model's life, so the
    trainer's scoring and training forward compute a row the way the rollout decodes it."""
    return Numerics(invariance=cfg.numerics.invariance, triton=cfg.fp4.triton, mode=mode)


def no_weight_decay(name: str, param) -> bool:
    """Biases, norm gains and 1-D params get no weight decay (Megatron's rule)."""
    return param.ndim < 2 or name.endswith(".bias") or "norm" in name


__all__ = ["no_weight_decay", "numerics_from_config", "recipe_from_config", "expert_recipe", "attention_recipe",
           "OperandFormat"]

"""Megatron-Core layer specs whose FP4 linears are computed by MoEResQ.

    from megatron_fp4.integrations.megatron_core import get_moeresq_layer_spec, name_moeresq_linears
    spec = get_moeresq_layer_spec(tc, cfg)                       # tc: megatron TransformerConfig
    gpt = GPTModel(config=tc, transformer_layer_spec=spec, ...)
    name_moeresq_linears(gpt)                                    # keys SR streams by module name

The spec is Megatron-Core's own local decoder-block spec (`get_gpt_decoder_block_spec`,
SequentialMLP local experts) with every submodule that our `fp4_layer_plan` marks FP4 (by default
each MoE layer's ``mlp.experts.linear_fc1/fc2``, i.e. every local expert's fc1 and fc2, plus the
shared experts'; attention too under ``experts+attention``) swapped for a subclass of its class
whose GEMM is `moeresq_linear` with the plan's `Recipe`. Parameters, names, shapes and
initialisation are the parent class's, so checkpoints are unchanged; only the GEMM differs. The
router, norms, embedding and output layer stay Megatron-Core's.

Limits (ValueError at construction): tensor parallel size 1 for these linears (MoEResQ's
quantization blocks run along the full contraction dim, and the TP dgrad all-reduce lives in the
GEMM function we replace) and no ``gradient_accumulation_fusion`` (a CUDA-only fused wgrad into
``main_grad``). Transformer Engine's grouped-GEMM experts are not wrapped (TE computes those GEMMs
in its own kernels): ask for the local spec, which is what this function builds.
"""
from __future__ import annotations

import copy


from megatron_fp4.fp4 import Recipe
from megatron_fp4.fp4.moeresq import moeresq_linear
from megatron_fp4.integrations.megatron_core.specs import fp4_layer_plan


class _MoEResQLinearMixin:
    """Replaces a Megatron-Core parallel linear's GEMM by `moeresq_linear` (same parameters)."""

    def __init__(self, *args, recipe: Recipe, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(recipe, Recipe):
            raise ValueError(f"{type(self).__name__}: recipe must be a megatron_fp4 Recipe, got {type(recipe).__name__}")
        if self.tp_group is not None and self.tp_group.size() > 1:
            raise ValueError(f"{type(self).__name__} needs tensor_model_parallel_size=1 (and "
                             f"expert_tensor_parallel_size=1), got {self.tp_group.size()}")
        if getattr(self, "gradient_accumulation_fusion", False):
            raise ValueError(f"{type(self).__name__}: set gradient_accumulation_fusion=False in the "
                             "TransformerConfig (MoEResQ computes its own wgrad)")
        self.recipe = recipe
        self.quant_name = ""  # global module name: `name_moeresq_linears`

    def _forward_impl(self, input, weight, bias=None, *args, **kwargs):
        return moeresq_linear(input, weight, bias, recipe=self.recipe, name=self.quant_name)


def _moeresq_classes() -> dict:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return {ColumnParallelLinear: MoEResQColumnParallelLinear(), RowParallelLinear: MoEResQRowParallelLinear()}


_CLASSES: dict = {}


def _subclass(base):
    """MoEResQ subclass of a Megatron-Core linear class (created once per base class)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"MoEResQ{base.__name__}", (_MoEResQLinearMixin, base),
                              {"__module__": __name__, "__doc__": f"{base.__name__} computed by MoEResQ."})
    return _CLASSES[base]


def MoEResQColumnParallelLinear():  # noqa: N802 - a class factory: megatron-core is imported lazily
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    return _subclass(ColumnParallelLinear)


def MoEResQRowParallelLinear():  # noqa: N802
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    return _subclass(RowParallelLinear)


def _swap(layer_spec, path: str, recipe: Recipe) -> bool:
    """Replace the linear at `path` (e.g. ``mlp.experts.linear_fc1``) in one layer's spec."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    node = layer_spec
    *parents, leaf = path.split(".")
    for part in parents:
        sub = getattr(getattr(node, "submodules", None), part, None)
        if sub is None:
            return False
        node = sub
    subs = node.submodules
    current = getattr(subs, leaf, None)
    if current is None:
        return False
    base = current.module if isinstance(current, ModuleSpec) else current
    known = _moeresq_classes()
    if base not in known:
        raise ValueError(f"get_moeresq_layer_spec: {path} is a {getattr(base, '__name__', base)}, not a "
                         "Megatron-Core ColumnParallelLinear/RowParallelLinear; use the local spec "
                         "(use_transformer_engine=False) for MoEResQ linears")
    params = dict(current.params) if isinstance(current, ModuleSpec) else {}
    setattr(subs, leaf, ModuleSpec(module=known[base], params={**params, "recipe": recipe}))
    return True


def get_moeresq_layer_spec(config, cfg, mode: str | None = None, vp_stage=None, pp_rank=None):
    """Megatron-Core decoder-block spec (`TransformerBlockSubmodules`) with MoEResQ linears.

    ``config``: the Megatron-Core `TransformerConfig` (e.g. from `build_transformer_config(cfg)`);
    ``cfg``: our `Config`, whose ``fp4`` section picks scope and recipe (`fp4_layer_plan`; ``mode``
    defaults to ``fp4.train_mode``). Pass the result as GPTModel's ``transformer_layer_spec``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if config.num_layers != cfg.model.num_layers:
        raise ValueError(f"get_moeresq_layer_spec: TransformerConfig.num_layers={config.num_layers} != "
                         f"model.num_layers={cfg.model.num_layers}; build both from the same Config")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank)
    plan = fp4_layer_plan(cfg, mode)
    offset = _first_layer(config, vp_stage, pp_rank)
    specs = []
    for i, layer_spec in enumerate(block.layer_specs):
        layer_spec = copy.deepcopy(layer_spec)  # layers share spec objects: swap per layer
        for path, recipe in plan[offset + i].items():
            if not _swap(layer_spec, path, recipe) and not path.startswith("mlp.shared_experts"):
                raise ValueError(f"get_moeresq_layer_spec: layer {offset + i} has no {path} in Megatron-Core's "
                                 "spec; the TransformerConfig does not describe cfg.model")
        specs.append(layer_spec)
    block.layer_specs = specs
    return block


def _first_layer(config, vp_stage, pp_rank) -> int:
    """Global index of the first layer this (pipeline) stage builds."""
    if config.pipeline_model_parallel_size == 1:
        return 0
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)


def name_moeresq_linears(model) -> list[str]:
    """Set every MoEResQ linear's ``quant_name`` to its module name (SR streams and error messages
    are keyed by it); returns the names, in module order."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, _MoEResQLinearMixin):
            module.quant_name = name
            names.append(name)
    return names


__all__ = ["get_moeresq_layer_spec", "name_moeresq_linears", "MoEResQColumnParallelLinear",
           "MoEResQRowParallelLinear"]

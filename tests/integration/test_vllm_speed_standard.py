"""The plugin's standard-kernel path (megatron_fp4/integrations/vllm/standard.py) against the trainer.

With ``batch_invariant: false`` the plugin serves fused linears as one GEMM over the per-shard
``Q(W)`` and the routed experts through `StandardExperts` (grouped GEMMs, an ``index_add_``
combine). Its promise is the trainer's FP4 MoEResQ numerics up to fp32 GEMM rounding, so these
tests compare with the trainer's modules (`Attention`/`SwiGLU` projections, `MoELayer`) within a
bound derived from the GEMMs (``γ_K = K·u / (1 − K·u)`` times ``|Q̃(X)|·|Q(W)|ᵀ``, u = 2⁻²⁴, per
GEMM; the MoE's second GEMM adds its own on the first one's rounding carried through the SiLU and
Q̃, which a flipped FP4 code could exceed: checked on inputs where it does not, and stated).
They also pin that the path serves exactly where it should (standard mode, no autograd) and never
in the batch-invariant mode, that a weight written by vLLM's loader is what it computes with next
(its fused/stacked Q(W) is dropped with the plugin's store), and that the compiled ResQ the plugin
prepares at load is served without dynamo's per-call guards with the eager bits. Runs in the vLLM
environment.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import Numerics, apply_numerics, resq_quantize
from megatron_fp4.model.layers import Attention, SwiGLU
from megatron_fp4.model.moe import MoELayer, init_moe_params
from megatron_fp4.model.specs import recipe_from_config
from tests.integration.test_vllm_plugin import linear_layer, plugin_config, plugin_moe, tiny_cfg
from tests.integration.test_vllm_speed import vllm_ctx  # noqa: F401  (fixture: skips without vLLM)
from tests.unit.test_fp4_fused import compiled, needs_inductor  # noqa: F401  (fixture)

U = 2.0 ** -24


def gemm_bound(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fl(xq·wqᵀ) − xq·wqᵀ| for any fp32 summation order (γ_K·|xq|·|wq|ᵀ)."""
    k = xq.shape[-1]
    gamma = k * U / (1 - k * U)
    return gamma * (xq.double().abs() @ wq.double().abs().t())


def counting(monkeypatch, module, name):
    calls = []
    fn = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


@pytest.mark.parametrize("mode", ["fp4_resq", "fp4", "bf16"])
def test_fused_projections_are_one_gemm_within_fp32_rounding_of_the_trainers(vllm_ctx, monkeypatch, mode):
    from megatron_fp4.integrations.vllm import quant, standard
    from megatron_fp4.integrations.vllm.quant import MoEResQLinearMethod

    served = counting(monkeypatch, quant, "standard_linear")
    gemms = counting(monkeypatch, standard.F, "linear")
    cfg = tiny_cfg("experts+attention", rollout_mode=mode)
    recipe = recipe_from_config(cfg.fp4, mode)
    torch.manual_seed(3)
    attn, mlp = Attention(128, 2, 1, 64, 1e-6, 1e4, recipe), SwiGLU(128, 96, recipe)
    with torch.no_grad():
        attn.k_proj.weight.mul_(8.0)  # unlike amaxes: one per-tensor scale over the fused weight would differ
    apply_numerics(attn, Numerics(invariance="standard"))
    apply_numerics(mlp, Numerics(invariance="standard"))
    qc = plugin_config(cfg, "standard")
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 2, 128)
    for name, mods in (("self_attn.qkv_proj", [attn.q_proj, attn.k_proj, attn.v_proj]),
                       ("mlp.gate_up_proj", [mlp.gate_proj, mlp.up_proj])):
        method = MoEResQLinearMethod(qc, f"model.layers.0.{name}")
        layer = linear_layer(method, [m.out_features for m in mods], 128, torch.cat([m.weight.detach() for m in mods]))
        for step in range(2):  # step 1: after a weight load
            before = len(gemms)
            with torch.inference_mode():
                got = method.apply(layer, x)
                assert torch.equal(method.apply(layer, x), got)  # the cached fused Q(W)
            assert len(gemms) - before == 2, name  # one GEMM for every shard
            with torch.no_grad():
                want = torch.cat([m(x) for m in mods], dim=-1)
                if mode == "bf16":
                    xq, wq = x, torch.cat([m.weight for m in mods])
                else:
                    xq = resq_quantize(x, recipe.input, recipe.compensated)
                    wq = torch.cat([resq_quantize(m.weight, recipe.weight, compensated=False) for m in mods])
            # both sides round their GEMM: twice the one-sided bound
            assert ((got - want).abs().double() <= 2 * gemm_bound(xq, wq)).all(), (name, step)
            # a weight written through vLLM's loader (a .data copy) is what the next call computes with
            with torch.no_grad():
                for m in mods:
                    m.weight.mul_(-0.75)
            layer.weight.weight_loader(layer.weight, torch.cat([m.weight.detach() for m in mods]))
    assert len(served) == 8
    with torch.enable_grad():  # autograd through the input: the trainer's per-shard path, not this one
        method.apply(layer, x.clone().requires_grad_())
    assert len(served) == 8


@pytest.mark.parametrize("scope,mode", [("experts", "fp4_resq"), ("experts", "fp4")])
def test_standard_moe_block_is_the_trainers_within_fp32_rounding_and_follows_weight_loads(vllm_ctx, monkeypatch,
                                                                                           scope, mode):
    from megatron_fp4.integrations.vllm import standard

    served = counting(monkeypatch, standard.StandardExperts, "__call__")
    cfg = tiny_cfg(scope, format="nvfp4", rollout_mode=mode)
    E, k, H, F = 8, 2, 64, 32
    ref = MoELayer(H, E, k, F, recipe_from_config(cfg.fp4, mode), norm_topk_prob=True).eval()
    init_moe_params(ref, 0.1, 0.1, torch.Generator().manual_seed(1))
    apply_numerics(ref, Numerics(invariance="standard"))
    gate_method, gate, experts, moe = plugin_moe(plugin_config(cfg, "standard"), ref, E, k, H, F)
    for seed, tokens in ((2, 37), (3, 16), (4, 1)):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            want = ref(x)
        with torch.inference_mode():
            logits = gate_method.apply(gate, x)
            got = moe.apply_monolithic(experts, x, logits)
        # stated tolerance: fp32 GEMM rounding of two chained GEMMs at these sizes (K ≤ 64, |y| ≤ ~1),
        # 1e-5 relative to the layer's largest output, with no FP4 code flipped by it on these inputs
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (seed, tokens)
    assert len(served) == 3
    with torch.no_grad():  # a new expert weight written by vLLM's loader is used by the next forward
        ref.experts.w13.mul_(-0.5)
        ref.experts.w2.mul_(1.5)
    experts.w13_weight.weight_loader(experts.w13_weight, ref.experts.w13.detach())
    experts.w2_weight.weight_loader(experts.w2_weight, ref.experts.w2.detach())
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(x)
    with torch.inference_mode():
        got = moe.apply_monolithic(experts, x, gate_method.apply(gate, x))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("level", ["batch", "exact"])
def test_the_row_invariant_levels_never_take_the_standard_path(vllm_ctx, monkeypatch, level):
    from megatron_fp4.integrations.vllm import quant, standard
    from megatron_fp4.integrations.vllm.quant import MoEResQLinearMethod

    linears = counting(monkeypatch, quant, "standard_linear")
    moes = counting(monkeypatch, standard.StandardExperts, "__call__")
    cfg = tiny_cfg("experts+attention", format="nvfp4", rollout_mode="fp4_resq")
    E, k, H, F = 8, 2, 64, 32
    ref = MoELayer(H, E, k, F, recipe_from_config(cfg.fp4, "fp4_resq"), norm_topk_prob=True).eval()
    init_moe_params(ref, 0.1, 0.1, torch.Generator().manual_seed(1))
    apply_numerics(ref, Numerics(invariance=level))
    qc = plugin_config(cfg, level)
    gate_method, gate, experts, moe = plugin_moe(qc, ref, E, k, H, F)
    method = MoEResQLinearMethod(qc, "model.layers.0.self_attn.qkv_proj")
    layer = linear_layer(method, [64, 32, 32], H, torch.randn(128, H))
    x = torch.randn(5, H)
    with torch.no_grad():
        want = ref(x)
    with torch.inference_mode():
        assert torch.equal(moe.apply_monolithic(experts, x, gate_method.apply(gate, x)), want)  # bitwise, the level
        method.apply(layer, x)
    assert moe.standard is None and linears == [] and moes == []


@needs_inductor
def test_the_plugins_compiled_resq_is_served_without_dynamo_with_the_eager_bits(vllm_ctx, compiled):
    """`fused_resq.prepare(inference=True)` (the plugin at load) serves the checked ResQ body as an
    inductor artifact called without dynamo's guards; on any size it gives the eager path's bits."""
    from megatron_fp4.fp4 import fused, fused_resq
    from megatron_fp4.fp4.recipe import OperandFormat
    from megatron_fp4.fp4.resq import portable_resq_quantize

    key = fused_resq.key_of("row", torch.float32)
    fused.PROCESS.variants.pop(key, None)  # a fresh variant: this process's earlier tests may have built one
    try:
        assert fused_resq.prepare("row", torch.float32, inference=True)
        variant = fused_resq.variant_of(key)
        assert not hasattr(variant.fns[0], "_torchdynamo_orig_callable")  # not a torch.compile wrapper
        fmt = OperandFormat(format="nvfp4", scale="row", block="1d", rounding="nearest")
        g = torch.Generator().manual_seed(7)
        for rows, cols in ((16, 128), (2, 32), (37, 1024), (5, 272)):
            x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, cols)
            with torch.inference_mode():
                got = fused_resq.resq_nvfp4_fused(x, "row", "x")
                want = portable_resq_quantize(x, fmt, True, compile="off")
            assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32)), (rows, cols)
    finally:
        fused.PROCESS.variants.pop(key, None)  # later tests build their own

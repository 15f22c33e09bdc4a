"""The plugin's standard-kernel fast path: the one-call compiled ResQ (`fp4/fused_resq.py`) that
`MegatronFP4Config.prepare_compiled` builds at load serves vLLM's forward (inference mode) and
gives the bits of the trainer's eager path (``compile: off``: the oracle); ``compile: off`` in the
block keeps the plugin eager. Runs in the vLLM environment (skips elsewhere with the reason).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_fp4.fp4 import Numerics, apply_numerics, fused_resq
from megatron_fp4.model.moe import MoELayer, init_moe_params
from megatron_fp4.model.specs import recipe_from_config
from tests.integration.test_vllm_plugin import plugin_config, plugin_moe, tiny_cfg, vllm_ctx  # noqa: F401  (fixture)
from tests.unit.test_fp4_fused import compiled, needs_inductor  # noqa: F401  (fixture)


@needs_inductor
@pytest.mark.parametrize("compile_mode", ["auto", "on", "off"])
def test_standard_kernel_moe_block_serves_the_compiled_resq_with_the_eager_bits(vllm_ctx, compiled, monkeypatch,
                                                                                compile_mode):
    served = []
    run = fused_resq.ResqVariant.run
    monkeypatch.setattr(fused_resq.ResqVariant, "run",
                        lambda self, fns, xb: (served.append(xb.shape) if fns is self.fns else None) or run(self, fns, xb))
    cfg = tiny_cfg("experts", format="nvfp4", rollout_mode="fp4_resq", compile=compile_mode)
    E, k, H, F = 8, 2, 64, 32
    eager = dataclasses.replace(recipe_from_config(cfg.fp4, "fp4_resq"), compile="off")
    ref = MoELayer(H, E, k, F, eager, norm_topk_prob=True).eval()
    init_moe_params(ref, 0.1, 0.1, torch.Generator().manual_seed(1))
    apply_numerics(ref, Numerics(invariance="standard"))
    qc = plugin_config(cfg, "standard")
    assert qc.recipe.compile == compile_mode
    gate_method, gate, experts, moe = plugin_moe(qc, ref, E, k, H, F)  # load: compiles the ResQ unless off
    for seed, tokens in ((2, 37), (3, 5), (4, 1)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, H, generator=g) * torch.logspace(-4, 4, H)
        with torch.no_grad():
            want = ref(x)
        before = len(served)
        with torch.inference_mode():  # as vLLM runs its forward
            got = moe.apply_monolithic(experts, x, gate_method.apply(gate, x))
        assert torch.equal(got, want), (compile_mode, tokens)
        if tokens > 8:  # every expert gets ≥ 2 rows: both expert inputs take the compiled ResQ
            assert (len(served) > before) == (compile_mode != "off"), (compile_mode, served)

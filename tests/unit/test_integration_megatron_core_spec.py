"""`get_moeresq_layer_spec`: a real Megatron-Core GPTModel (local spec, SequentialMLP experts) built
on CPU with its FP4 linears computed by MoEResQ.

Checked in a subprocess (megatron-core's parallel state is process-global): the MoEResQ modules are
exactly our FP4 module plan (`fp4_module_names`, every local expert), the state dict (names,
shapes, values for one seed) is the plain local spec's, and on CPU the MoE layer runs forward and
backward; with ``mode="bf16"`` it is bitwise the plain layer, in FP4 it is not, and an expert's
output is bitwise ``fc2(act(fc1(x)))`` with both GEMMs from `moeresq_linear`. The whole GPTModel also runs forward and backward on CPU
(bitwise the plain model in bf16 mode) once two CUDA-only spots of megatron-core are pointed at the
CPU inside the subprocess (`torch.cuda.current_device`, the CUDA dropout-RNG tracker, an undefined TE symbol without TE).
"""
from __future__ import annotations

import textwrap

from tests.unit.test_integration_megatron_core import run_result_script

_SCRIPT = textwrap.dedent("""
    import json, os, re, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = sys.argv[1]
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron_fp4.config import Config
    from megatron_fp4.fp4.moeresq import moeresq_linear
    from megatron_fp4.integrations.megatron_core import (build_transformer_config, fp4_module_names,
                                                         get_moeresq_layer_spec, is_fp4_parameter, name_moeresq_linears, split_megatron_kwargs,
                                                         to_megatron_transformer_config)

    # megatron-core moves the router weights and rotary frequencies to
    # torch.cuda.current_device() even for CPU tensors (the causal mask is passed explicitly); on this CPU-only build point it at the CPU.
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.transformer.moe.moe_utils as moe_utils  # without TE it never defines this name
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    import contextlib
    from megatron.core import tensor_parallel  # its dropout RNG tracker keeps CUDA generator states
    tensor_parallel.get_cuda_rng_tracker().fork = contextlib.nullcontext

    out = {}
    for mode in ("fp4_resq", "bf16"):
        cfg = Config()
        cfg.model.num_layers, cfg.model.dense_layers, cfg.model.num_shared_experts = 3, [0], 1
        cfg.fp4.train_mode = mode
        tc = build_transformer_config(cfg, use_cpu_initialization=True, moe_token_dispatcher_type="allgather")
        _, gpt_kwargs = split_megatron_kwargs(to_megatron_transformer_config(cfg))
        torch.manual_seed(0)
        gpt = GPTModel(config=tc, transformer_layer_spec=get_moeresq_layer_spec(tc, cfg), **gpt_kwargs)
        torch.manual_seed(0)
        plain = GPTModel(config=tc, transformer_layer_spec=get_gpt_decoder_block_spec(tc, use_transformer_engine=False),
                         **gpt_kwargs)
        names = name_moeresq_linears(gpt)
        sd, psd = gpt.state_dict(), plain.state_dict()
        r = {"names": names, "plan": sorted(fp4_module_names(cfg)),
             "same_keys": sorted(sd) == sorted(psd),
             "same_values": all(torch.equal(sd[k], psd[k]) for k in psd if not k.endswith("_extra_state")),
             "all_fp4_params": all(is_fp4_parameter(n + ".weight", cfg) for n in names),
             "classes": sorted({type(m).__name__ for n, m in gpt.named_modules() if n in names})}
        layer, ref_layer = gpt.decoder.layers[1].mlp, plain.decoder.layers[1].mlp
        x = torch.randn(6, 2, cfg.model.hidden_size, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        y, _ = layer(x)
        y_ref, _ = ref_layer(x.detach())
        y.sum().backward()
        w1 = layer.experts.local_experts[0].linear_fc1
        r["forward_finite"] = bool(torch.isfinite(y).all())
        r["grad_finite"] = bool(torch.isfinite(w1.weight.grad).all() and w1.weight.grad.abs().sum() > 0)
        r["equal_plain"] = torch.equal(y, y_ref)
        expert = layer.experts.local_experts[0]
        xe = x.detach()[:3].reshape(-1, cfg.model.hidden_size)
        h = moeresq_linear(xe, expert.linear_fc1.weight, recipe=expert.linear_fc1.recipe, name=expert.linear_fc1.quant_name)
        h = expert.activation_func(h) if not tc.gated_linear_unit else torch.nn.functional.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]
        want = moeresq_linear(h, expert.linear_fc2.weight, recipe=expert.linear_fc2.recipe, name=expert.linear_fc2.quant_name)
        with torch.no_grad():
            got = expert.linear_fc2(expert.activation_func(expert.linear_fc1(xe)[0]) if not tc.gated_linear_unit
                                    else torch.nn.functional.silu(expert.linear_fc1(xe)[0].chunk(2, -1)[0]) * expert.linear_fc1(xe)[0].chunk(2, -1)[1])[0]
        r["expert_bitwise"] = torch.equal(got, want.detach())
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
        mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)  # True = masked
        logits = gpt(tokens, torch.arange(8).expand(2, 8), mask)
        logits.float().logsumexp(-1).mean().backward()
        r["gpt_forward_backward"] = bool(torch.isfinite(logits).all()) and list(logits.shape) == [2, 8, cfg.model.vocab_size]
        r["gpt_equal_plain"] = torch.equal(logits, plain(tokens, torch.arange(8).expand(2, 8), mask))
        out[mode] = r
    print("RESULT " + json.dumps(out))
""")


def test_moeresq_spec_builds_a_real_gpt_model(tmp_path):
    result = run_result_script(tmp_path / "build_gpt_moeresq.py", _SCRIPT, base_port=29900)
    for mode, r in result.items():
        # every local expert's fc1/fc2 (+ shared experts, dense MLP) and nothing else
        collapsed = sorted({n.split(".local_experts.")[0] + ".linear_fc" + n[-1] if ".local_experts." in n else n
                            for n in r["names"]})
        assert collapsed == r["plan"], (mode, collapsed, r["plan"])
        assert sum(".local_experts." in n for n in r["names"]) == 2 * 2 * 8  # 2 MoE layers × 8 experts × fc1/fc2
        assert r["classes"] == ["MoEResQColumnParallelLinear", "MoEResQRowParallelLinear"]
        assert r["same_keys"] and r["same_values"] and r["all_fp4_params"], (mode, r)
        assert r["forward_finite"] and r["grad_finite"] and r["expert_bitwise"], (mode, r)
        assert r["gpt_forward_backward"], (mode, r)
    assert result["bf16"]["equal_plain"] and not result["fp4_resq"]["equal_plain"]
    assert result["bf16"]["gpt_equal_plain"] and not result["fp4_resq"]["gpt_equal_plain"]

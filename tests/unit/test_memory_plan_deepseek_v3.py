"""The memory planner on the DeepSeek-V3 example config (real shape): it plans without error, and the
planned parameter bytes equal a closed-form count of DeepSeek-V3's parameters (HF's
DeepseekV3ForCausalLM layout: latent attention with q/kv low ranks and their norms, 3 dense layers,
256 routed + 1 shared expert per MoE layer, a router), which is DeepSeek's published 671B for the
main model (the 685B release adds the 14B multi-token-prediction module, not modelled here)."""
from pathlib import Path

import pytest
import torch

from megatron_fp4.config import load_config
from megatron_fp4.training.memory_plan import param_dtype, plan_memory

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "deepseek_v3_671b.yaml"


def deepseek_v3_params(m) -> int:
    H, n = m.hidden_size, m.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    attention = (H * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk
                 + H * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
                 + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim) + n * m.v_head_dim * H + 2 * H)
    dense = 3 * H * m.dense_ffn_hidden_size
    moe = m.num_experts * H + (m.num_experts + m.num_shared_experts) * 3 * H * m.moe_ffn_hidden_size
    k = len(m.dense_layers)
    return m.num_layers * attention + k * dense + (m.num_layers - k) * moe + 2 * m.vocab_size * H + H


def test_single_process_params_are_the_published_count():
    cfg = load_config(CONFIG)
    n = deepseek_v3_params(cfg.model)
    assert abs(n / 671e9 - 1) < 0.01, n
    (plan,) = plan_memory(cfg, 1)
    assert plan.params == n * torch.empty(0, dtype=param_dtype(cfg)).element_size()


@pytest.mark.parametrize("world,overrides", [(64, ["parallel.ep=64"]), (128, ["parallel.pp=8", "parallel.ep=16", "schedule.global_batch_size=256"])])
def test_layouts_plan(world, overrides):
    plans = plan_memory(load_config(CONFIG, overrides), world)
    assert plans and all(p.total > 0 for p in plans)
    single = plan_memory(load_config(CONFIG), 1)[0]
    assert max(p.params for p in plans) < single.params / 8  # experts (and stages) are split

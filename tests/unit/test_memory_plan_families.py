"""The memory planner on the GPT-OSS example configs (real shapes): they plan without error, and the
planned parameter bytes equal a closed-form count of GPT-OSS's parameters (HF's GptOssForCausalLM
layout: q/k/v/o with biases, sinks, two norms, a biased router, experts with biases), which for
gpt-oss-20b / 120b is OpenAI's published 20.91B / 116.83B total; likewise the Qwen3-MoE configs
(30.53B / 235.09B)."""
from pathlib import Path

import pytest
import torch

from megatron_fp4.config import load_config
from megatron_fp4.training.memory_plan import param_dtype, plan_memory

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def gpt_oss_params(m) -> int:
    H, q, kv, E, F = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.num_experts, \
        m.moe_ffn_hidden_size
    attention = (H * q + q) + 2 * (H * kv + kv) + (q * H + H) + m.num_heads + 2 * H
    moe = (E * H + E) + E * (2 * F * H + 2 * F + H * F + H)
    return m.num_layers * (attention + moe) + 2 * m.vocab_size * H + H


@pytest.mark.parametrize("name,world,overrides", [
    ("gpt_oss_20b", 8, ["parallel.ep=8"]), ("gpt_oss_20b", 8, ["parallel.pp=2", "parallel.ep=4"]),
    ("gpt_oss_120b", 16, ["parallel.pp=2", "parallel.ep=8"])])
def test_layouts_plan(name, world, overrides):
    cfg = load_config(CONFIGS / f"{name}.yaml", overrides)
    plans = plan_memory(cfg, world)
    assert plans and all(p.total > 0 for p in plans)
    single = plan_memory(load_config(CONFIGS / f"{name}.yaml"), 1)[0]
    assert max(p.params for p in plans) < single.params  # experts (and stages) are split


def qwen3_moe_params(m) -> int:
    """Qwen3-MoE (HF's Qwen3MoeForCausalLM, untied): q/k/v/o, q/k norms, two norms, router, experts."""
    H, q, kv, E, F = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.num_experts, \
        m.moe_ffn_hidden_size
    attention = 2 * H * q + 2 * H * kv + 2 * m.head_dim + 2 * H
    return m.num_layers * (attention + E * H + 3 * E * F * H) + 2 * m.vocab_size * H + H


@pytest.mark.parametrize("name,count,total_b", [
    ("gpt_oss_20b", gpt_oss_params, 20.91), ("gpt_oss_120b", gpt_oss_params, 116.83),
    ("qwen3_30b_a3b", qwen3_moe_params, 30.53), ("qwen3_235b_a22b", qwen3_moe_params, 235.09)])
def test_single_process_params_are_the_published_count(name, count, total_b):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    n = count(cfg.model)
    assert abs(n / 1e9 - total_b) < 0.01
    (plan,) = plan_memory(cfg, 1)
    assert plan.params == n * torch.empty(0, dtype=param_dtype(cfg)).element_size()

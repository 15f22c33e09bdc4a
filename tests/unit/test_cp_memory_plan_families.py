"""The memory planner's context-parallel attention bytes per model family (`cp_attention_bytes`)
against the saved tensors of one attention layer (the method of tests/unit/test_memory_plan.py).

One process emulates a cp rank: the layer runs on its L = T/cp tokens at their global positions
with the real K/V gather (`context.gather_kv`, `gather_sequence`), whose all-gather is replaced by
the local K/V padded with zeros to the whole length (the gathered values do not change what
autograd saves; the plan's cached position order, which `index_select` saves, is held by the plan,
not an activation). The bytes saved beyond the same layer on its L tokens alone (no cp) must equal
the plan exactly: GQA (qwen3_moe), multi-head latent attention (deepseek_v3: per-head keys after
the latent up-projection, one shared rotary key, v_head_dim ≠ the qk dim) and GPT-OSS (sinks,
eager attention; a sliding-window layer and a full one).
"""
from __future__ import annotations

import functools
import weakref

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.parallel import context
from megatron_fp4.training.memory_activations import cp_attention_bytes, param_dtype

B, T = 2, 16


def _cfg(family: str, dtype: str) -> Config:
    cfg = Config()
    cfg.dtype, cfg.device = dtype, "cpu"
    cfg.numerics.invariance = "standard"
    cfg.fp4.scope, cfg.fp4.train_mode, cfg.fp4.compile = "none", "bf16", "off"
    m = cfg.model
    m.num_layers, m.vocab_size = 2, 32
    if family == "deepseek_v3":  # tests/distributed/test_family_layouts.py's tiny DeepSeek-V3
        m.family, m.num_kv_heads = "deepseek_v3", 4
        m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 16, 16, 8, 4, 12
        m.num_experts, m.top_k, m.moe_n_group, m.moe_topk_group = 8, 2, 4, 2
    elif family == "gpt_oss":
        m.family, m.layer_types, m.sliding_window = "gpt_oss", ["sliding_attention", "full_attention"], 4
    else:
        m.num_kv_heads = 1  # K/V repeated to every query head
    return cfg


def _saved(attn, x, positions, excluded) -> int:
    """Bytes of the unique non-parameter storages autograd saves in `attn`'s forward."""
    keep = {p.untyped_storage().data_ptr() for p in attn.parameters()} | excluded
    packed = []

    def pack(t):
        alias = t.detach()
        packed.append(weakref.ref(alias))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attn(x, positions)
    live = {}
    for ref in packed:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in keep:
            live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert out.requires_grad
    return sum(live.values())


@pytest.mark.parametrize("family, layer", [("qwen3_moe", 0), ("deepseek_v3", 0), ("gpt_oss", 0), ("gpt_oss", 1)])
@pytest.mark.parametrize("cp, dtype, level, seq", [(2, "fp32", "standard", T), (4, "bf16", "standard", T),
                                                   (2, "fp32", "batch", 64), (4, "bf16", "batch", 40)])
def test_cp_attention_bytes_match_saved_tensors(family, layer, cp, dtype, level, seq, monkeypatch):
    """At the ``batch`` level (the block attention on the gathered K/V; 2 × 64 and 2 × 40 tokens:
    partial GEMM row tiles, the local v's tile padding no longer saved) as at the standard one."""
    from megatron_fp4.fp4 import apply_numerics
    from megatron_fp4.model.specs import numerics_from_config

    T = seq
    cfg = _cfg(family, dtype)
    cfg.numerics.invariance = level
    torch.manual_seed(0)
    model = build_model(cfg).to(param_dtype(cfg))
    apply_numerics(model, numerics_from_config(cfg, "train"))
    attn = model.layers[layer].self_attn
    cfg.parallel.cp = cp
    L = T // cp
    x = torch.randn(B, L, cfg.model.hidden_size, dtype=param_dtype(cfg), requires_grad=True)
    alone = _saved(attn, x, torch.arange(L).expand(B, L), set())

    def all_gather(t, group, dim):  # every other rank's tokens: zeros
        return torch.cat([t] + [torch.zeros_like(t)] * (cp - 1), dim=dim)

    monkeypatch.setattr(context, "gather_seq", all_gather)
    plan = context.ContextParallelPlan(None, cp, 0)
    attn.kv_gather = functools.partial(context.gather_kv, plan=plan)
    order = plan.order(T, x.device)
    positions = order[:L].expand(B, L)  # this rank's (load-balanced) global positions
    with_cp = _saved(attn, x, positions, {order.untyped_storage().data_ptr()})
    assert with_cp - alone == cp_attention_bytes(cfg, B, T), (with_cp - alone, cp_attention_bytes(cfg, B, T))

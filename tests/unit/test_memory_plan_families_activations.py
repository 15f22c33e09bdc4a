"""The planner's per-layer activations by model family (`attention_activation_bytes`,
`chunk_activation_bytes`) against what autograd saves (the method of tests/unit/test_memory_plan.py:
unique non-parameter storages held by the graph) and against a hand count of one layer.

- one attention layer of each family (GQA qwen3_moe, MLA deepseek_v3 with and without the q
  low-rank path, GPT-OSS's sink attention on a sliding-window and a full layer), fp32 and bf16:
  planned == saved, exactly;
- the same for one MLA and one GPT-OSS layer written out tensor by tensor with their shapes (an
  independent reference for the formula);
- the whole tiny DeepSeek-V3 and GPT-OSS (tests/distributed/test_family_layouts.py's configs;
  fp32, bf16, FP4 on and off): ``0 <= planned - measured <= Q(W) of the experts the router left
  empty`` (an empty expert saves no Q(W)), the tolerance of test_memory_plan.py's Qwen3-MoE check.
  These run at the standard numerics level (`build_model`'s kernels);
- the ``batch`` level (the trainer's default): `block_attention_bytes` equals `tiled.block_attention`'s
  saved tensors beyond q, k, v exactly on eight shapes (and on one attention layer of each family,
  q, k, v included), and the whole tiny model with the trainer's numerics applied is within the
  standard level's bound (the level's tile-padded GEMM outputs and sigmoid included).
"""
import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.model import build_model
from megatron_fp4.fp4.tiled import block_attention
from megatron_fp4.training.memory_activations import (attention_activation_bytes, attention_is_blocked,
                                                      block_attention_bytes, param_dtype)
from tests.distributed.test_family_layouts import FAMILIES
from tests.unit.test_cp_memory_plan_families import _cfg, _saved
from tests.unit.test_memory_plan import TINY, plan_and_saved

B, T = 2, 16


def _attention_saved(cfg, layer: int) -> int:
    """Bytes one attention layer saves beyond its input x [B, T, hidden]."""
    torch.manual_seed(0)
    attn = build_model(cfg).to(param_dtype(cfg)).layers[layer].self_attn
    x = torch.randn(B, T, cfg.model.hidden_size, dtype=param_dtype(cfg), requires_grad=True)
    return _saved(attn, x, torch.arange(T).expand(B, T), set()) - x.numel() * x.element_size()


@pytest.mark.parametrize("family, layer, q_lora", [("qwen3_moe", 0, 0), ("deepseek_v3", 0, 16), ("deepseek_v3", 0, 0),
                                                   ("gpt_oss", 0, 0), ("gpt_oss", 1, 0)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_attention_bytes_match_saved_tensors(family, layer, q_lora, dtype):
    cfg = _cfg(family, dtype)
    if family == "deepseek_v3":
        cfg.model.q_lora_rank = q_lora
    assert attention_activation_bytes(cfg, B * T, B) == _attention_saved(cfg, layer)


def test_mla_layer_hand_count():
    """The tiny MLA layer (hidden 64, 4 heads, q/kv ranks 16, nope 8, rope 4, v 12), fp32, 32 tokens."""
    cfg = _cfg("deepseek_v3", "fp32")
    t, heads, f32 = 32, 4, 4
    q_path = t * 16 * f32 + t * f32 + t * 16 * f32 + t * 16 * f32  # q_a out (= its upcast), rsqrt, x·rsqrt, q_b in
    kv_path = t * (16 + 4) * f32 + t * f32 + t * 16 * f32 + t * 16 * f32  # kv_a out (whole), rsqrt, x·rsqrt, kv_b in
    rope = 2 * t * 4 * f32  # cos, sin
    sdpa = t * heads * 12 * f32 * 2 + t * heads * (8 + 12) * f32 + t * heads * 12 * f32 + t * heads * f32  # q, k, v, out, lse
    o_in = t * heads * 12 * f32
    hand = q_path + kv_path + rope + sdpa + o_in
    assert hand == 49408
    assert attention_activation_bytes(cfg, t, B) == hand == _attention_saved(cfg, 0)


def test_gpt_oss_layer_hand_count():
    """The tiny GPT-OSS layer (hidden 64, 4 heads of 16, 2 kv heads, window 4), fp32, 2 rows of 16."""
    cfg = _cfg("gpt_oss", "fp32")
    t, heads, d, f32 = 32, 4, 16, 4
    rope = 2 * t * (d // 2) * f32
    qkv = 3 * t * heads * d * f32  # q; k and v repeated to the 4 heads
    mask, max_idx = T * T, t * heads * 8
    probs = t * heads * (T + 1) * f32  # softmax over 16 keys and the sink
    o_in = t * heads * d * f32
    hand = rope + qkv + mask + max_idx + probs + o_in
    assert hand == 44800
    for layer in (0, 1):  # sliding window, full: the same tensors
        assert attention_activation_bytes(cfg, t, B) == hand == _attention_saved(cfg, layer)


def _whole_model(family, extra):
    cfg = load_config(default_config_path(), TINY + extra)
    FAMILIES[family](cfg.model)
    cfg.validate()
    return plan_and_saved(cfg)


@pytest.mark.parametrize("extra", [[], ["fp4.scope=none"], ["dtype=bf16"]])
def test_deepseek_v3_model_activation_bytes_match_saved_tensors(extra):
    planned, measured, slack = _whole_model("deepseek_v3", extra)
    assert 0 <= planned - measured <= slack, (planned, measured, slack)


@pytest.mark.parametrize("extra", [[], ["fp4.scope=none"], ["dtype=bf16"], ["fp4.scope=experts+attention"],
                                   ["fp4.scope=none", "model.router_aux_loss_coef=0", "model.router_z_loss_coef=0"]])
def test_gpt_oss_model_activation_bytes_match_saved_tensors(extra):
    """GPT-OSS's MoE: the router's softmax over the top-k logits (over all experts only for the aux
    loss), the clamped SwiGLU's three more per-row tensors, the per-expert loop (no grouped offsets)."""
    planned, measured, slack = _whole_model("gpt_oss", extra)
    assert 0 <= planned - measured <= slack, (planned, measured, slack)


@pytest.mark.parametrize("shape", [(1, 2, 1, 40, 8, 8), (1, 2, 1, 150, 8, 8), (2, 8, 4, 128, 64, 64), (1, 1, 1, 10, 8, 8),
                                   (2, 4, 4, 100, 24, 12), (1, 4, 1, 16, 16, 16), (1, 3, 1, 70, 8, 20), (1, 1, 1, 65, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_attention_bytes_match_saved_tensors(shape, dtype):
    """`block_attention_bytes` (the ``batch`` level's attention: its output and log-sum-exp) equals
    what `tiled.block_attention` saves beyond q, k and v, exactly: one and several tiles and blocks,
    GQA (kv heads shared by 2–8 query heads) and MHA, value dims below the kernel's minimum width and above it."""
    B, H, KV, T, D, Dv = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, KV, D, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, KV, Dv, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    excluded = {t.untyped_storage().data_ptr() for t in (q, k, v)}

    class Wrap(torch.nn.Module):
        def forward(self, x, positions):
            return block_attention(q, k, v, positions, torch.zeros(B, dtype=torch.long))

    measured = _saved(Wrap(), None, torch.arange(T).expand(B, T), excluded)
    assert measured == block_attention_bytes(B * KV, H // KV, T, Dv, dtype.itemsize)


@pytest.mark.parametrize("family, layer, q_lora", [("qwen3_moe", 0, 0), ("deepseek_v3", 0, 16), ("deepseek_v3", 0, 0),
                                                   ("gpt_oss", 0, 0), ("gpt_oss", 1, 0)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("seq", [128, 20])
def test_batch_level_attention_bytes_match_saved_tensors(family, layer, q_lora, dtype, seq):
    """One attention layer at the ``batch`` level (its numerics applied as the trainer does): q, k,
    v as the block attention saves them, its output and log-sum-exp, the rest of the layer — exactly.
    2 rows of 128 tokens (two key blocks, whole GEMM row tiles) and of 20 (partial row tiles: the
    projections' saved outputs keep their zero-padded rows, `tiled_rows`)."""
    from megatron_fp4.fp4 import apply_numerics
    from megatron_fp4.model.specs import numerics_from_config

    rows = 2
    cfg = _cfg(family, dtype)
    cfg.numerics.invariance = "batch"
    if family == "deepseek_v3":
        cfg.model.q_lora_rank = q_lora
    assert attention_is_blocked(cfg)
    torch.manual_seed(0)
    model = build_model(cfg).to(param_dtype(cfg))
    apply_numerics(model, numerics_from_config(cfg, "train"))
    x = torch.randn(rows, seq, cfg.model.hidden_size, dtype=param_dtype(cfg), requires_grad=True)
    saved = _saved(model.layers[layer].self_attn, x, torch.arange(seq).expand(rows, seq), set())
    assert attention_activation_bytes(cfg, rows * seq, rows) == saved - x.numel() * x.element_size()


@pytest.mark.parametrize("family, extra", [
    ("qwen3_moe", []), ("qwen3_moe", ["fp4.scope=none", "schedule.seq_len=100"]),
    ("qwen3_moe", ["dtype=bf16", "fp4.scope=none", "schedule.seq_len=20", "model.dense_layers=[1]",
                   "model.num_shared_experts=2"]),
    ("qwen3_moe", ["model.num_kv_heads=1", "fp4.scope=experts+attention", "schedule.seq_len=24"]),
    ("deepseek_v3", []), ("deepseek_v3", ["dtype=bf16", "fp4.scope=none", "schedule.seq_len=20"]),
    ("gpt_oss", ["schedule.seq_len=128"]), ("gpt_oss", ["fp4.scope=none"]), ("gpt_oss", ["dtype=bf16"])])
def test_batch_level_model_activation_bytes(family, extra):
    """The whole tiny model at the trainer's default ``batch`` level (its numerics applied as the
    trainer does) against what autograd saves, with the bound of the standard level's checks:
    ``0 <= planned - measured <=`` Q(W) of the experts the router left empty (exactly equal with
    FP4 off). Covers the level's own terms: the tile-padded rows of the bias-free projections'
    saved outputs at partial row tiles (2 × 20, 24, 32, 100 tokens: `tiled_rows`), GPT-OSS's and
    DeepSeek-V3's sigmoid as ``1 / (1 + exp(−z))``, no grouped-GEMM offsets (the tiled grouped experts)."""
    from megatron_fp4.fp4 import apply_numerics
    from megatron_fp4.model.specs import numerics_from_config

    cfg = load_config(default_config_path(), [t for t in TINY if not t.startswith("numerics.")] + extra)
    if family != "qwen3_moe":
        FAMILIES[family](cfg.model)
    cfg.validate()
    assert attention_is_blocked(cfg)
    planned, measured, slack = plan_and_saved(cfg, numerics=numerics_from_config(cfg, "train"), apply=apply_numerics)
    assert 0 <= planned - measured <= slack, (family, extra, planned, measured, slack)

"""The ``batch`` level's block attention under autograd (`tiled._BlockAttention`,
`fp4/block_attention_grad.py`): a flash-style backward from q, k, v, the output and the rows'
log-sum-exp.

- gradients (dq, dk, dv, dsinks) against autograd through a plain float64 softmax attention with the
  same masks: Qwen3 (GQA), DeepSeek-V3 (MLA: value dim ≠ key dim, its own scale), GPT-OSS (sliding
  window + sinks), left-padded rows, a decode-shaped Tq < Tk; with the default chunks (64 query
  positions) and with chunks of 7 positions; fp32 within 1e-5 of the reference's largest
  entry (measured ≤ 1e-6), bf16 inputs within 2e-2 (their own rounding);
- the forward under autograd gives the no-grad forward's bits;
- saved bytes grow linearly with T: at 2T about twice those at T (the per-block autograd graph it
  replaced saved O(T²): a ratio ~4);
- the whole tiny model's parameter gradients at the ``batch`` level equal the ``standard`` level's
  within 1e-5 (relative, whole-gradient norm; measured 1.6e-7), Qwen3-MoE, DeepSeek-V3 and GPT-OSS.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import block_attention_grad
from megatron_fp4.fp4.tiled import block_attention


def _reference(q, k, v, positions, pad, scale, window, sinks):
    """Softmax attention by position in float64 (autograd through it): key slot s of row b is key
    s − pad[b]; a query at p sees the keys 0 ≤ j ≤ p (and j > p − window); the sink joins the softmax."""
    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    rep = H // KV
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    kp = torch.arange(Tk)[None, None, :] - pad[:, None, None]
    qp = positions[:, :, None]
    seen = (kp >= 0) & (kp <= qp)
    if window:
        seen &= kp > qp - window
    s = s.masked_fill(~seen[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, Tq, 1)], -1)
    p = s.softmax(-1)
    return (p[..., :Tk] if sinks is not None else p) @ v.repeat_interleave(rep, 1)


CASES = {  # B, H, KV, Tk, Tq, D, Dv, scale, window, sinks, pads
    "qwen3_gqa": (3, 4, 2, 150, 150, 32, 32, None, 0, False, [0, 7, 70]),
    "deepseek_mla": (2, 3, 3, 90, 90, 24, 12, 0.17, 0, False, [0, 5]),
    "gpt_oss_window_sinks": (2, 4, 2, 140, 140, 16, 16, None, 40, True, [0, 9]),
    "decode_tq_lt_tk": (2, 4, 1, 100, 3, 16, 16, None, 0, False, [0, 11]),
    "decode_window_sinks": (2, 4, 2, 130, 2, 16, 16, None, 70, True, [4, 0]),
    "plain_causal": (2, 4, 2, 70, 70, 16, 16, None, 0, False, [0, 0]),  # fp32: ATen's flash backward
}


def _inputs(case, dtype, seed=0):
    B, H, KV, Tk, Tq, D, Dv, scale, window, sinks, pads = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()  # a model's layout
    k = torch.randn(B, KV, Tk, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, KV, Tk, Dv, generator=g).to(dtype).requires_grad_()
    s = torch.randn(H, generator=g).to(dtype).requires_grad_() if sinks else None
    pad = torch.tensor(pads)
    positions = (torch.arange(Tk - Tq, Tk)[None, :] - pad[:, None]).clamp(min=0)  # left-padding queries: at 0
    return q, k, v, positions, pad, scale, window, s


@pytest.mark.parametrize("chunk", [None, 7], ids=["default_chunks", "chunks_of_7_positions"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_gradients_match_float64_reference(case, chunk, dtype, tol, monkeypatch):
    if chunk is not None:  # chunks of a few query positions: many chunks, none aligned with a key block
        B, H, _, Tk = CASES[case][:4]
        monkeypatch.setattr(block_attention_grad, "BACKWARD_CHUNK_ELEMENTS", chunk * B * H * Tk)
    q, k, v, positions, pad, scale, window, sinks = _inputs(case, dtype)
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    out = block_attention(q, k, v, positions, pad, scale, window, sinks)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(out, leaves, d_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rq, rk, rv = ref_leaves[:3]
    ref_out = _reference(rq, rk, rv, positions, pad, scale, window, ref_leaves[3] if sinks is not None else None)
    want = torch.autograd.grad(ref_out, ref_leaves, d_out.double())
    assert float((out.detach().double() - ref_out.detach()).abs().max()) <= tol * float(ref_out.detach().abs().max())
    for name, a, b in zip("q k v sinks".split(), got, want):
        assert a.dtype == dtype and a.shape == b.shape
        err, size = float((a.double() - b).abs().max()), float(b.abs().max())
        assert err <= tol * size, (name, err, size)


def test_plain_causal_rows_take_the_flash_backward_and_agree_with_the_chunked_one(monkeypatch):
    """fp32 rows without padding at positions 0..T−1 (a training micro-batch) go through ATen's CPU
    flash backward; its gradients equal the chunked backward's (FLASH_MAX_KEYS = 0 forces it) within
    fp32 rounding of the same sums: 1e-5 of the largest entry (measured ≤ 1e-6); a padded row does not."""
    q, k, v, positions, pad, scale, window, sinks = _inputs("plain_causal", torch.float32)
    assert block_attention_grad._plain_causal(q, k, v, torch.zeros(1), positions, pad, window, sinks)
    assert not block_attention_grad._plain_causal(q, k, v, torch.zeros(1), positions, pad + 1, window, sinks)
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    flash = torch.autograd.grad(block_attention(q, k, v, positions, pad), (q, k, v), d_out)
    monkeypatch.setattr(block_attention_grad, "FLASH_MAX_KEYS", 0)
    chunked = torch.autograd.grad(block_attention(q, k, v, positions, pad), (q, k, v), d_out)
    for name, a, b in zip("qkv", flash, chunked):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), name


@pytest.mark.parametrize("case", ["qwen3_gqa", "gpt_oss_window_sinks", "decode_tq_lt_tk"])
def test_forward_under_autograd_is_the_no_grad_forward_bitwise(case):
    q, k, v, positions, pad, scale, window, sinks = _inputs(case, torch.float32)
    trained = block_attention(q, k, v, positions, pad, scale, window, sinks)
    with torch.no_grad():
        scored = block_attention(q, k, v, positions, pad, scale, window, sinks)
    assert trained.requires_grad
    assert torch.equal(trained.detach().view(torch.int32), scored.contiguous().view(torch.int32))



def test_selective_recompute_gives_the_plain_gradients_bitwise():
    """Under selective recompute (`model/recompute.py`: default-overload GEMM outputs kept, every
    other op re-run) the gradients are a plain backward's, bit for bit, with no flag telling the
    policy it runs inside block attention: the forward changes in place only buffers it wrote through
    ``out=``. (A default-overload score product changed in place is a kept output mutated: torch
    raises in the recompute.) Three key blocks, the later ones read by some query tiles only; a
    sliding window and sinks."""
    from megatron_fp4.model.recompute import checkpointed

    q, k, v, positions, pad, scale, window, sinks = _inputs("gpt_oss_window_sinks", torch.float32)
    leaves = tuple(t for t in (q, k, v, sinks) if t is not None)

    def attend(q, k, v, *s):
        return block_attention(q, k, v, positions, pad, scale, window, s[0] if s else None)

    d_out = torch.randn(attend(*leaves).shape, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad(attend(*leaves), leaves, d_out)
    got = torch.autograd.grad(checkpointed(attend, leaves, (), selective=True), leaves, d_out)
    for name, a, b in zip("q k v sinks".split(), got, want):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name

def _saved_bytes(T: int) -> int:
    """Bytes of the unique storages block attention saves for autograd beyond q, k and v, at T tokens."""
    B, H, KV, D = 1, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=g).requires_grad_() for h in (H, KV, KV))
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block_attention(q, k, v, torch.arange(T)[None], torch.zeros(B, dtype=torch.long))
    assert out.requires_grad
    return sum(saved.values())


def test_saved_bytes_grow_linearly_in_sequence_length():
    """O(T): the output and the log-sum-exp only. The per-block graph saved scores, weights and masks
    per (query tile, key block): ~4× at 2T (measured 3.9 at 512 → 1024)."""
    small, large = _saved_bytes(512), _saved_bytes(1024)
    assert small == 1 * 4 * 512 * 16 * 4 + 1 * 2 * 2 * 512 * 4  # out [B, H, T, D] fp32; lse [B, KV, rep·T] fp32
    assert 1.9 <= large / small <= 2.1, (small, large)


@pytest.mark.parametrize("family, packed", [("qwen3_moe", False), ("qwen3_moe", True), ("deepseek_v3", False),
                                            ("gpt_oss", False)])
def test_tiny_model_gradients_batch_level_equal_standard_level(family, packed):
    """Left-padded rows (the first row's 9 leading slots), or packed rows (sequences of 30, 25 and
    15 tokens back to back: unpacked into right-padded rows for the attention, `model/packing.py`)."""
    from megatron_fp4.config import Config
    from megatron_fp4.fp4 import apply_numerics
    from megatron_fp4.model import build_model
    from megatron_fp4.model.specs import numerics_from_config
    from tests.distributed.test_family_layouts import FAMILIES

    grads = {}
    for level in ("standard", "batch"):
        cfg = Config()
        if family != "qwen3_moe":
            FAMILIES[family](cfg.model)
        cfg.model.num_layers, cfg.fp4.scope = 2, "none"
        cfg.numerics.invariance = level
        model = build_model(cfg, seed=7)
        tokens = torch.randint(1, cfg.model.vocab_size, (3, 70), generator=torch.Generator().manual_seed(3))
        apply_numerics(model, numerics_from_config(cfg, "train"))
        if packed:
            from megatron_fp4.model.packing import segment_positions
            mask = torch.tensor([1] * 30 + [2] * 25 + [3] * 15).expand(3, 70)
            logits = model(tokens, positions=segment_positions(mask), attention_mask=mask).logits
        else:
            mask = torch.ones(3, 70, dtype=torch.long)
            mask[0, :9] = 0
            logits = model(tokens, positions=(torch.arange(70) - 9 * (1 - mask[:, :1])).clamp(min=0),
                           attention_mask=mask).logits * mask[..., None]
        logits.float().square().mean().backward()
        grads[level] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    ref, got = grads["standard"].double(), grads["batch"].double()
    assert got.shape == ref.shape
    assert float((got - ref).norm() / ref.norm()) <= 1e-5, float((got - ref).norm() / ref.norm())


def test_positions_written_in_place_after_the_forward_are_refused():
    """The backward recomputes the scores from the forward's positions: a write into them in between
    would give the gradients of other scores, so it is refused with the fix named."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 8, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 1, 8, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 1, 8, 16, generator=g, requires_grad=True)
    positions = torch.arange(8)[None].clone()
    out = block_attention(q, k, v, positions, torch.zeros(1, dtype=torch.long))
    positions.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()

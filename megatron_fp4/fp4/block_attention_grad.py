"""The backward of the ``batch`` level's block attention (`tiled.block_attention`), flash style: the
forward saved q, k, v, the output O and each query row's log-sum-exp L (m + log l, the sink's term
included), and this recomputes the scores of each chunk of query positions (every query head of a
kv head) against the keys they can see — O(chunk × Tk) at a time, nothing O(T²) kept — with the forward's masks (positions, left padding,
causal, sliding window; GQA's rep query heads per kv head; value width ≠ key width):

    P = exp(S − L) on the visible keys (0 elsewhere),  δ = rowsum(dO ∘ O),
    dV = Pᵀ dO,  dS = P ∘ (dO Vᵀ − δ),  dQ = scale · dS K,  dK = scale · dSᵀ Q,
    d sink_h = −Σ_rows of head h  exp(sink_h − L) · δ.

Gradients sum over the batch and chunks, so (as the autograd graph it replaces) this is not batch
invariant; it runs in float32 for narrower dtypes (its sums and the exp of the recomputed scores).
"""
from __future__ import annotations

from typing import Optional

import torch

FLASH_MAX_KEYS = 128  # plain causal rows up to this many keys: ATen's CPU flash backward (`_flash_backward`)
BACKWARD_CHUNK_ELEMENTS = 1 << 21  # score elements of one chunk of query positions (× a few temporaries)
POSITION_CHUNK = 64  # query positions of a chunk at most: a causal chunk reads the keys up to its last one only


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       d_out: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor, scale: Optional[float],
                       window: int, sinks: Optional[torch.Tensor]) -> tuple:
    """(dq, dk, dv, dsinks or None) of block attention: q [B, H, Tq, D], k [B, KV, Tk, D],
    v [B, KV, Tk, Dv], out and d_out [B, H, Tq, Dv], lse [B, KV, rep·Tq] (query rows of a kv head
    rep-major, as the forward tiles them), positions [B, Tq], pad [B] (`tiled.block_attention`).
    Chunks of query positions (all rep heads of a kv head together: one mask for them)."""
    B, H, Tq, D = q.shape
    KV, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = H // KV
    scale = D ** -0.5 if scale is None else scale
    if _plain_causal(q, k, v, lse, positions, pad, window, sinks):
        return _flash_backward(q, k, v, out, lse, d_out, scale)
    wide = lse.dtype
    qs = q.reshape(B, KV, rep, Tq, D).to(wide) * scale  # scaled once: dK = dSᵀ (scale · Q)
    kf, vf = k.to(wide), v.to(wide)
    do = d_out.reshape(B, KV, rep, Tq, Dv).to(wide)
    delta = (do * out.reshape(B, KV, rep, Tq, Dv).to(wide)).sum(-1)  # [B, KV, rep, Tq]
    lse = lse.view(B, KV, rep, Tq)
    k_pos = (torch.arange(Tk, device=q.device)[None, :] - pad[:, None]).view(B, 1, 1, 1, Tk)  # slot s: key s − pad[b]
    dq = torch.empty_like(qs)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    chunk = max(1, min(POSITION_CHUNK, BACKWARD_CHUNK_ELEMENTS // max(1, B * H * Tk)))
    for t0 in range(0, Tq, chunk):
        t1 = min(Tq, t0 + chunk)
        n = rep * (t1 - t0)
        pos = positions[:, t0:t1].reshape(B, 1, 1, t1 - t0, 1)
        # the chunk's keys end at the last slot its queries can see (causal: the early chunks read fewer)
        hi = int((pos.amax(dim=(1, 2, 3, 4)) + pad).clamp(max=Tk - 1).max()) + 1
        kp = k_pos[..., :hi]
        visible = (kp >= 0) & (kp <= pos)  # [B, 1, 1, chunk, hi]: the same for every head
        if window:
            visible &= kp > pos - window
        qc = qs[:, :, :, t0:t1].reshape(B, KV, n, D)
        doc = do[:, :, :, t0:t1].reshape(B, KV, n, Dv)
        kc, vc = kf[:, :, :hi], vf[:, :, :hi]
        s = torch.matmul(qc, kc.transpose(-1, -2)).view(B, KV, rep, t1 - t0, hi)
        p = torch.where(visible, s.sub_(lse[:, :, :, t0:t1, None]).exp_(), 0.0)
        ds = torch.matmul(doc, vc.transpose(-1, -2)).view(B, KV, rep, t1 - t0, hi)
        ds = ds.sub_(delta[:, :, :, t0:t1, None]).mul_(p).view(B, KV, n, hi)
        p = p.view(B, KV, n, hi)
        dv[:, :, :hi] += torch.matmul(p.transpose(-1, -2), doc)
        dq[:, :, :, t0:t1] = torch.matmul(ds, kc).view(B, KV, rep, t1 - t0, D)
        dk[:, :, :hi] += torch.matmul(ds.transpose(-1, -2), qc)
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp(sinks.to(wide).view(1, KV, rep, 1) - lse)
        dsinks = -(p_sink * delta).sum((0, 3)).reshape(H).to(sinks.dtype)
    return ((dq * scale).view(B, H, Tq, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks)


_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _plain_causal(q, k, v, lse, positions, pad, window, sinks) -> bool:
    """Whether the backward may be ATen's CPU flash-attention backward (`_flash_backward`): fp32 on
    the CPU, no sink or window, equal key and value widths, no padding, every row's queries at
    positions 0..T−1 over its T keys (plain causal), T at most FLASH_MAX_KEYS. Measured (one
    thread, fp32, causal, GQA): at head dim 16 the flash backward took 0.54-0.75× the chunked one
    for T = 64-256; at head dim 64 0.83× at T = 64, 1.04× at 128, 1.28-1.37× at 256-512."""
    B, _, Tq, D = q.shape
    Tk = k.shape[2]
    if (_FLASH_BACKWARD is None or q.device.type != "cpu" or sinks is not None or window or Tq != Tk
            or Tk > FLASH_MAX_KEYS or v.shape[-1] != D
            or not q.dtype == k.dtype == v.dtype == lse.dtype == torch.float32):
        return False
    return not bool(pad.any()) and bool(torch.equal(positions, torch.arange(Tq, device=positions.device).expand(B, Tq)))


def _flash_backward(q, k, v, out, lse, d_out, scale) -> tuple:
    """(dq, dk, dv, None) by ATen's CPU flash-attention backward with ``is_causal`` (the forward's
    row log-sum-exp L as its logsumexp: it recomputes P = exp(scale · QKᵀ − L)), the kv heads
    repeated for the rep query heads and their gradients summed back (GQA)."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    rep = H // KV
    kr, vr = (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
    dq, dk, dv = _FLASH_BACKWARD(d_out.contiguous(), q, kr, vr, out, lse.reshape(B, H, T), 0.0, True, scale=scale)
    if rep > 1:
        dk, dv = dk.view(B, KV, rep, T, D).sum(2), dv.view(B, KV, rep, T, D).sum(2)
    return dq, dk, dv, None

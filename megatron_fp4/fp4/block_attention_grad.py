"""The backward of the ``batch`` level's block attention (`tiled.block_attention`), flash style: the
forward saved q, k, v, the output O and each query row's log-sum-exp L (m + log l, the sink's term
included), and this recomputes each chunk of query rows' scores against the keys they can see —
O(chunk × Tk) at a time, nothing O(T²) kept — with the forward's masks (positions, left padding,
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

BACKWARD_CHUNK_ELEMENTS = 1 << 21  # score elements of one chunk of query rows (× a few temporaries)


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       d_out: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor, scale: Optional[float],
                       window: int, sinks: Optional[torch.Tensor]) -> tuple:
    """(dq, dk, dv, dsinks or None) of block attention: q [B, H, Tq, D], k [B, KV, Tk, D],
    v [B, KV, Tk, Dv], out and d_out [B, H, Tq, Dv], lse [B, KV, rep·Tq] (query rows of a kv head
    rep-major, as the forward tiles them), positions [B, Tq], pad [B] (`tiled.block_attention`)."""
    B, H, Tq, D = q.shape
    KV, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    rep, R = H // KV, H // KV * Tq
    scale = D ** -0.5 if scale is None else scale
    wide = lse.dtype
    qf = q.reshape(B, KV, R, D).to(wide)
    kf, vf = k.to(wide), v.to(wide)
    do = d_out.reshape(B, KV, R, Dv).to(wide)
    delta = (do * out.reshape(B, KV, R, Dv).to(wide)).sum(-1)  # [B, KV, R]
    q_pos = positions[:, None, :].expand(B, rep, Tq).reshape(B, 1, R, 1)  # row r of a kv head: query r mod Tq
    k_pos = (torch.arange(Tk, device=q.device)[None, :] - pad[:, None]).view(B, 1, 1, Tk)  # slot s: key s − pad[b]
    dq = torch.empty_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    chunk = max(1, BACKWARD_CHUNK_ELEMENTS // max(1, B * KV * Tk))
    for r0 in range(0, R, chunk):
        r1 = min(R, r0 + chunk)
        pos = q_pos[:, :, r0:r1]
        # the chunk's keys end at the last slot its queries can see (causal: the early chunks read fewer)
        hi = int((pos.amax(dim=(1, 2, 3)) + pad).clamp(max=Tk - 1).max()) + 1
        kp = k_pos[..., :hi]
        visible = (kp >= 0) & (kp <= pos)
        if window:
            visible &= kp > pos - window
        qc, kc, vc, doc = qf[:, :, r0:r1], kf[:, :, :hi], vf[:, :, :hi], do[:, :, r0:r1]
        s = torch.matmul(qc, kc.transpose(-1, -2)).mul_(scale)
        p = torch.where(visible, (s - lse[:, :, r0:r1, None]).exp_(), 0.0)
        dv[:, :, :hi] += torch.matmul(p.transpose(-1, -2), doc)
        ds = torch.matmul(doc, vc.transpose(-1, -2)).sub_(delta[:, :, r0:r1, None]).mul_(p).mul_(scale)
        dq[:, :, r0:r1] = torch.matmul(ds, kc)
        dk[:, :, :hi] += torch.matmul(ds.transpose(-1, -2), qc)
    dsinks = None
    if sinks is not None:
        sink = sinks.to(wide).view(1, KV, rep, 1)
        p_sink = torch.exp(sink - lse.view(B, KV, rep, Tq))
        dsinks = -(p_sink * delta.view(B, KV, rep, Tq)).sum((0, 3)).reshape(H).to(sinks.dtype)
    return (dq.view(B, KV, rep, Tq, D).reshape(B, H, Tq, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks)

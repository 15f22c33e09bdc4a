"""MoE balancing beyond the Switch loss (`moe.MoELayer`): DeepSeek-V3's sequence-wise balance loss
and its aux-loss-free balancing, whose per-expert router bias (`moe.Router.expert_bias`, used for
the top-k selection only) moves outside the gradient after each optimizer step."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


def seq_balance_loss(probs: torch.Tensor, topk_idx: torch.Tensor, valid: Optional[torch.Tensor], batch: int):
    """DeepSeek-V3's complementary sequence-wise balance loss, mean over the `batch` sequences of
    ``Σ_e f_e·P_e`` with ``f_e = E/(k·T_s)·#{t: e in top-k(t)}`` and ``P_e = 1/T_s·Σ_t p_{t,e}`` over
    each sequence's T_s real tokens (`valid`, None: all); sequences without one are left out."""
    E, k = probs.shape[-1], topk_idx.shape[-1]
    p = probs.reshape(batch, -1, E)
    w = torch.ones(p.shape[:2], dtype=p.dtype, device=p.device) if valid is None else \
        valid.reshape(batch, -1).to(p.dtype)
    n = w.sum(1)
    counts = torch.zeros(batch, E, dtype=p.dtype, device=p.device).scatter_add_(
        1, topk_idx.reshape(batch, -1), w.repeat_interleave(k, dim=1))
    per_seq = E * (counts / (k * n.clamp_min(1))[:, None] * (p * w[..., None]).sum(1) / n.clamp_min(1)[:, None]).sum(1)
    has = (n > 0).to(p.dtype)
    return (per_seq * has).sum() / has.sum().clamp_min(1)


def update_expert_bias(model: nn.Module, applied: bool = True, group=None) -> None:
    """Aux-loss-free balancing, after the optimizer step (outside the gradient): every MoE layer's
    router bias moves by ``rate · sign(mean_load - load)`` (DeepSeek-V3), the load being the real
    tokens per expert since the last call, summed over `group` (the data-parallel ranks of this
    stage, so every replica keeps the same bias); then the counts restart. ``applied=False`` (a
    skipped step): only the restart. Collective over `group` on every rank; no-op without a bias."""
    layers = [m for m in model.modules() if getattr(m, "tokens_per_expert", None) is not None]
    if not layers:
        return
    loads = torch.stack([m.tokens_per_expert for m in layers])
    if group is not None:
        dist.all_reduce(loads, group=group)
    with torch.no_grad():
        for m, load in zip(layers, loads):
            if applied:
                step = torch.sign(load.mean() - load) * m.bias_update_rate
                m.router.expert_bias += step.to(m.router.expert_bias.dtype)
            m.tokens_per_expert.zero_()

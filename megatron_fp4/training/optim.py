"""The warmup + cosine LR schedule and global grad-norm clipping of the one optimizer.

The optimizer itself is `parallel.zero.ZeroAdamW` at every size (a single process is a dp group of
size 1: no padding, no collectives, the same `torch.optim.AdamW(fused=True)` math element for element).
"""
from __future__ import annotations

import math


def lr_at(step: int, opt_cfg, sched_cfg) -> float:
    """Linear warmup over `warmup_steps` (reaching lr at step warmup), then cosine decay to min_lr
    at `train_steps` (Megatron's schedule). `step` counts optimizer steps already taken."""
    warmup, total = sched_cfg.warmup_steps, sched_cfg.train_steps
    if warmup > 0 and step < warmup:
        return opt_cfg.lr * (step + 1) / warmup
    if total <= warmup:
        return opt_cfg.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return opt_cfg.min_lr + 0.5 * (opt_cfg.lr - opt_cfg.min_lr) * (1 + math.cos(math.pi * progress))


def clip_coefficient(grad_norm: float, clip_grad: float) -> float:
    if clip_grad <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, clip_grad / (grad_norm + 1e-6))

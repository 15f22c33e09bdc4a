"""AdamW with fp32 master weights, the warmup + cosine LR schedule, global grad-norm clipping.

`MasterWeightAdamW` is the single-process optimizer; `parallel/zero.py` provides the sharded one
with the same interface (`zero_grad`, `finish_grad_sync`, `grad_norm`, `step(lr, clip_coef)`,
`state_dict`, `load_state_dict`), so the trainer does not care which it holds.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megatron_fp4.model.layers import upcast, wide_dtype
from megatron_fp4.model.specs import no_weight_decay


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


class MasterWeightAdamW:
    """torch.optim.AdamW over fp32 master copies of the model's parameters.

    With fp32 params the master *is* the param (no copy). With bf16 params, grads are upcast into
    the fp32 masters, AdamW steps in fp32, and the result is rounded back into the bf16 params.
    """

    def __init__(self, named_params, opt_cfg):
        self.opt_cfg = opt_cfg
        self.params, self.masters, self.names = [], [], []
        decay, no_decay = [], []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            wide = wide_dtype(p.dtype)
            master = p if p.dtype == wide else nn.Parameter(p.detach().to(wide).clone())
            self.params.append(p)
            self.masters.append(master)
            self.names.append(name)
            (no_decay if no_weight_decay(name, p) else decay).append(master)
        groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=opt_cfg.lr,
                                           betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps)

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    def finish_grad_sync(self) -> None:
        """Single process: nothing to reduce."""

    def grad_norm(self) -> float:
        """Global L2 norm of all gradients (fp32 accumulation); inf/nan propagate."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        return torch.linalg.vector_norm(torch.stack([upcast(g).norm() for g in grads])).item()

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0) -> None:
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = torch.zeros_like(m)
            elif m is not p:
                m.grad = p.grad.to(m.dtype)
            if clip_coef != 1.0:
                m.grad.mul_(clip_coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": {n: m.detach() for n, m, p in zip(self.names, self.masters, self.params) if m is not p}}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        by_name = dict(zip(self.names, self.masters))
        with torch.no_grad():
            for name, value in state.get("masters", {}).items():
                by_name[name].copy_(value)

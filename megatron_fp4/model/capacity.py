"""Expert capacity with token dropping (Megatron-Core's `moe_expert_capacity_factor`).

Each expert takes at most

    capacity = ceil(T * k / E * capacity_factor)

(token, slot) pairs of a forward call of T tokens (`expert_capacity`, Megatron-Core's
``get_capacity(num_tokens * topk, num_experts, capacity_factor)``); the pairs over it are dropped:
the token skips that expert (its other experts still count, their combine weights are not
renormalised, as in Megatron-Core), and a token that loses every slot passes through the layer as the
residual alone.

Drop order (`capacity_keep`), the same on every run and every CPU/GPU:

- ``probs`` (Megatron-Core's default): an expert keeps the pairs with the largest combine weights;
  equal weights keep the earlier token.
- ``position``: an expert keeps the earliest tokens of the call (flattened [batch, seq] order).

Megatron-Core picks with ``torch.topk`` over the token dim, whose choice among equal values is not
specified; here ties are broken by token position explicitly, so a layout that feeds the same
micro-batch to a layer drops the same pairs.

The capacity depends on how many tokens a forward call holds, so a rollout engine (decode steps of
a few tokens, batches of other prompts) would drop other tokens than the trainer: RL refuses the
option (`refuse_for_rollout`).
"""
from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs one expert may take from a call of `num_tokens` tokens routed to `top_k` experts each."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity factor {capacity_factor} must be > 0 (or None: no capacity, nothing dropped)")
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def capacity_keep(topk_idx: torch.Tensor, topk_w: torch.Tensor, num_experts: int, capacity: int,
                  policy: str = "probs") -> torch.Tensor:
    """keep [T, k] bool: which (token, slot) pairs of `topk_idx` [T, k] fit their expert's capacity
    under `policy` (see the module docstring for the order)."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"drop policy {policy!r}: use one of {', '.join(DROP_POLICIES)}")
    T, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    n = flat.numel()
    if policy == "probs":
        # stable sorts: by weight descending, then by expert -> within an expert, weight descending,
        # equal weights in token order (the flattened index grows with the token)
        order = torch.argsort(-topk_w.reshape(-1).to(torch.float64), stable=True)
        order = order[torch.argsort(flat[order], stable=True)]
    else:
        order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(n, device=flat.device) - starts[flat[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    return (rank < capacity).view(T, k)


def refuse_for_rollout(capacity_factor) -> None:
    """Raise when a model with a capacity factor is asked to roll out (see the module docstring)."""
    if capacity_factor is not None:
        raise ValueError(
            f"model.moe_capacity_factor={capacity_factor}: token dropping depends on the tokens of each "
            "forward call, and rollout calls (decode steps, other batches) differ from the trainer's, so the "
            "rollout and the trainer would drop different tokens; set model.moe_capacity_factor=null for RL "
            "and rollouts")

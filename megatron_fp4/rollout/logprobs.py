"""Token log-probs from logits: the one definition every side computes them with.

The rollout engine's decode (one position per step), the trainer's scoring forward
(`rollout.scoring.compute_log_probs`, every position at once), the pipelined scorer and policy
losses on the last stage (`log_probs_from_logits`) and verl's batches (temperature-scaled rows)
all take log-softmax rows with `log_softmax_rows` and pick the token with `pick`, so a token's
log-prob is the same function of its logits row everywhere (in the batch-invariant mode the
row's reduction order is fixed, so it has the same bits in any batch).
"""
from __future__ import annotations

import torch

from megatron_fp4.fp4 import invariant
from megatron_fp4.model.layers import upcast
from megatron_fp4.parallel.context import gather_sequence


def log_softmax_rows(logits: torch.Tensor, numerics=None) -> torch.Tensor:
    """log-softmax over the vocabulary (last dim) in fp32 (fp64 for fp64 logits); `numerics`: the
    model's (`fp4.Numerics`: a fixed per-row order in its batch-invariant mode; None: standard)."""
    return invariant.log_softmax(upcast(logits), numerics)


def pick(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """rows [..., V], tokens [...] -> each token's entry of its row [...]."""
    return rows.gather(-1, tokens[..., None]).squeeze(-1)


def next_token_log_probs(rows: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """rows [B, T-1, V] (row t: the distribution after tokens[:, :t+1]) -> [B, T]: position t holds
    log p(tokens[:, t] | tokens[:, :t]), 0 at t=0 and where `keep` is 0."""
    picked = pick(rows, tokens[:, 1:])
    log_probs = torch.cat([picked.new_zeros(tokens.shape[0], 1), picked], dim=1)
    return log_probs * keep.to(log_probs.dtype)


def log_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor, numerics=None,
                          temperature: float = 1.0) -> tuple:
    """(log_probs [B, T] as `next_token_log_probs`, log-softmax rows [B, T-1, V]) of `tokens` under
    `logits` [B, T, V] (`numerics`: as `log_softmax_rows`) divided by `temperature` (verl's):
    log_softmax(z / T) = log_softmax(log_softmax(z) / T), so the rows at T = 1 are the model's own."""
    rows = log_softmax_rows(logits[:, :-1], numerics)
    if temperature != 1.0:
        rows = torch.log_softmax(rows / temperature, dim=-1)
    return next_token_log_probs(rows, tokens, keep), rows


def to_token_positions(per_position: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] about positions -> about the tokens they predict: row t holds position t-1's
    (the one whose output scores token t), row 0 zero. The routing behind `next_token_log_probs`."""
    return torch.cat([torch.zeros_like(per_position[:, :1]), per_position[:, :-1]], dim=1)


def context_parallel_log_probs(local_rows: torch.Tensor, tokens: torch.Tensor, plan) -> torch.Tensor:
    """`next_token_log_probs` (every position kept) under context parallelism (`parallel/context.py`,
    `plan` its `ContextParallelPlan`): `local_rows` [B, T_local, V] are this rank's log-softmax rows,
    `tokens` [B, T] the whole sequence. Each row `pick`s the token after its position (the last
    position a placeholder), the picks are all-gathered into sequence order and moved to the token
    they score (`to_token_positions`): [B, T], the single process's bits. Scoring only: detached."""
    T = tokens.shape[1]
    picked = pick(local_rows, tokens[:, (plan.positions(T, tokens.device) + 1).clamp(max=T - 1)])
    return to_token_positions(gather_sequence(picked.detach(), plan))

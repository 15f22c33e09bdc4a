"""Expert-parallel token exchange, baseline flavour: one variable-split all-to-all each way.

Both expert-parallel dispatchers share the `DispatchPlan` built here (counts exchanged first, the
permutation that regroups received rows by local expert) and the differentiable `all_to_all`.

Row orders, for one MoE layer call on ep rank r (E experts, El = E / ep per rank, contiguous):

- *send order*: the T·k (token, slot) rows sorted stably by global expert — so by destination rank,
  and within a destination by its local expert (what `permute_by_expert` gives).
- *receive order*: as `all_to_all_single` delivers them — by source rank, then local expert.
- *grouped order*: by local expert, then source rank, then the source's token order. This is the
  order the single-process layer sees when the global batch is the ranks' batches concatenated in
  rank order, so per-expert GEMMs see the very same rows in the same order. The single process
  runs each source's micro-batch on its own, though: FP4 wgrad, which quantizes along tokens, is
  therefore computed per source run (`DispatchPlan.expert_segments`) and summed.

Tensor parallel folded into ep (``fold`` = tp > 1, `parallel/moe/tp_moe.py`): each block of ``fold``
consecutive ep ranks holds the sequence chunks of one micro-batch. The grouped order is then by
local expert, then micro-batch (source block), then the token's position in the single process's
micro-batch (`DispatchPlan.exchange(positions=)`, exchanged with the rows), and a segment is one
micro-batch's rows: an expert sees and quantizes each micro-batch's rows as the single process does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_fp4.model.dispatch import Dispatched, Dispatcher, combine_expert_outputs, permute_by_expert


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Plain (non-differentiable) variable-split all-to-all of the rows of x [N, H]."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return all_to_all_rows(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all_rows(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


@dataclass
class DispatchPlan:
    """Who sends what to whom in one dispatcher call (identical on both ends after `exchange`)."""

    order: torch.Tensor          # [T·k] send-order position -> flat (token, slot) index
    token_of_row: torch.Tensor   # [T·k] send-order row -> token
    send_counts: torch.Tensor    # [ep, El] rows this rank sends to dst for dst's local expert
    recv_counts: torch.Tensor    # [ep, El] rows this rank receives from src for its local expert
    perm: torch.Tensor           # [N_recv] grouped-order row -> receive-order row

    @property
    def in_splits(self) -> list[int]:
        return self.send_counts.sum(1).tolist()

    @property
    def out_splits(self) -> list[int]:
        return self.recv_counts.sum(1).tolist()

    @property
    def local_counts(self) -> list[int]:
        """Rows per local expert in grouped order."""
        return self.recv_counts.sum(0).tolist()

    fold: int = 1                # consecutive source ranks holding one micro-batch (module docstring)

    @property
    def expert_segments(self) -> list[list[int]]:
        """Per local expert, its rows from each micro-batch: each source rank's (``fold`` 1) or each
        block of ``fold`` sources' (grouped order: consecutive runs). Each is one micro-batch of the
        single process, so FP4 wgrad quantizes them apart (`GroupedExperts.forward(segments=)`)."""
        ep, num_local = self.recv_counts.shape
        return self.recv_counts.view(ep // self.fold, self.fold, num_local).sum(1).t().tolist()

    @classmethod
    def exchange(cls, topk_idx: torch.Tensor, num_experts: int, ep: int, group, fold: int = 1,
                 positions: torch.Tensor | None = None) -> "DispatchPlan":
        """Sort rows by global expert and exchange the per-(rank, local expert) counts (one small
        all-to-all; the only synchronisation before the token exchange). ``fold`` > 1: also the
        rows' ``positions`` [T] (each token's index in its micro-batch, single-process order)."""
        order, token_of_row, counts = permute_by_expert(topk_idx, num_experts)
        send_counts = counts.view(ep, num_experts // ep).contiguous()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        received = None
        if fold > 1:
            if positions is None or positions.shape[0] != topk_idx.shape[0]:
                raise ValueError("DispatchPlan.exchange: fold > 1 needs the positions of the call's tokens")
            received = all_to_all_rows(positions.to(torch.int64)[token_of_row], recv_counts.sum(1).tolist(),
                                       send_counts.sum(1).tolist(), group)
        return cls(order, token_of_row, send_counts, recv_counts, grouping_permutation(recv_counts, fold, received),
                   fold)


def grouping_permutation(recv_counts: torch.Tensor, fold: int = 1, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Pure: receive-order rows (src-major) -> grouped order (local-expert-major, then src; with
    ``fold`` > 1 then block of ``fold`` sources, then the rows' received ``positions``)."""
    ep, num_local = recv_counts.shape
    blocks = ep // fold
    block_key = torch.arange(num_local).repeat(ep) * blocks + torch.arange(ep).repeat_interleave(num_local) // fold
    key = torch.repeat_interleave(block_key, recv_counts.flatten().cpu())
    if positions is None:
        return torch.argsort(key, stable=True).to(recv_counts.device)
    by_position = torch.argsort(positions.cpu(), stable=True)
    return by_position[torch.argsort(key[by_position], stable=True)].to(recv_counts.device)


def scatter_rows(rows: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """out[index[i]] = rows[i] (differentiable; every output row written exactly once)."""
    out = rows.new_empty((num_rows,) + tuple(rows.shape[1:]))
    return out.index_copy(0, index, rows)


def finish_combine(y_send: torch.Tensor, plan: DispatchPlan, topk_idx: torch.Tensor,
                   topk_w: torch.Tensor) -> torch.Tensor:
    """Send-order expert outputs -> [T, H], summing each token's k outputs by expert index."""
    T, k = topk_idx.shape
    y_slots = scatter_rows(y_send, plan.order, T * k)
    return combine_expert_outputs(y_slots.view(T, k, y_send.shape[-1]), topk_idx, topk_w)


def check_share(dispatcher, experts) -> None:
    """Raise unless `experts` holds one ep rank's share of `dispatcher`'s ``num_experts`` over ``ep``."""
    E, ep = dispatcher.num_experts, dispatcher.ep
    if experts.num_local_experts * ep != E:
        raise ValueError(f"{type(dispatcher).__name__}: the layer's experts hold {experts.num_local_experts} "
                         f"experts, not this rank's share {E // ep} of {E} over ep={ep}")


class AllToAllDispatcher(Dispatcher):
    """Baseline expert-parallel dispatcher: all-to-all out, (local experts), all-to-all back.

    Forward and backward both go through `AllToAll` (variable splits) on `group`; the combine is
    `combine_expert_outputs`, so with per-token-identical expert outputs the result is bitwise the
    single-process layer's. The layer's experts hold only this rank's `num_experts // ep` experts;
    the router's `topk_idx` holds global ids.
    """

    def __init__(self, group, ep: int, num_experts: int, fold: int = 1):
        if fold < 1 or ep % fold:
            raise ValueError(f"AllToAllDispatcher: fold={fold} (tensor-parallel ranks folded into ep) must divide "
                             f"ep={ep}")
        self.group, self.ep, self.num_experts, self.fold = group, ep, num_experts, fold
        self.token_positions = None  # fold > 1: the next call's token positions (set by parallel/moe/tp_moe.py)

    def check_experts(self, experts) -> None:
        check_share(self, experts)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> Dispatched:
        positions, self.token_positions = self.token_positions, None
        plan = DispatchPlan.exchange(topk_idx, self.num_experts, self.ep, self.group, self.fold, positions)
        x_recv = AllToAll.apply(x[plan.token_of_row], plan.out_splits, plan.in_splits, self.group)
        x_grouped = x_recv[plan.perm]
        return Dispatched(x_grouped, plan.local_counts, plan.expert_segments, (plan, topk_idx, topk_w, x_grouped))

    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        plan, topk_idx, topk_w, x_grouped = handle
        if expert_out.shape[0] == 0:  # keep x_recv in the graph: every rank must run both backward exchanges
            expert_out = expert_out + 0 * x_grouped.sum()
        y_recv = scatter_rows(expert_out, plan.perm, expert_out.shape[0])
        y_send = AllToAll.apply(y_recv, plan.in_splits, plan.out_splits, self.group)
        return finish_combine(y_send, plan, topk_idx, topk_w)

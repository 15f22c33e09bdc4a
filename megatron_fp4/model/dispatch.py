"""Token dispatch for the MoE layer: the `Dispatcher` interface and the single-process `LocalDispatcher`.

A dispatcher moves each token's k (token, expert) rows to the experts and the outputs back::

    d = dispatcher.dispatch(x, topk_idx, topk_w)     # Dispatched(tokens, counts, segments, handle)
    y = experts(d.tokens, d.counts, d.segments)      # grouped by local expert
    out = dispatcher.combine(y, d.handle)            # [T, H]

`Dispatcher.run` is exactly these three steps and is what `MoELayer` calls. A dispatcher that
overlaps transfer with expert compute (GC-MoE) overrides `run`, using only the experts' public
compute API (``experts(tokens, counts, segments)``, ``experts.expert(e, tokens)``,
``experts.parameters()``, ``experts.num_local_experts``). The model holds no process group: the
expert-parallel dispatchers (`parallel/moe/alltoall.py`, `parallel/gcmoe*.py`) implement this
interface and are handed to the layer with `MoELayer.set_dispatcher`.

Every dispatcher ends with `combine_expert_outputs`, which sums a token's k expert outputs in
ascending expert-index order — never arrival order — so all layouts give the same bits.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class Dispatched:
    """What `Dispatcher.dispatch` returns: `tokens` [N, H] grouped by local expert, `counts[e]` rows for
    local expert e, `segments[e]` (or None) the row counts of e's runs from distinct sources (each
    a micro-batch of the single process; see `GroupedExperts.forward`), `handle` for `combine`."""

    tokens: torch.Tensor
    counts: list[int]
    segments: Optional[list[list[int]]]
    handle: Any


class Dispatcher(ABC):
    """Moves tokens to the experts and their outputs back (module docstring)."""

    @abstractmethod
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> Dispatched:
        """x [T, H], the router's global expert ids [T, k] and combine weights [T, k] -> `Dispatched`."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """The experts' outputs (rows as `dispatch` grouped them) -> [T, H], each token's k outputs
        weighted and summed in ascending expert index (`combine_expert_outputs`)."""

    def check_experts(self, experts) -> None:
        """Raise if `experts` is not the block this dispatcher sends to (default: anything goes)."""

    def run(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, experts) -> torch.Tensor:
        """The MoE layer's token path: dispatch -> experts -> combine."""
        self.check_experts(experts)
        d = self.dispatch(x, topk_idx, topk_w)
        return self.combine(experts(d.tokens, d.counts, d.segments), d.handle)

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, experts) -> torch.Tensor:
        return self.run(x, topk_idx, topk_w, experts)


def combine_expert_outputs(y_slots: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """y_slots [T, k, H] (slot j = output of expert topk_idx[:, j]) -> weighted sum [T, H], adding
    the k terms in ascending expert index order (a fixed order, whatever the arrival order)."""
    order = torch.argsort(topk_idx, dim=1, stable=True)
    y = torch.gather(y_slots, 1, order[..., None].expand_as(y_slots))
    return weighted_sum_of_slots(y, torch.gather(topk_w, 1, order))


def weighted_sum_of_slots(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_j y[:, j] · w[:, j] for y [T, k, H], w [T, k], added left to right (j = 0, 1, ...).

    The slots are taken by ``unbind``, not by indexing ``y[:, j]``: an index's backward writes its
    gradient into a zeroed [T, k, H] tensor and autograd then adds the k of them (k fills and k − 1
    adds of the whole tensor a layer, issue 37); ``unbind``'s backward stacks the k gradients once.
    The values are the same (each element has one non-zero term; a −0.0 there becomes +0.0 in the
    gather's or index's backward either way, which adds into zeros)."""
    ys, ws = y.unbind(1), w.to(y.dtype).unbind(1)
    out = ys[0] * ws[0][:, None]
    for j in range(1, len(ys)):
        out = out + ys[j] * ws[j][:, None]
    return out


def permute_by_expert(topk_idx: torch.Tensor, num_experts: int):
    """Stable sort of the T·k (token, slot) pairs by expert. Returns (order, token_of_row, counts)."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // topk_idx.shape[1], counts


class LocalDispatcher(Dispatcher):
    """All experts on this process: permute by expert, (experts), un-permute, combine.

    `num_experts`: the model's experts (None: taken from the experts `run` is given)."""

    def __init__(self, num_experts: Optional[int] = None):
        self.num_experts = num_experts

    def check_experts(self, experts) -> None:
        if self.num_experts is None:
            self.num_experts = experts.num_global_experts
        if experts.num_local_experts != experts.num_global_experts:
            raise ValueError(f"LocalDispatcher: the experts hold {experts.num_local_experts} of "
                             f"{experts.num_global_experts} experts; an expert-parallel layer needs its "
                             "expert-parallel dispatcher (parallel.moe.expert_parallel.apply_expert_parallel)")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> Dispatched:
        if self.num_experts is None:
            raise ValueError("LocalDispatcher(num_experts=None).dispatch: give the model's expert count")
        order, token_of_row, counts = permute_by_expert(topk_idx, self.num_experts)
        # index_select, not x[token_of_row]: the same rows (copies), 7x faster at [T·k, 1024] than
        # advanced indexing; its backward (index_add into zeros) adds a token's k row gradients in
        # the same row order as indexing's (index_put with accumulate): the same bits, 1.5x faster
        return Dispatched(x.index_select(0, token_of_row), counts.tolist(), None, (order, topk_idx, topk_w))

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """`combine_expert_outputs` of the slots `dispatch` sent, with its two permutations (rows
        back to slots, slots into expert order) composed into one index: one gather of the expert
        outputs (the same values; its backward one gather by the inverse permutation,
        `permute_rows`) instead of a scatter into slots and a gather, forward and backward."""
        order, topk_idx, topk_w = handle
        T, k = topk_idx.shape
        row_of_slot = inverse_permutation(order)
        by_expert = torch.argsort(topk_idx, dim=1, stable=True)
        rows = row_of_slot.view(T, k).gather(1, by_expert).reshape(-1)
        y = permute_rows(expert_out, rows).view(T, k, -1)
        return weighted_sum_of_slots(y, torch.gather(topk_w, 1, by_expert))


class _PermuteRows(torch.autograd.Function):
    """``x.index_select(0, rows)`` for a permutation ``rows`` of x's rows; backward the gather by the
    inverse permutation. ``index_select``'s own backward is an ``index_add`` into a zeroed tensor:
    a fill and a scatter of the whole gradient where one gather does (each row receives exactly
    one term, so the values are the same; a −0.0 stays −0.0 instead of becoming 0 + −0.0 = +0.0)."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, dy):
        (rows,) = ctx.saved_tensors
        return dy.index_select(0, inverse_permutation(rows)), None


def inverse_permutation(p: torch.Tensor) -> torch.Tensor:
    """The permutation ``q`` with ``q[p[i]] = i`` (``p`` [N] a permutation of ``range(N)``)."""
    q = torch.empty_like(p)
    q[p] = torch.arange(p.numel(), device=p.device)
    return q


def permute_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, rows)``, ``rows`` [N] a permutation of ``range(x.shape[0])`` (each row
    exactly once); under autograd its backward is one gather (`_PermuteRows`)."""
    assert rows.numel() == x.shape[0], "permute_rows: rows must be a permutation of x's rows"
    if torch.is_grad_enabled() and x.requires_grad:
        return _PermuteRows.apply(x, rows)
    return x.index_select(0, rows)

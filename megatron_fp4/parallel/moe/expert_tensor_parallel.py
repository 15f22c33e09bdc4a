"""Expert-tensor parallel (etp): every expert's matrices cut over an etp group, composed with ep.

`apply_expert_tensor_parallel(model, group)` (after `apply_expert_parallel`, on the ep shard) gives
each MoE layer's experts this etp rank's slice of the ffn dim (`GroupedExperts.shard_ffn`): w1/w3
(the gate and up rows of w13) column-cut, w2 row-cut, as Megatron-Core's expert tensor parallel
(GPT-OSS's experts also cut their biases: b13 with w13's rows, b2 along the hidden dim, each rank
adding its columns once to its partial output; `model/gpt_oss.py`).
Every etp rank of an expert block received its own tokens from its dispatcher (all-to-all over
ep, or the local one); `EtpExchange`, the experts' ``token_exchange``, then

1. all-gathers the rows, counts and segments of every etp rank of the group (padded to the
   longest; backward: the reduce-scatter of the input gradients, which the column cut leaves
   partial) and groups them by local expert, then etp rank (`ep_alltoall.grouping_permutation`);
   each (etp rank, source) run stays a segment of its own: a micro-batch of the single process;
2. runs the experts on every row with the local slices: FP4 linears with a `fp4.tensor_cut.TensorCut`
   (w13 column, w2 row), so the amaxes that span the ffn cut are max-reduced over the group;
3. reduce-scatters the partial outputs (the row cut), each rank keeping its own rows (backward:
   the all-gather of their gradients).

So an expert's gradient is complete for its slice on each etp rank (reduced further over edp by
the trainer) and equals the single process's slice up to sum order.

``replicated=True``: the etp ranks already hold the same rows (tensor parallel with
``moe_tokens='whole'`` and the etp group = the tp group: every tp rank routes the whole sequence,
and its ep peers are the same tp coordinate of other dp ranks). Nothing is gathered: each rank runs
its slices on the rows (input gradient summed over etp) and the partial outputs are all-reduced,
as a dense tensor-parallel MLP does; segments and the row order stay the dispatcher's. The rank layout (Megatron's
folding, `parallel/dims.py`): ``rank = (edp·ep + ep_rank)·etp + etp_rank`` within a stage, so an
etp group is ``etp`` consecutive ranks and an ep group takes every ``etp``-th rank. Not with the
GC-MoE dispatchers (their per-expert calls cannot be exchanged; refused by `GroupedExperts.expert`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_fp4.fp4.tensor_cut import TensorCut
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.parallel.moe.alltoall import grouping_permutation, scatter_rows
from megatron_fp4.parallel.tp_comm import _Region, amax_reducer, copy_to_tp, reduce_from_tp


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros((n - x.shape[0],) + tuple(x.shape[1:]))]) if x.shape[0] < n else x


def _gather_rows(x: torch.Tensor, group, rows: list) -> torch.Tensor:
    """Every rank's rows (``rows[r]`` of them), concatenated in rank order."""
    n = max(rows)
    out = x.new_empty((len(rows) * n,) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, _pad_rows(x, n).contiguous(), group=group)
    return torch.cat([part[:k] for part, k in zip(out.split(n), rows)])


def _reduce_scatter_rows(y: torch.Tensor, group, rows: list) -> torch.Tensor:
    """This rank's rows of the sum over the group of ``y`` (every rank's rows in rank order)."""
    n = max(rows)
    padded = torch.cat([_pad_rows(part, n) for part in y.split(rows)])
    out = y.new_empty((n,) + tuple(y.shape[1:]))
    dist.reduce_scatter_tensor(out, padded.contiguous(), group=group)
    return out[:rows[dist.get_rank(group)]]


class EtpExchange:
    """The experts' ``token_exchange`` over one etp group (module docstring)."""

    def __init__(self, group, replicated: bool = False):
        self.group, self.size, self.replicated = group, dist.get_world_size(group), replicated

    def run(self, compute, x: torch.Tensor, counts: list, segments) -> torch.Tensor:
        """``compute(rows, counts, segments)`` (the local experts) on every etp rank's rows; returns
        this rank's rows of the summed outputs."""
        if self.replicated:
            return reduce_from_tp(compute(copy_to_tp(x, self.group), counts, segments), self.group)
        runs = [[int(c)] for c in counts] if segments is None else [[int(v) for v in s] for s in segments]
        width = max(len(r) for r in runs)
        mine = torch.tensor([r + [0] * (width - len(r)) for r in runs], dtype=torch.int64, device=x.device)
        every = torch.empty((self.size * mine.shape[0], width), dtype=torch.int64, device=x.device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        every = every.view(self.size, len(runs), width)  # [etp, local experts, runs]
        per_rank = every.sum(-1)  # [etp, local experts]
        rows = per_rank.sum(1).tolist()
        if max(rows) == 0:  # no rows anywhere: nothing to exchange (the experts keep their graph)
            return compute(x, list(counts), segments)
        x_all = _Region.apply(x, self.group, rows, _gather_rows, _reduce_scatter_rows)
        perm = grouping_permutation(per_rank)
        grouped_segments = [[int(v) for r in range(self.size) for v in every[r, e].tolist()]
                            for e in range(len(counts))]
        y = compute(x_all[perm], per_rank.sum(0).tolist(), grouped_segments)
        y_all = scatter_rows(y, perm, y.shape[0])
        return _Region.apply(y_all, self.group, rows, _reduce_scatter_rows, _gather_rows)


def apply_expert_tensor_parallel(model: nn.Module, group, *, replicated: bool = False) -> nn.Module:
    """Cut every MoE layer's experts of `model` (or a bare `MoELayer`) over the etp `group` (module
    docstring; ``replicated``: the etp ranks route the same tokens). Call on every rank of the group,
    after `apply_expert_parallel`. Returns `model`."""
    etp, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = [model] if isinstance(model, MoELayer) else model.moe_layers()
    if etp == 1:
        return model
    reduce_max = amax_reducer(group)
    for moe in layers:
        if getattr(moe.dispatcher, "fold", 1) != 1:
            raise ValueError("expert-tensor parallel with tensor parallel folded into ep (moe_tokens='local') is "
                             "not implemented yet: use parallel.etp=1 or moe_tokens='whole'")
        full = moe.experts
        if full.token_exchange is not None:
            raise ValueError("apply_expert_tensor_parallel was already applied to this model; apply it once")
        experts = full.shard_ffn(etp, rank)
        name = full.quant_name or "experts"
        w13_cut, w2_cut = TensorCut("column", etp, reduce_max), TensorCut("row", etp, reduce_max)
        # each of gate and up is a column slice of ffn/etp rows; w2 a row slice of ffn/etp columns
        w13_cut.check(experts.recipe, experts.ffn, experts.hidden, f"{name}.w13")
        w2_cut.check(experts.recipe, experts.hidden, experts.ffn, f"{name}.w2")
        experts.w13_cut, experts.w2_cut = w13_cut, w2_cut
        experts.token_exchange = EtpExchange(group, replicated)
        moe.set_experts(experts)
    return model

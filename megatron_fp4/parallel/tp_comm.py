"""The tensor-parallel region's collectives as autograd functions (Megatron-Core's mappings).

- `copy_to_tp`: forward identity, backward all-reduce (the input of a column-parallel linear).
- `reduce_from_tp`: forward all-reduce, backward identity (the output of a row-parallel linear).
- `gather_seq`: forward all-gather along a dim, backward reduce-scatter (sequence parallel: into
  the tensor-parallel region).
- `scatter_seq`: forward reduce-scatter along a dim, backward all-gather (out of it).
- `gather_whole` / `split_whole`: into and out of a region every rank computes whole on the whole
  sequence (the MoE layers under sequence parallel): backward keeps / gathers the chunks.

Every collective is out of place and runs in a fixed rank order on gloo and NCCL, so a run gives the
same bits each time. Chunks along the sequence belong to the ranks in rank order.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    y = x.contiguous().clone()
    dist.all_reduce(y, op=op, group=group)
    return y


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
    dist.all_gather_into_tensor(out, src, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    src = x.movedim(dim, 0).contiguous()
    if src.shape[0] % n:
        raise ValueError(f"sequence parallel: dim {dim} of size {src.shape[0]} does not split over {n} "
                         "tensor-parallel ranks; make the sequence length a multiple of parallel.tp")
    out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=src.dtype, device=src.device)
    dist.reduce_scatter_tensor(out, src, group=group)
    return out.movedim(0, dim)


class _Region(torch.autograd.Function):
    """One collective forward and its adjoint backward: ``forward_op`` / ``backward_op`` each map
    (tensor, group, dim) to a tensor. Every mapping below is one such pair."""

    @staticmethod
    def forward(ctx, x, group, dim, forward_op, backward_op):
        ctx.group, ctx.dim, ctx.backward_op = group, dim, backward_op
        return forward_op(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward_op(g, ctx.group, ctx.dim), None, None, None, None


def _identity(x: torch.Tensor, group, dim) -> torch.Tensor:
    return x.view_as(x)


def _sum(x: torch.Tensor, group, dim) -> torch.Tensor:
    return _all_reduce(x, group)


def _chunk(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"sequence parallel: dim {dim} of size {x.shape[dim]} does not split over {n} "
                         "tensor-parallel ranks; make the sequence length a multiple of parallel.tp")
    return x.chunk(n, dim)[r].contiguous()


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _Region.apply(x, group, None, _identity, _sum)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _Region.apply(x, group, None, _sum, _identity)


def gather_seq(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _Region.apply(x, group, dim, _gather, _reduce_scatter)


def scatter_seq(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _Region.apply(x, group, dim, _reduce_scatter, _gather)


def gather_whole(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """All-gather into a region every rank computes whole (the same values on each): backward keeps
    this rank's chunk of the (equal) gradients."""
    return _Region.apply(x, group, dim, _gather, _chunk)


def split_whole(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of a tensor every rank holds whole; backward all-gathers the chunks' grads."""
    return _Region.apply(x, group, dim, _chunk, _gather)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Element-wise max over the group (no gradient: amax and softmax shifts)."""
    return _all_reduce(x.detach(), group, dist.ReduceOp.MAX)


def amax_reducer(group):
    """The FP4 amax reduction of a tensor-parallel slice (`fp4.tensor_cut.TensorCut.reduce_max`):
    the element-wise max over ``group``."""
    return functools.partial(all_reduce_max, group=group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross entropy per token of logits split along the vocabulary (Megatron-Core's
    ``_VocabParallelCrossEntropy``): the max, the target logit and the sum of exponentials are
    reduced over the group; backward is softmax − one-hot on the local slice."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        vocab_local = logits.shape[-1]
        m = all_reduce_max(logits.max(dim=-1).values, group)
        shifted = logits - m[..., None]
        local = target - vocab_start
        inside = (local >= 0) & (local < vocab_local)
        local = torch.where(inside, local, torch.zeros_like(local))
        picked = shifted.gather(-1, local[..., None])[..., 0] * inside.to(shifted.dtype)
        picked = _all_reduce(picked, group)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp, sum_exp, local, inside)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, g):
        exp, sum_exp, local, inside = ctx.saved_tensors
        grad = exp / sum_exp[..., None]
        grad.scatter_add_(-1, local[..., None], -inside.to(grad.dtype)[..., None])
        return grad * g[..., None], None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy over the targets != `ignore_index` of logits [N, V/tp] (this rank's
    vocabulary slice starting at `vocab_start`), equal on every rank of the group."""
    keep = target != ignore_index
    per_token = _VocabParallelCE.apply(logits, torch.where(keep, target, torch.zeros_like(target)),
                                       vocab_start, group)
    return (per_token * keep.to(per_token.dtype)).sum() / keep.sum().clamp_min(1)

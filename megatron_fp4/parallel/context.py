"""Context parallelism (``parallel.cp``): each sequence split over the ``cp`` ranks of a cp group.

The split is Megatron-Core's load-balanced one: the sequence is cut into ``2·cp`` equal chunks and
rank r holds chunks r and ``2·cp−1−r`` (under a causal mask the early chunks attend to few keys and
the late ones to many, so every rank gets one of each and the same work). What runs where:

- **positions stay global**: each rank's tokens keep their positions in the whole sequence
  (`local_positions`), so RoPE rotates them as the single process does;
- **attention** (`Attention.kv_gather`, set by `parallelize_cp`): the rank's K and V (after
  q/k-norm and RoPE) are all-gathered over the cp group into position order, and its queries attend
  to every key at a position ≤ theirs (the mask from global positions). The gather is autograd
  correct: its backward reduce-scatters dK/dV back to the ranks that own the keys
  (`tp_comm.gather_seq`). The invariant levels' attention (`fp4/invariant.py`) reads keys by
  position already, so ``batch`` and ``exact`` run their own kernels unchanged on the gathered keys;
- **norms, MLP, MoE** run on the local tokens unchanged; the MoE auxiliary losses are the
  micro-batch's (`MoELayer.token_sum` sums token counts over the cp group, each rank's loss is its
  tokens' share, as under ``moe_tp_tokens=local``);
- **the LM loss** (`lm_loss`) is the single process's mean over the micro-batch's labels: every rank
  sums its tokens' cross entropies, divides by the micro-batch's count of labels (every cp rank
  holds the whole micro-batch, so no collective is needed for it) and the shares are summed over
  the group (forward all-reduce, backward identity: each rank's gradient is its share's);
- **gradients**: cp ranks hold the same parameters; ZeRO sums their gradient shares over the dp
  axis, which holds the dp × cp ranks (`parallel/dims.py`), and averages over the dp replicas only.

Under tensor parallel the attention's K/V are a tp rank's heads (gathered over its cp group, whose
ranks are tp apart) and the loss is the vocab-parallel mean of the rank's tokens weighted by their
share of the labels (`training/step_loss.ContextParallelLoss`). Scoring
(`rollout.logprobs.context_parallel_log_probs`) gathers each rank's per-token log-probs back into
sequence order (`gather_sequence`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_fp4.model.layers import Attention, upcast
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.parallel.tp_comm import _all_reduce, gather_seq, reduce_from_tp

__all__ = ["ContextParallelPlan", "parallelize_cp", "local_positions", "split_sequence", "gather_sequence",
           "lm_loss"]


def chunk_slots(cp: int) -> list[int]:
    """The sequence chunk in each slot of the rank-ordered all-gather: rank r's slots 2r, 2r+1
    hold chunks r and 2·cp−1−r."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds, in its local order: chunks r and 2·cp−1−r."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2×parallel.cp = {2 * cp} equal chunks; "
                         f"make schedule.seq_len a multiple of {2 * cp}")
    c = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def natural_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Indices that put the rank-ordered all-gather of every rank's `local_positions` back into
    position order (the inverse permutation of their concatenation)."""
    gathered = torch.cat([local_positions(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(gathered)


@dataclass
class ContextParallelPlan:
    """This rank's place in its cp group: `group` (a process group of `size` ranks) and `rank` in it."""

    group: object
    size: int
    rank: int
    _orders: dict = field(default_factory=dict, repr=False)  # seq_len -> natural_order, built once

    def order(self, seq_len: int, device) -> torch.Tensor:
        key = (seq_len, str(device))
        if key not in self._orders:
            self._orders[key] = natural_order(seq_len, self.size, device)
        return self._orders[key]

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        return local_positions(seq_len, self.size, self.rank, device)


def split_sequence(x: torch.Tensor, plan: ContextParallelPlan, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` (the whole sequence along `dim`, which every cp rank holds)."""
    return x.index_select(dim, plan.positions(x.shape[dim], x.device))


def gather_sequence(x: torch.Tensor, plan: ContextParallelPlan, dim: int = 1) -> torch.Tensor:
    """Every rank's tokens of `x` along `dim` back in sequence order. Autograd: the backward
    reduce-scatters the gradient to the ranks that own the tokens (every rank's gradient of the
    whole sequence is summed)."""
    whole = gather_seq(x, plan.group, dim)
    return whole.index_select(dim, plan.order(whole.shape[dim], x.device))


def gather_kv(k: torch.Tensor, v: torch.Tensor, plan: ContextParallelPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, KV, T_local, D], v [B, KV', T_local, D'] of this rank -> the whole sequence's
    [B, KV, T, D], [B, KV', T, D'] in position order (one all-gather for both). Same last dim (GQA,
    GPT-OSS): joined along the heads. Otherwise (DeepSeek-V3's latent attention passes its per-head
    [non-rotary key | value] and the one rotary key part all heads share) each is flattened per
    token and joined along the features."""
    if k.shape[-1] == v.shape[-1]:
        kv = gather_sequence(torch.cat([k, v], dim=1), plan, dim=2)
        return kv.split([k.shape[1], v.shape[1]], dim=1)
    B, T = k.shape[0], k.shape[2]
    flat = [t.transpose(1, 2).reshape(B, T, -1) for t in (k, v)]
    whole = gather_sequence(torch.cat(flat, dim=-1), plan, dim=1)
    T_all = whole.shape[1]
    k_all, v_all = whole.split([flat[0].shape[-1], flat[1].shape[-1]], dim=-1)
    return (k_all.reshape(B, T_all, k.shape[1], k.shape[3]).transpose(1, 2),
            v_all.reshape(B, T_all, v.shape[1], v.shape[3]).transpose(1, 2))


def parallelize_cp(model: torch.nn.Module, group) -> ContextParallelPlan:
    """Give `model`'s attention the K/V all-gather over `group` and its MoE layers the micro-batch's
    token statistics (`MoELayer.token_sum`); returns the plan the loss and scoring use."""
    plan = ContextParallelPlan(group, dist.get_world_size(group), dist.get_rank(group))
    for m in model.modules():
        if isinstance(m, Attention):
            m.kv_gather = functools.partial(gather_kv, plan=plan)
        elif isinstance(m, MoELayer):
            m.token_sum = functools.partial(_all_reduce, group=group)
    return plan


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, plan: ContextParallelPlan) -> torch.Tensor:
    """The single process's LM loss (`model.lm_loss`: mean next-token cross entropy over the
    micro-batch's labels != -100) from this rank's logits [B, T_local, V] and the whole micro-batch's
    labels [B, T]: Σ of the local cross entropies / the micro-batch's label count, summed over the
    cp group (every rank gets the loss; each rank's gradient is its own share's)."""
    local = split_sequence(labels, plan, 1)
    total = (labels != -100).sum()
    share = F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]), local.reshape(-1), ignore_index=-100,
                            reduction="sum") / total
    return reduce_from_tp(share, plan.group)

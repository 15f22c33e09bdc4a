"""MoE layers under tensor parallelism: whole on every rank, or each rank's own tokens (parallel folding).

Two modes (`parallelize_tp(..., moe_tokens=)`):

- ``whole`` (default): the layer runs whole on every rank on the whole sequence (under sequence
  parallel all-gathered in, the rank's chunk out). Routing, the auxiliary losses and the FP4 expert
  weight gradient see the single process's tokens in its order with any expert layout; the tp
  ranks compute the same thing tp times.
- ``local`` (Megatron-Core's parallel folding): each tp rank routes only its 1/tp chunk of the
  sequence: under sequence parallel the chunk it holds (no all-gather), without it the chunk is
  cut out before the layer and the outputs all-gathered after. The expert layer's ep group may
  then be any refold of the stage's dp·tp ranks (edp × ep × etp, `parallel/dims.py`) without
  counting a token twice. What that takes, and what this module sets up:

  * auxiliary losses of the micro-batch, not of the chunk: `MoELayer.token_sum` sums counts and
    token numbers over the tp group, each rank's loss is its tokens' share (`MoELayer.aux_losses`);
  * the router sees one chunk per rank: its gradient is a partial sum (`TPPlan.partial_grads`,
    summed by `finish_grads`); a shared expert is cut like a dense MLP by `parallelize_tp` and runs
    on the all-gathered sequence (left whole by a bare `moe_local_tokens`: then on the chunk, its
    gradient partial, FP4 refused); the routed experts' gradients are partial
    over the ranks that feed them and are reduced over their expert-data-parallel group, which the
    folding makes hold the remaining ranks of the stage (`TPPlan.expert_grads`: the trainer's edp
    reduction; with ep = 1 the edp group holds the tp ranks);
  * FP4 experts quantize their weight gradient along a micro-batch's tokens in single-process
    order: the ep group must hold the tp ranks as blocks of ``tp`` consecutive ep ranks
    (ep a multiple of tp, etp = 1: ``AllToAllDispatcher(fold=tp)``) and each call hands the
    dispatcher its tokens' positions in the micro-batch; refused otherwise (use ``whole``).

  Not with ``local``: capacity factor (the capacity is a function of the call's tokens), the
  sequence-level aux loss, router replay.
"""
from __future__ import annotations

import functools

import torch

from megatron_fp4.config.choices import MOE_TP_TOKENS as MOE_TOKENS
from megatron_fp4.fp4 import MoEResQLinear
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.parallel.tp_comm import _all_reduce, gather_whole, split_whole


def moe_whole_tokens(moe: MoELayer, plan) -> None:
    """``whole`` under sequence parallel: all-gathered in, this rank's chunk out."""

    def pre(m, args):
        x, rest = args[0], list(args[1:])
        _no_replay(rest)
        x = gather_whole(x, plan.group, 1)
        if len(rest) > 2 and rest[2] is not None:  # the real tokens of the whole sequence
            rest[2] = plan._mask[:, :x.shape[1]] if plan._mask is not None else None
        return (x, *rest)

    moe.register_forward_pre_hook(pre)
    moe.register_forward_hook(lambda m, args, out: split_whole(out, plan.group, 1))


def _no_replay(rest: list, kwargs: dict = {}) -> None:  # noqa: B006 (read only)
    if (len(rest) > 1 and rest[1] is not None) or kwargs.get("routing_in") is not None:
        raise ValueError("router replay (routing_in) with tensor-parallel MoE routing on chunks is not implemented "
                         "yet; set parallel.sequence_parallel=false (and moe_tokens='whole')")


def _fp4_wgrad(moe: MoELayer) -> bool:
    r = moe.experts.recipe
    return r.quantized and r.quantize_backward


def moe_local_tokens(moe: MoELayer, plan) -> None:
    """``local`` (module docstring): this rank routes its chunk of the sequence (dim 1 of [B, T, H],
    dim 0 of [T, H]; under sequence parallel the input already is that chunk)."""
    if moe.capacity_factor is not None or moe.aux_loss_type != "global":
        raise ValueError("tensor parallel with moe_tokens='local' does not take model.moe_capacity_factor or "
                         "model.moe_aux_loss_type=seq (both depend on the whole call's tokens); use moe_tokens='whole'")
    moe.token_sum = functools.partial(_all_reduce, group=plan.group)
    plan.partial_grads += [p for p in moe.router.parameters() if p.requires_grad]
    shared = moe.shared_expert
    if shared is not None and not getattr(shared, "tp_whole_sequence", False):  # run on the chunk: partial
        if any(isinstance(m, MoEResQLinear) and m.recipe.quantized for m in shared.modules()):
            raise ValueError("moe_tokens='local' with an FP4 shared expert needs it cut by parallelize_tp "
                             "(its weight gradient quantizes along the whole sequence)")
        plan.partial_grads += list(shared.parameters())
    plan.expert_grads += list(moe.experts.parameters())

    def pre(m, args, kwargs):
        x, rest = args[0], list(args[1:])
        _no_replay(rest, kwargs)
        dim = x.dim() - 2
        if not plan.sequence_parallel:
            x = split_whole(x, plan.group, dim)
        chunk = x.shape[dim]
        plan._moe_batch = x.shape[0] if dim == 1 else 1
        valid = rest[2] if len(rest) > 2 else kwargs.get("valid")
        if valid is not None:  # this chunk's real tokens
            full = plan._mask if plan.sequence_parallel else valid
            if full is not None and full.shape[-1] != chunk:
                valid = full[..., plan.rank * chunk:(plan.rank + 1) * chunk]
            if len(rest) > 2:
                rest[2] = valid
            else:
                kwargs["valid"] = valid
        _hand_positions(m, x, dim, chunk, plan)
        return (x, *rest), kwargs

    def post(m, args, out):
        return out if plan.sequence_parallel else gather_whole(out, plan.group, out.dim() - 2)

    moe.register_forward_pre_hook(pre, with_kwargs=True)
    moe.register_forward_hook(post)


def _hand_positions(moe: MoELayer, x: torch.Tensor, dim: int, chunk: int, plan) -> None:
    """Give a folding dispatcher the positions of this chunk's tokens in the micro-batch
    (row-major over [B, T]); refuse FP4 weight gradients a dispatcher cannot order."""
    fold = getattr(moe.dispatcher, "fold", 1)
    if fold == plan.size:
        batch = x.shape[0] if dim == 1 else 1
        seq = torch.arange(chunk, device=x.device) + plan.rank * chunk
        moe.dispatcher.token_positions = (torch.arange(batch, device=x.device)[:, None] * chunk * plan.size
                                          + seq[None]).reshape(-1)
    elif _fp4_wgrad(moe) and torch.is_grad_enabled() and moe.training:
        raise ValueError(f"tensor parallel {plan.size} with moe_tokens='local' and FP4 experts needs an "
                         f"expert-parallel all-to-all dispatcher folding the tp ranks (ep a multiple of tp, "
                         f"AllToAllDispatcher(fold={plan.size})), got {type(moe.dispatcher).__name__} with fold "
                         f"{fold}: the FP4 weight gradient quantizes along a micro-batch's tokens; use "
                         "moe_tokens='whole'")

"""The MoE router: top-k softmax in fp32 from an fp32 weight (never quantized), router replay and the
aux-loss-free expert bias. Split from `model/moe.py`, which re-exports these names."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_fp4.fp4 import STANDARD, Numerics, invariant
from megatron_fp4.model.layers import upcast


class Router(nn.Module):
    """Top-k softmax router computed in fp32 (fp64 for an fp64 model) from an fp32 weight; never quantized.

    `expert_bias` (aux-loss-free balancing, DeepSeek-V3; only with ``expert_bias=True``): a per-expert
    buffer added to the probabilities for the top-k selection alone, updated outside the gradient
    (`update_expert_bias`); saved in checkpoints and published to the rollout with the weights."""

    zero_buffers = ("expert_bias",)  # `transformer.materialize` starts these at zero
    numerics = STANDARD  # the model's (`fp4.apply_numerics`)

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, expert_bias: bool = False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)

    def forward(self, x: torch.Tensor, replay: Optional[torch.Tensor] = None):
        """x [T, H] -> (logits fp32 [T, E], probs fp32 [T, E], topk_idx [T, k], topk_w fp32 [T, k]).

        `replay` [T, k] (router replay, R2/R3): expert ids to use instead of the top-k; a row with a
        negative id routes live. The combine weights are the live probabilities gathered at the
        replayed ids (renormalized when `norm_topk_prob`), so the router still gets its gradient, as
        in Megatron-Core's `RouterReplay` (REPLAY_FORWARD: ``scores.gather(1, target_topk_idx)``).
        Replaying the ids the router picks itself gives the same bits as not replaying."""
        logits = router_logits(x, self.weight, self.numerics)
        return (logits, *route_from_logits(logits, self.top_k, self.norm_topk_prob, replay, self.expert_bias,
                                           self.numerics))


def router_logits(x: torch.Tensor, weight: torch.Tensor, numerics: Numerics = STANDARD) -> torch.Tensor:
    """The router's logits [T, E] in fp32 (fp64 for an fp64 model) from x [T, H] and weight [E, H]."""
    return invariant.linear(upcast(x), upcast(weight), None, numerics)


def route_from_logits(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                      replay: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                      numerics: Numerics = STANDARD):
    """(probs [T, E], topk_idx [T, k], topk_w [T, k]) of router logits: softmax, top-k (or the
    replayed ids, `replay_topk`), optional renormalisation (also what the vLLM plugin routes with,
    from the same logits). `bias` [E] (aux-loss-free balancing): the top-k of ``probs + bias``
    selects the experts; the combine weights are the unbiased probabilities there."""
    probs = invariant.softmax(logits, numerics)
    if bias is None:
        topk_w, topk_idx = torch.topk(probs, top_k, dim=-1)
    else:
        topk_idx = torch.topk(probs + bias.to(probs.dtype), top_k, dim=-1).indices
        topk_w = probs.gather(1, topk_idx)
    if replay is not None:
        topk_idx, topk_w = replay_topk(probs, topk_idx, topk_w, replay, logits.shape[-1])
    if norm_topk_prob:
        denom = invariant.last_dim_sum(topk_w, numerics) if invariant.enabled(numerics, topk_w) else \
            topk_w.sum(dim=-1, keepdim=True)
        topk_w = topk_w / denom
    return probs, topk_idx, topk_w


def check_route_dtype(routes: torch.Tensor, where: str) -> None:
    """Routes are expert ids: an integer tensor, else a ValueError. A float route would be cast with
    truncation ([0.9, 1.9] replays as [0, 1]) and a NaN to an arbitrary integer (an all-NaN row
    became negative and routed live), so neither is guessed at."""
    if routes.dtype.is_floating_point or routes.dtype.is_complex or routes.dtype == torch.bool:
        raise ValueError(f"{where}: routes of dtype {routes.dtype} must be integer expert ids (torch.long; -1: route "
                         "live); round or convert them where they are recorded, not here")


def replay_topk(probs: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, replay: torch.Tensor,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's (ids, weights) with the rows of `replay` [T, k] that hold ids (>= 0) replaced by
    them and the live `probs` gathered there; rows with a negative id keep the live top-k."""
    if replay.shape != topk_idx.shape:
        raise ValueError(f"router replay: routes of shape {tuple(replay.shape)} for {tuple(topk_idx.shape)} "
                         "(tokens, top_k) router picks; give one row of top_k expert ids per token")
    check_route_dtype(replay, "router replay")
    replay = replay.to(device=topk_idx.device, dtype=topk_idx.dtype)
    replayed = (replay >= 0).all(-1, keepdim=True)
    ordered = replay.sort(-1).values
    too_big, mixed = replay >= num_experts, (replay >= 0) != replayed
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & replayed
    if bool(too_big.any() | mixed.any() | repeated.any()):  # one device sync for all three checks
        if bool(too_big.any()):
            raise ValueError(f"router replay: expert id {int(replay.max())} out of range for {num_experts} experts")
        if bool(mixed.any()):
            raise ValueError("router replay: a token's routes must be all expert ids or all negative (route live)")
        raise ValueError("router replay: a token's replayed expert ids must be distinct")
    idx = torch.where(replayed, replay, topk_idx)
    return idx, torch.where(replayed, probs.gather(1, idx), topk_w)



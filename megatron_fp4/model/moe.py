"""The MoE feed-forward: an fp32 router, grouped SwiGLU experts in FP4 (MoEResQ), auxiliary losses.

The router lives in `model/router.py`, the experts in `model/experts.py` and token movement in
`model/dispatch.py` (re-exported here). Token movement is delegated to a `Dispatcher` given to the
layer (`LocalDispatcher` by default; `parallel/moe/expert_parallel.py` supplies the expert-parallel
ones through `MoELayer.set_dispatcher`), so the model knows nothing about process groups.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.dispatch import (Dispatched, Dispatcher, LocalDispatcher,  # noqa: F401 (re-exported)
                                         combine_expert_outputs, permute_by_expert)
from megatron_fp4.model.experts import (GroupedExperts, can_group, can_group_exact,  # noqa: F401 (re-exported)
                                        can_group_fp4)
from megatron_fp4.model.layers import SwiGLU
from megatron_fp4.model.moe_balance import seq_balance_loss, update_expert_bias  # noqa: F401 (the trainer's hook)
from megatron_fp4.model.capacity import capacity_keep, expert_capacity
from megatron_fp4.model.router import Router, replay_topk, route_from_logits, router_logits  # noqa: F401


class AuxLossAutoScaler(torch.autograd.Function):
    """Megatron's trick: return `output` unchanged, and in backward inject d(aux)/d(aux) = scale.

    The auxiliary loss then reaches the router gradients from whichever pipeline stage computed
    it, without being threaded through the stage outputs to the loss function.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class MoELayer(nn.Module):
    """Router + experts (+ optional shared expert). Records per-step statistics for logging."""

    zero_buffers = ("tokens_per_expert",)  # `transformer.materialize` starts these at zero

    def __init__(self, hidden: int, num_experts: int, top_k: int, ffn: int, recipe: Recipe,
                 norm_topk_prob: bool = True, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 num_shared_experts: int = 0, shared_ffn: int = 0, bias_update_rate: float = 0.0,
                 aux_loss_type: str = "global", dispatcher: Optional[Dispatcher] = None,
                 capacity_factor: Optional[float] = None, drop_policy: str = "probs"):
        """`dispatcher`: how tokens reach the experts (default `LocalDispatcher`; see `set_dispatcher`).
        `capacity_factor` (None: no capacity): each expert takes at most ceil(T·k/E·factor) of a
        call's (token, slot) pairs, dropping the rest by `drop_policy` (`model/capacity.py`)."""
        super().__init__()
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.aux_loss_type = aux_loss_type  # global: over all of the batch's tokens | seq: per sequence, mean
        self.bias_update_rate = bias_update_rate
        self.router = Router(hidden, num_experts, top_k, norm_topk_prob, expert_bias=bias_update_rate > 0)
        # real tokens per expert since the last `update_expert_bias` (training forwards, not recomputes)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float64)
                             if bias_update_rate > 0 else None, persistent=False)
        self.count_load = True  # off while activation recomputation re-runs the forward
        self.experts = GroupedExperts(num_experts, hidden, ffn, recipe)
        self.shared_expert = SwiGLU(hidden, shared_ffn * num_shared_experts, recipe) if num_shared_experts else None
        self._dispatcher = None
        self.set_dispatcher(LocalDispatcher(num_experts) if dispatcher is None else dispatcher)
        # Gradient scale of the auxiliary losses (1/num_microbatches, set by the trainer).
        self.aux_loss_scale = 1.0
        self.stats: list[dict] = []  # appended each training forward; drained by the trainer
        self.record_stats = False
        # Tensor parallel with local MoE tokens (`parallel/moe/tp_moe.py`): sums a tensor over the ranks
        # holding this micro-batch's other tokens (no gradient); None: this call's tokens are all.
        self.token_sum = None

    @property
    def dispatcher(self) -> Dispatcher:
        """The layer's `Dispatcher` (read-only: replace it with `set_dispatcher`)."""
        return self._dispatcher

    def set_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Route this layer's tokens through `dispatcher` (a `model.dispatch.Dispatcher`: expert
        parallelism installs its own with `self.experts` replaced by the rank's block, `set_experts`)."""
        if not isinstance(dispatcher, Dispatcher):
            raise TypeError(f"MoELayer.set_dispatcher: {type(dispatcher).__name__} is not a "
                            "megatron_fp4.model.dispatch.Dispatcher (implement dispatch/combine, or run)")
        self._dispatcher = dispatcher

    def set_experts(self, experts: GroupedExperts) -> None:
        """Replace the experts by another block of the same model's experts (expert parallelism:
        this rank's `GroupedExperts.shard`)."""
        if experts.num_global_experts != self.num_experts:
            raise ValueError(f"MoELayer.set_experts: experts of a {experts.num_global_experts}-expert model "
                             f"for a {self.num_experts}-expert layer")
        self.experts = experts

    def aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor,
                   valid: Optional[torch.Tensor] = None):
        """Switch-style load balancing E·Σ f_e·P_e and the router z-loss mean(logsumexp²), over the
        tokens `valid` [T] marks (None: all; padding is left out, as Megatron-Core and HF's
        ``load_balancing_loss_func(attention_mask=)`` do). Statistics of this rank's tokens; with
        `token_sum`, of the micro-batch's tokens on every rank sharing it: counts and token numbers
        are summed over them and each rank's losses are its tokens' terms of the micro-batch's
        losses (they add up to the single process's, and so do the router gradients)."""
        if self.token_sum is not None:
            return self._shared_aux_losses(logits, probs, topk_idx, valid)
        if valid is None:  # packed batches: the unmasked path, unchanged bits
            T = logits.shape[0]
            counts = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)
            f = counts.float() / max(T * self.top_k, 1)
            p = probs.mean(dim=0)
            balance = self.num_experts * (f * p).sum()
            z = torch.logsumexp(logits, dim=-1).pow(2).mean()
            return balance, z, counts
        keep = valid.reshape(-1).to(torch.bool)
        w = keep.to(probs.dtype)
        n = w.sum().clamp_min(1.0)  # no real token: both losses 0 (and no device sync)
        counts = torch.bincount(topk_idx.reshape(-1), weights=keep.repeat_interleave(self.top_k).to(torch.float64),
                                minlength=self.num_experts).to(torch.long)
        f = counts.to(probs.dtype) / (n * self.top_k)
        p = (probs * w[:, None]).sum(dim=0) / n
        balance = self.num_experts * (f * p).sum()
        z = (torch.logsumexp(logits, dim=-1).pow(2) * w).sum() / n
        return balance, z, counts

    def _shared_aux_losses(self, logits, probs, topk_idx, valid):
        w = torch.ones(logits.shape[0], dtype=probs.dtype, device=probs.device) if valid is None else \
            valid.reshape(-1).to(probs.dtype)
        n = self.token_sum(w.sum()).clamp_min(1.0)
        counts = torch.bincount(topk_idx.reshape(-1), weights=w.to(torch.float64).repeat_interleave(self.top_k),
                                minlength=self.num_experts)
        counts = self.token_sum(counts).to(torch.long)
        # the unmasked single-process path's f is fp32 (counts.float()): the same here
        f = counts.float() / (n.item() * self.top_k) if valid is None else counts.to(probs.dtype) / (n * self.top_k)
        balance = self.num_experts * (f * ((probs * w[:, None]).sum(dim=0) / n)).sum()
        z = (torch.logsumexp(logits, dim=-1).pow(2) * w).sum() / n
        return balance, z, counts

    def forward(self, x: torch.Tensor, routing_out: Optional[list] = None,
                routing_in: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., H]; `routing_out`: the experts used are appended ([..., k]); `routing_in` [..., k]:
        expert ids to replay (negative rows route live, see `Router.forward`); `valid` [...]: the real
        (non-padding) tokens, the only ones the auxiliary losses count (None: all). The auxiliary
        losses are computed from the ids used and the live probabilities (Megatron-Core: the same)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        replay = None if routing_in is None else routing_in.reshape(-1, self.top_k)
        # without replay the router is called as before (its one-argument form, which tests wrap)
        logits, probs, topk_idx, topk_w = self.router(x2) if replay is None else self.router(x2, replay)
        if self.capacity_factor is None:
            out = self._dispatcher.run(x2, topk_idx, topk_w, self.experts)
        else:
            out = self._run_with_capacity(x2, topk_idx, topk_w)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        out = out.view(shape)
        if routing_out is not None:
            routing_out.append(topk_idx.view(*shape[:-1], self.top_k))
        if self.training and x2.shape[0] > 0:
            balance, z, counts = self.aux_losses(logits, probs, topk_idx, valid)
            if self.aux_loss_type == "seq":
                balance = seq_balance_loss(probs, topk_idx, valid, shape[0] if len(shape) == 3 else 1)
            if self.tokens_per_expert is not None and self.count_load:
                self.tokens_per_expert += counts
            aux = self.aux_loss_coef * balance + self.z_loss_coef * z
            # Both coefficients 0 (e.g. RL): no auxiliary gradient at all, not even 0·NaN.
            if torch.is_grad_enabled() and aux.requires_grad and (self.aux_loss_coef or self.z_loss_coef):
                out = AuxLossAutoScaler.apply(out, aux, self.aux_loss_scale)
            if self.record_stats:
                self.stats.append({"aux_loss": balance.detach(), "z_loss": z.detach(), "counts": counts.detach()})
        return out


    def _run_with_capacity(self, x2: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """The token path with the pairs over capacity dropped: the kept (token, slot) pairs go
        through the dispatcher as one-slot rows in their flat order (so each expert sees its kept
        rows in the order it would see them with every pair kept) and are combined here in
        ascending expert order, a dropped slot adding nothing. Any dispatcher serves unchanged."""
        T, k = topk_idx.shape
        keep = capacity_keep(topk_idx, topk_w, self.num_experts,
                             expert_capacity(T, k, self.num_experts, self.capacity_factor), self.drop_policy)
        flat_keep = keep.reshape(-1).nonzero().squeeze(1)
        pair_idx = topk_idx.reshape(-1)[flat_keep][:, None]
        y = self._dispatcher.run(x2[flat_keep // k], pair_idx, torch.ones_like(pair_idx, dtype=topk_w.dtype),
                                 self.experts)
        y_slots = y.new_zeros(T * k, y.shape[-1]).index_copy(0, flat_keep, y)
        return combine_expert_outputs(y_slots.view(T, k, -1), topk_idx, topk_w * keep.to(topk_w.dtype))


def init_moe_params(layer: MoELayer, std: float, out_std: float, generator: torch.Generator) -> None:
    """A bare layer's init from one generator (tests and benchmarks of a single MoE layer; the
    model's own init is `transformer.init_weights`)."""
    with torch.no_grad():
        layer.router.weight.normal_(0, std, generator=generator)
        layer.experts.w13.normal_(0, std, generator=generator)
        layer.experts.w2.normal_(0, out_std, generator=generator)

